"""SIGTERM and SIGINT drain `llmgw server`, `llmgw agent` and `llmgw up` (issue 12).

Real processes on loopback. The server test runs a bounded load loop of short streams,
plain requests and streams too long to finish, signals the server while some of each
are in flight, and counts every request's end exactly: each stream completed or ended
with an SSE error event (none cut bare), and the usage stored equals what the clients
were answered. No timing is asserted: the only clock is the server's own grace.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.system.harness import (
    LLMGW, WAIT, Cluster, Proc, alive, engines_under, eventually, iter_replicas, ready_replicas, serve_sim_model,
    sse_events,
)

pytestmark = pytest.mark.system

#: The server's shutdown grace in these tests: short answers (SHORT_TOKENS, 0.4 s) finish
#: well inside it; long streams cannot (the simulated engine's natural answers are 24 to
#: 88 tokens, 4.8 s or more) and are ended with an error event.
GRACE = "1.5s"
#: Microseconds per generated token of the simulated engine.
DECODE_US_PER_TOKEN = 200_000
SHORT_TOKENS = 2
LONG_TOKENS = 8_000  # under the engine's 8,192-token context: the answer's natural length ends it
#: Clients in the load loop, and the bound on each one's requests.
CLIENTS = 6
MAX_REQUESTS_PER_CLIENT = 500
#: Signal once this many long streams are in flight and this many requests were answered.
LONG_IN_FLIGHT = 2
ANSWERED_BEFORE_SIGNAL = 12


@attrs.define
class Tally:
    """How each request of the load loop ended, and the usage its answer reported."""

    completed: int = 0  # a stream that ended with [DONE], or a plain 200
    error_ended: int = 0  # a stream whose last event was an SSE error, then its clean end
    long_cut: int = 0  # of those, the long streams
    bare_cuts: list[str] = attrs.field(factory=list)  # anything else
    prompt_tokens: int = 0
    completion_tokens: int = 0
    long_streaming: int = 0  # long streams that received their first chunk
    stopping: bool = False  # set just before the signal: no new requests after it
    changed: trio.Event = attrs.field(factory=trio.Event)

    def note(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    @property
    def answered(self) -> int:
        return self.completed + self.error_ended


def body(kind: str) -> dict[str, Any]:
    tokens = LONG_TOKENS if kind == "long" else SHORT_TOKENS
    request: dict[str, Any] = {"model": "m1", "messages": [{"role": "user", "content": f"drain {kind}"}],
                               "max_tokens": tokens}
    if kind != "plain":
        request.update(stream=True, stream_options={"include_usage": True})
    return request


async def one_stream(http: httpx.AsyncClient, kind: str, tally: Tally) -> None:
    """Send one streamed request and count how it ended."""
    events: list[Any] = []
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body(kind)) as response:
            if response.status_code != 200:
                tally.bare_cuts.append(f"{kind}: status {response.status_code}")
                return
            async for event in sse_events(response):
                events.append(event)
                if kind == "long" and len(events) == 1:
                    tally.long_streaming += 1
                    tally.note()
    except httpx.HTTPError as error:
        tally.bare_cuts.append(f"{kind}: {error!r} after {len(events)} events")
        return
    if events and events[-1] == "[DONE]":
        usage = [e["usage"] for e in events[:-1] if e.get("usage")]
        assert len(usage) == 1, f"a completed stream carries one usage chunk: {events[-3:]}"
        tally.completed += 1
        tally.prompt_tokens += usage[0]["prompt_tokens"]
        tally.completion_tokens += usage[0]["completion_tokens"]
    elif events and isinstance(events[-1], dict) and "error" in events[-1]:
        assert events[-1]["error"]["code"] == "server_shutting_down", events[-1]
        assert not any(isinstance(e, dict) and e.get("usage") for e in events), "cut before its usage chunk"
        tally.error_ended += 1
        tally.long_cut += kind == "long"
    else:
        tally.bare_cuts.append(f"{kind}: ended without [DONE] or an error event after {len(events)} events")


async def one_plain(http: httpx.AsyncClient, tally: Tally) -> None:
    try:
        response = await http.post("/v1/chat/completions", json=body("plain"))
    except httpx.HTTPError as error:
        tally.bare_cuts.append(f"plain: {error!r}")
        return
    if response.status_code != 200:
        tally.bare_cuts.append(f"plain: status {response.status_code}")
        return
    usage = response.json()["usage"]
    tally.completed += 1
    tally.prompt_tokens += usage["prompt_tokens"]
    tally.completion_tokens += usage["completion_tokens"]


async def client_loop(gateway: str, index: int, tally: Tally) -> None:
    """One client: the first LONG_IN_FLIGHT send one long stream once ANSWERED_BEFORE_SIGNAL
    requests were answered; the others send short streams and plain requests until
    ``tally.stopping`` (at most MAX_REQUESTS_PER_CLIENT)."""
    async with httpx.AsyncClient(base_url=gateway, timeout=WAIT) as http:
        if index < LONG_IN_FLIGHT:
            await wait_until(tally, lambda: tally.answered >= ANSWERED_BEFORE_SIGNAL, "answers before the long streams")
            await one_stream(http, "long", tally)
            tally.note()
            return
        for n in range(MAX_REQUESTS_PER_CLIENT):
            if tally.stopping:
                return
            if n % 2:
                await one_plain(http, tally)
            else:
                await one_stream(http, "short", tally)
            tally.note()


async def wait_until(tally: Tally, condition: Any, what: str) -> None:
    with trio.move_on_after(WAIT):
        while not condition():
            await tally.changed.wait()
        return
    raise AssertionError(f"timed out after {WAIT:g}s waiting for {what}: {tally}")


async def test_server_sigterm_drains_streams_and_keeps_usage_exact(tmp_path: Path) -> None:
    async with Cluster(tmp_path, extra={"gateway": {"shutdown_grace": GRACE}}) as cluster:
        server = await serve_sim_model(cluster, "m1", 2, f"--arg=--decode-us-per-token={DECODE_US_PER_TOKEN}")

        tally = Tally()
        async with trio.open_nursery() as nursery:
            for index in range(CLIENTS):
                nursery.start_soon(client_loop, cluster.gateway, index, tally)
            await wait_until(tally, lambda: tally.long_streaming == LONG_IN_FLIGHT, "long streams in flight")
            tally.stopping = True
            server.signal(signal.SIGTERM)
        assert await server.wait_exit() == 0, server.output()[-3000:]
        assert "Traceback" not in server.output()

        assert tally.bare_cuts == [], f"{len(tally.bare_cuts)} requests cut bare: {tally.bare_cuts[:5]}"
        assert tally.long_cut == LONG_IN_FLIGHT, f"each long stream ends with one error event: {tally}"
        assert tally.completed >= ANSWERED_BEFORE_SIGNAL

        # The usage stored (read by a server started again on the same store) is exactly
        # what the clients were answered: every request, and the tokens of the completed ones.
        await cluster.start_server()
        [row] = [u for u in cluster.ctl_json("usage") if u["model"] == "m1"]
        assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (
            tally.answered, tally.prompt_tokens, tally.completion_tokens)


async def test_agent_sigterm_exits_zero_and_leaves_engines_to_the_next_agent(tmp_path: Path) -> None:
    async with Cluster(tmp_path) as cluster:
        agent = await cluster.start_agent("node-a")
        assert cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "2").returncode == 0
        before = sorted(r["pid"] for r in await ready_replicas(cluster, "m1", 2))

        agent.signal(signal.SIGTERM)
        assert await agent.wait_exit() == 0, agent.output()[-3000:]
        assert "Traceback" not in agent.output()
        assert all(alive(pid) for pid in before), "SIGTERM leaves the engines running"

        await cluster.start_agent("node-a")

        async def adopted() -> list[int] | None:
            rows = [r for r in iter_replicas(cluster, "m1") if r["state"] == "ready"]
            pids = sorted(r["pid"] for r in rows)
            return pids if pids == before else None

        assert await eventually(adopted, "both engines adopted by the next agent") == before


async def test_up_ends_on_sigint_during_an_rpc_callback_storm(tmp_path: Path) -> None:
    """The failure this guards against: SIGINT raised as KeyboardInterrupt inside a Cap'n
    Proto server callback (an agent's KV update) became an RPC error and `up` kept running."""
    env = {"XDG_DATA_HOME": str(tmp_path / "xdg")}
    up = Proc([*LLMGW, "up", "--engine", "sim", "--replicas", "2", "--http-port", "0", "--rpc-port", "0",
               "--log-level", "info"],
              tmp_path / "up.log", env=env)
    try:
        m = await up.wait_for_line(r"OpenAI endpoint : (\S+)/v1 .*ready replica")
        gateway = m.group(1)
        served = 0
        changed = trio.Event()

        async def storm(worker: int) -> None:
            # Distinct prompts: every answer stores new KV blocks, so the agent sends KV
            # updates to the control plane (server callbacks) the whole time.
            nonlocal served, changed
            async with httpx.AsyncClient(base_url=gateway, timeout=WAIT) as http:
                for n in range(MAX_REQUESTS_PER_CLIENT):
                    prompt = f"storm {worker} {n} " * 40
                    try:
                        await http.post("/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 2})
                    except httpx.HTTPError:
                        return  # `up` is gone: the storm is over
                    served += 1
                    changed.set()
                    changed = trio.Event()

        async with trio.open_nursery() as nursery:
            for worker in range(CLIENTS):
                nursery.start_soon(storm, worker)
            with trio.fail_after(WAIT):
                while served < ANSWERED_BEFORE_SIGNAL:
                    await changed.wait()
            up.signal(signal.SIGINT)
            assert await up.wait_exit() == 0, up.output()[-3000:]
            nursery.cancel_scope.cancel()
        assert "Traceback" not in up.output()
        # Every request was a two-token answer: none should hold the gateway's drain until
        # its grace runs out (a connection whose next request came early once did).
        assert "shutdown grace" not in up.output(), up.output()[-3000:]
        assert engines_under(tmp_path) == [], "llmgw up stops its engines on Ctrl-C"
    finally:
        up.kill()
