"""The simulated engine served in-process under trio: cancellation and concurrency accounting."""

import httpx
import trio

from llmgw.sim import SimConfig, serve

MODEL = "inproc"


async def wait_until(predicate, timeout=10.0):
    with trio.fail_after(timeout):
        while not await predicate():
            await trio.sleep(0.01)  # polling interval, not synchronisation: the deadline bounds it


async def test_client_gone_mid_stream_releases_the_request(nursery):
    cfg = SimConfig(model=MODEL, port=0, decode_us_per_token=200_000.0)  # 0.2 s per token: the stream is slow
    engine, port = await nursery.start(serve, cfg)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as client:
        body = {"model": MODEL, "prompt": "slow stream", "max_tokens": 50, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                break  # first chunk arrived while the engine still runs the request
            assert engine.running == 1
        # Closing the response drops the connection: the engine must notice and free the slot.
        await wait_until(lambda: _running_is(client, 0.0))
        assert engine.running == 0 and engine.running_blocks == 0


async def _running_is(client, value):
    text = (await client.get("/metrics")).text
    line = next(l for l in text.splitlines() if l.startswith("vllm:num_requests_running{"))
    return float(line.rsplit(" ", 1)[1]) == value


async def test_waiting_counts_requests_over_max_num_seqs(nursery):
    cfg = SimConfig(model=MODEL, port=0, max_num_seqs=1, decode_us_per_token=100_000.0)
    engine, port = await nursery.start(serve, cfg)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as client:
        results = []

        async def one():
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "q", "max_tokens": 3})
            results.append(r.status_code)

        async with trio.open_nursery() as inner:
            inner.start_soon(one)
            inner.start_soon(one)

            async def queued():
                return engine.running == 1 and engine.waiting == 1

            await wait_until(queued)
        assert results == [200, 200] and engine.waiting == 0 and engine.running == 0
