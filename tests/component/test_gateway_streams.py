"""Streams through the gateway under stress: many at once, a slow reader, an engine killed mid-stream.

Real simulated engines (in-process ``llmgw.sim`` on 127.0.0.1, or a ``python -m llmgw.sim``
subprocess where it must be killed), the gateway on Hypercorn, and raw trio sockets as
clients (so a thousand of them are cheap and a client can stop reading on purpose).
"""

from __future__ import annotations

import json
import resource
import socket
from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest
import trio

from llmgw.router import LoadTracker, Replica, ReplicaTable, create_app, serve_gateway
from llmgw.router.app import gateway_of
from llmgw.router.http.relayhub import RelayHub
from llmgw.sim import SimConfig, serve
from llmgw.sim.launch import start_sim

MODEL = "stream-model"
DEADLINE_S = 120  # whole-test bound: a lost stream or a hang fails instead of sticking
STREAMS = 1000
WANTED_FDS = 8192  # 1,000 streams hold ~3 sockets each in this one process


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = WANTED_FDS if hard == resource.RLIM_INFINITY else min(WANTED_FDS, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


@asynccontextmanager
async def gateway_over(endpoints: list[str]) -> AsyncIterator[tuple[int, LoadTracker, RelayHub]]:
    """Run the gateway over ``endpoints`` (replicas of MODEL); yield (port, load, its relay hub); stop it."""
    table = ReplicaTable()
    table.set_model_replicas(MODEL, [Replica(f"s{i}", MODEL, url, "node-1") for i, url in enumerate(endpoints)])
    load = LoadTracker()
    async with trio.open_nursery() as nursery:
        app = create_app(table, load=load)
        port = await nursery.start(serve_gateway, app, "127.0.0.1", 0)
        yield port, load, gateway_of(app).relay_hub
        nursery.cancel_scope.cancel()


def request_bytes(path: str, body: dict, *, close: bool = True) -> bytes:
    """Return the request; ``close=False``: a keep-alive request (served by the gateway's fast
    lane, where ``Connection: close`` sends it to h11)."""
    raw = json.dumps(body).encode()
    connection = "connection: close\r\n" if close else ""
    head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"{connection}content-length: {len(raw)}\r\n\r\n")
    return head.encode() + raw


def sse_events(response: bytes) -> tuple[int, list[str]]:
    """Return (status, SSE data payloads) of a whole chunked HTTP response."""
    head, _, rest = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2:]
    events = [e[len("data: "):] for e in body.decode().split("\n\n") if e.startswith("data: ")]
    return status, events


async def read_all(stream: trio.SocketStream) -> bytes:
    parts = []
    while chunk := await stream.receive_some(65536):
        parts.append(chunk)
    return b"".join(parts)


async def read_chunked(stream: trio.SocketStream, data: bytes = b"") -> bytes:
    """Return one chunked response on a keep-alive connection (``data``: what was read of it
    already), read up to its last chunk."""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        chunk = await stream.receive_some(65536)
        assert chunk, "the gateway closed a keep-alive connection mid-response"
        data += chunk
    return data


def text_of(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]" and json.loads(e)["choices"])


async def test_a_thousand_concurrent_streams_all_complete() -> None:
    raise_fd_limit()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as sims:
            endpoints = []
            for _ in range(2):
                _, port = await sims.start(serve, SimConfig(model=MODEL, port=0, max_num_seqs=512))
                endpoints.append(f"http://127.0.0.1:{port}")
            async with gateway_over(endpoints) as (port, load, hub):
                prompts = [f"stream number {i}" for i in range(STREAMS)]
                # The engine is deterministic: each prompt's text, asked for directly once.
                expected: dict[int, str] = {}
                results: dict[int, tuple[int, list[str]]] = {}
                started = trio.Event()
                connected = 0

                async def one(i: int, *, stream: bool) -> None:
                    nonlocal connected
                    body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 4, "stream": stream}
                    conn = await trio.open_tcp_stream("127.0.0.1", port)
                    async with conn:
                        connected += 1
                        if connected == STREAMS:
                            started.set()
                        if stream:
                            await started.wait()  # all connected first, then all send at once
                        # Half through the fast lane (keep-alive), half through h11 (closing).
                        lane = stream and i % 2 == 0
                        await conn.send_all(request_bytes("/v1/completions", body, close=not lane))
                        response = await (read_chunked(conn) if lane else read_all(conn))
                    if stream:
                        results[i] = sse_events(response)
                    else:
                        expected[i] = json.loads(response.partition(b"\r\n\r\n")[2])["choices"][0]["text"]

                async with trio.open_nursery() as clients:
                    for i in range(STREAMS):
                        clients.start_soon(lambda i=i: one(i, stream=True))
                assert len(results) == STREAMS
                assert hub.steps >= STREAMS // 2  # the lane's streams' later events went through the hub
                for i in range(0, STREAMS, 97):  # spot-check content against non-streamed answers
                    await one(i, stream=False)
                for i, (status, events) in results.items():
                    assert status == 200, (i, events[:2])
                    assert events[-1] == "[DONE]", (i, events[-3:])
                    assert not any('"error"' in e for e in events), (i, events)
                    assert len(events) >= 3, (i, events)  # at least two text chunks and [DONE]
                    if i in expected:
                        assert text_of(events) == expected[i]
                await load.wait_until(lambda tracker: tracker.total() == 0)
            sims.cancel_scope.cancel()


async def test_a_slow_reader_does_not_stall_other_streams() -> None:
    prompts = [f"long answer part {i}" for i in range(400)]  # ~30,000 chunks, several MB of SSE
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as sims:
            _, sim_port = await sims.start(serve, SimConfig(model=MODEL, port=0))
            async with gateway_over([f"http://127.0.0.1:{sim_port}"]) as (port, load, _):
                sock = trio.socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills fast
                await sock.connect(("127.0.0.1", port))
                slow = trio.SocketStream(sock)
                async with slow:
                    body = {"model": MODEL, "prompt": prompts, "max_tokens": 100, "stream": True}
                    await slow.send_all(request_bytes("/v1/completions", body))
                    first = await slow.receive_some(1024)
                    assert first.startswith(b"HTTP/1.1 200")
                    # The slow client now stops reading. Other streams must still complete.
                    others: list[tuple[int, list[str]]] = []

                    async def other(i: int) -> None:
                        async with await trio.open_tcp_stream("127.0.0.1", port) as conn:
                            await conn.send_all(request_bytes(
                                "/v1/completions", {"model": MODEL, "prompt": f"quick {i}", "max_tokens": 4, "stream": True}))
                            others.append(sse_events(await read_all(conn)))

                    async with trio.open_nursery() as nursery:
                        for i in range(20):
                            nursery.start_soon(other, i)
                    assert len(others) == 20
                    assert all(status == 200 and events[-1] == "[DONE]" for status, events in others)
                    # The slow stream is really held up by its reader (not buffered whole somewhere).
                    assert load.total() == 1
                    rest = first + await read_all(slow)
                status, events = sse_events(rest)
                assert status == 200 and events[-1] == "[DONE]"
                indexes = {json.loads(e)["choices"][0]["index"] for e in events[:-1] if json.loads(e)["choices"]}
                assert indexes == set(range(len(prompts)))
                await load.wait_until(lambda tracker: tracker.total() == 0)
            sims.cancel_scope.cancel()


@pytest.mark.parametrize("lane", [True, False], ids=["fast-lane-and-relay-hub", "h11"])
async def test_engine_killed_mid_stream_ends_the_stream_with_an_error_event(lane: bool) -> None:
    sim = await trio.to_thread.run_sync(
        lambda: start_sim(["--model", MODEL, "--port", "0", "--decode-us-per-token", "200000"]))
    try:
        with trio.fail_after(DEADLINE_S):
            async with gateway_over([sim.url]) as (port, load, hub):
                async with await trio.open_tcp_stream("127.0.0.1", port) as conn:
                    body = {"model": MODEL, "prompt": "a slow story", "max_tokens": 50, "stream": True}
                    await conn.send_all(request_bytes("/v1/completions", body, close=not lane))
                    received = b""
                    while b"data: " not in received:  # the stream is open and a chunk came through
                        chunk = await conn.receive_some(65536)
                        assert chunk, "the gateway closed before the first chunk"
                        received += chunk
                    assert load.total() == 1
                    sim.proc.kill()  # SIGKILL: no goodbye from the engine
                    # It must end, not hang.
                    received = await read_chunked(conn, received) if lane else received + await read_all(conn)
                status, events = sse_events(received)
                assert status == 200
                assert events and events[-1] != "[DONE]"
                error = json.loads(events[-1])["error"]
                assert error["code"] == "upstream_failed" and error["message"]
                assert (hub.steps > 0) == lane  # the lane's stream broke in the hub
                assert {"message", "type", "param", "code"} <= set(error)
                await load.wait_until(lambda tracker: tracker.total() == 0)
    finally:
        await trio.to_thread.run_sync(sim.stop)
