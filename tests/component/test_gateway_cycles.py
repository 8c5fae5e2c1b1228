"""A served request leaves no reference cycles behind: its objects are freed when it ends.

Objects in a cycle outlive their request until the garbage collector finds them, and a
collection over many requests' worth of them is a pause for every request in flight (a
reference cycle through the ASGI scope once raised the gateway's p99 at concurrency 1
from ~1 to ~3 ms in bench/relaycost.py). The gateway runs in this process, the engine in
its own (``python -m llmgw.sim``); with the collector off, requests and streams go through,
and then one collection must find next to nothing.
"""

from __future__ import annotations

import gc
import json

import trio

from llmgw.router import Replica, ReplicaTable, create_app, serve_gateway
from llmgw.sim.launch import start_sim

MODEL = "cycle-model"
WARMUP = 50  # first requests create what lives on (pooled connections, metric children, caches)
REQUESTS = 300
STREAMS = 50
# What one collection may find after REQUESTS + STREAMS requests: well under one object a
# request (a cycle per request would be several each: the scope, its dicts, the exchange).
MAX_UNREACHABLE = 60
DEADLINE_S = 120


def _request(path: str, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
            .encode() + raw)


async def _one(conn: trio.SocketStream, i: int, stream: bool) -> None:
    """Send one request on keep-alive ``conn`` and read its whole answer."""
    body = {"model": MODEL, "prompt": f"p{i % 20}", "max_tokens": 3, "stream": stream}
    await conn.send_all(_request("/v1/completions", body))
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        buffer += await conn.receive_some(65536)
    head, _, buffer = buffer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    if stream:  # chunked: up to the last chunk
        while not buffer.endswith(b"0\r\n\r\n"):
            buffer += await conn.receive_some(65536)
        assert b"[DONE]" in buffer
        return
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(buffer) < length:
        buffer += await conn.receive_some(65536)


async def test_requests_and_streams_leave_no_reference_cycles() -> None:
    sim = await trio.to_thread.run_sync(lambda: start_sim(["--model", MODEL, "--port", "0"]))
    table = ReplicaTable()
    table.set_model_replicas(MODEL, [Replica("s0", MODEL, sim.url, "node-1")])
    try:
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve_gateway, create_app(table), "127.0.0.1", 0)
                async with await trio.open_tcp_stream("127.0.0.1", port) as conn:
                    for i in range(WARMUP):
                        await _one(conn, i, stream=i % 2 == 0)
                    gc.collect()
                    gc.disable()
                    try:
                        for i in range(REQUESTS + STREAMS):
                            await _one(conn, i, stream=i < STREAMS)
                        unreachable = gc.collect()
                    finally:
                        gc.enable()
                nursery.cancel_scope.cancel()
    finally:
        await trio.to_thread.run_sync(sim.stop)
    assert unreachable <= MAX_UNREACHABLE, (
        f"{unreachable} objects in reference cycles after {REQUESTS + STREAMS} requests")
