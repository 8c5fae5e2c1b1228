"""Shard.drain (through the supervisor) against a real simulated engine with its secret set:
not idle while a slow stream runs there, idle once it ended, and the stream complete."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio

from llmgw.node.engines.sim import SimEngine
from llmgw.node.supervisor import Supervisor
from llmgw.spec import ShardSpec, ShardState
from tests.component.test_supervisor import FAST, WAIT, Recorder, state_dir  # noqa: F401  (a fixture)

SECRET = "drain-test-secret"
TOKENS = 8
# 0.25 s per generated token: the stream lasts ~2 s, far longer than a drain poll.
DECODE_US_PER_TOKEN = "250000"


async def _stream(endpoint: str, first_chunk: trio.Event, chunks: list[dict]) -> None:
    """Streams one completion of TOKENS tokens into ``chunks``; sets ``first_chunk`` on the first."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": TOKENS, "stream": True, "ignore_eos": True}
    headers = {"authorization": f"Bearer {SECRET}"}
    async with httpx.AsyncClient(timeout=WAIT, trust_env=False) as client:
        async with client.stream("POST", endpoint + "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
                    first_chunk.set()
                elif line == "data: [DONE]":
                    chunks.append({"done": True})


async def test_drain_waits_for_the_stream_in_flight(state_dir: Path) -> None:  # noqa: F811
    spec = ShardSpec(id="s1", model="tiny", engine="sim", source="tiny", api_key=SECRET,
                     args=("--decode-us-per-token", DECODE_US_PER_TOKEN))
    rec = Recorder()
    async with trio.open_nursery() as nursery:
        sup = Supervisor(state_dir, engines={"sim": SimEngine()}, policy=FAST)
        await nursery.start(sup.run)
        await sup.start_shard(spec, rec)
        ready = await rec.wait_state(ShardState.READY)
        assert (await sup.drain_shard("s1", 5.0)).idle  # nothing in flight: idle at once

        first_chunk = trio.Event()
        chunks: list[dict] = []
        stream_done = trio.Event()

        async def stream() -> None:
            await _stream(ready.endpoint, first_chunk, chunks)
            stream_done.set()

        nursery.start_soon(stream)
        with trio.fail_after(WAIT):
            await first_chunk.wait()
        busy = await sup.drain_shard("s1", 0.3)
        assert (busy.idle, busy.in_flight, busy.probed) == (False, 1, True)

        with trio.fail_after(WAIT):
            drained = await sup.drain_shard("s1", WAIT)
        assert drained.idle and drained.probed
        # A rollout stops the engine right after the drain: the stream was complete by then.
        await sup.stop_shard("s1", grace=5)
        with trio.fail_after(WAIT):
            await stream_done.wait()
        assert chunks[-1] == {"done": True}
        text = "".join(c["choices"][0]["text"] for c in chunks[:-1] if c.get("choices"))
        assert any(c.get("choices") and c["choices"][0].get("finish_reason") == "length" for c in chunks[:-1]), text
        nursery.cancel_scope.cancel()
