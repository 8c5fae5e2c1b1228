"""The gateway's memory stays flat under sustained traffic (no per-request leak).

The gateway runs in its own process (this module run as a script: ``python -m
tests.component.test_gateway_memory SIM_URL``), so its RSS is its own; the engine is a
``python -m llmgw.sim`` subprocess. 32 keep-alive raw-socket clients send 2,000 warm-up
requests, the gateway's RSS is read, then 20,000 more, and RSS is read again. A bound
on growth, not on time: a leak of even ~1 KB per request (20 MB) fails.
"""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import trio

from llmgw.router import Replica, ReplicaTable, create_app, serve_gateway
from llmgw.sim.launch import start_sim

MODEL = "mem-model"
CONCURRENCY = 32
WARMUP = 2_000
MEASURED = 20_000
MAX_GROWTH_BYTES = 20 * 1024 * 1024
DEADLINE_S = 300  # whole-test bound: a hang fails instead of sticking
START_TIMEOUT_S = 30


async def _serve(sim_url: str) -> None:
    table = ReplicaTable()
    table.set_model_replicas(MODEL, [Replica("s0", MODEL, sim_url, "node-1")])
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_gateway, create_app(table), "127.0.0.1", 0)
        print(port, flush=True)
        await trio.sleep_forever()


def _request(i: int) -> bytes:
    # Alternate endpoints and an error path, so every common path is measured.
    if i % 10 == 0:
        path, body = "/v1/chat/completions", {"model": "absent", "messages": []}  # 404
    elif i % 3 == 0:
        path, body = "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": f"q{i % 50}"}], "max_tokens": 2}
    else:
        path, body = "/v1/completions", {"model": MODEL, "prompt": f"p{i % 50}", "max_tokens": 2}
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
            .encode() + raw)


async def _drive(port: int, total: int) -> int:
    """Send ``total`` requests over CONCURRENCY keep-alive connections; return how many got 200."""
    ok = 0
    counter = iter(range(total))

    async def worker() -> None:
        nonlocal ok
        async with await trio.open_tcp_stream("127.0.0.1", port) as conn:
            buffer = b""
            for i in counter:
                await conn.send_all(_request(i))
                while b"\r\n\r\n" not in buffer:
                    chunk = await conn.receive_some(65536)
                    assert chunk, "the gateway closed a keep-alive connection"
                    buffer += chunk
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
                while len(buffer) < length:
                    chunk = await conn.receive_some(65536)
                    assert chunk, "the gateway closed mid-response"
                    buffer += chunk
                status = int(head.split(b" ")[1])
                assert status == (404 if i % 10 == 0 else 200), (status, buffer[:length])
                ok += status == 200
                buffer = buffer[length:]

    async with trio.open_nursery() as nursery:
        for _ in range(CONCURRENCY):
            nursery.start_soon(worker)
    return ok


async def test_gateway_memory_stays_flat_over_20000_requests() -> None:
    sim = await trio.to_thread.run_sync(lambda: start_sim(["--model", MODEL, "--port", "0"]))
    gateway = subprocess.Popen([sys.executable, "-m", "tests.component.test_gateway_memory", sim.url],
                               stdout=subprocess.PIPE, text=True)
    try:
        with trio.fail_after(DEADLINE_S):
            assert gateway.stdout is not None
            with trio.fail_after(START_TIMEOUT_S):
                port = int(await trio.to_thread.run_sync(gateway.stdout.readline))
            process = psutil.Process(gateway.pid)
            assert await _drive(port, WARMUP) == WARMUP - WARMUP // 10
            before = process.memory_info().rss
            assert await _drive(port, MEASURED) == MEASURED - MEASURED // 10
            after = process.memory_info().rss
        growth = after - before
        assert growth < MAX_GROWTH_BYTES, f"gateway RSS grew by {growth / 2**20:.1f} MiB over {MEASURED} requests"
    finally:
        gateway.kill()
        gateway.wait()
        await trio.to_thread.run_sync(sim.stop)


if __name__ == "__main__":
    trio.run(_serve, sys.argv[1])
