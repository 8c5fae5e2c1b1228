"""The gateway's lean HTTP/1.1 client (llmgw.router.http.upstream_pool) against raw servers on real sockets."""

from __future__ import annotations

from functools import partial
from typing import Awaitable, Callable

import httpx
import pytest
import trio
import trio.testing

from llmgw.router.http.upstream_pool import H1Pool, HeadWait

DEADLINE_S = 10


def _pool() -> H1Pool:
    return H1Pool(connect_timeout=5, write_timeout=5, keepalive_expiry=60, max_idle_per_replica=8)


async def _serve(nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]) -> str:
    """Serve ``handler`` per connection on a free port; return the base URL."""
    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def _read_request(stream: trio.SocketStream) -> bytes:
    """Return one request (head and content-length body) read from ``stream``, or b"" at EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = await stream.receive_some(65536)
        if not more:
            return b""
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += await stream.receive_some(65536)
    return data


async def test_chunked_body_split_at_every_byte_is_decoded_and_the_connection_reused() -> None:
    payload = [b"data: one\n\n", b"data: two\n\n", b"x" * 300]
    wire = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in payload) + b"0\r\n\r\n"
    connections = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        while await _read_request(stream):
            await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n")
            for i in range(len(wire)):  # one byte per segment: every split point
                await stream.send_all(wire[i:i + 1])
                await trio.sleep(0)

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, handler)
            pool = _pool()
            for _ in range(2):
                response = await pool.request(url, "POST", "/v1/x", [("content-type", "application/json")], b"{}")
                assert response.status_code == 200
                assert response.headers["content-type"] == "text/event-stream"
                assert await response.aread() == b"".join(payload)
                await response.aclose()
            assert connections == 1
            await pool.aclose()
            nursery.cancel_scope.cancel()


async def test_a_whole_chunked_stream_in_one_write_is_decoded_with_extensions_and_trailers() -> None:
    # An engine faster than the gateway: 64 events, a chunk extension and a trailer, one segment.
    payload = [b"data: %d\n\n" % i for i in range(64)]
    wire = (b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in payload)
            + b"0\r\nx-trailer: yes\r\n\r\n")

    async def handler(stream: trio.SocketStream) -> None:
        while await _read_request(stream):
            await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + wire)

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, handler)
            pool = _pool()
            for _ in range(2):  # the connection is reused: nothing of the first body is left over
                response = await pool.request(url, "POST", "/v1/x", [], b"{}")
                assert [piece async for piece in response.aiter_raw()] == [b"".join(payload)]
                assert response.release_if_reusable()
            await pool.aclose()
            nursery.cancel_scope.cancel()


async def test_request_is_one_write_and_content_length_body_comes_back_whole() -> None:
    seen: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        request = await _read_request(stream)
        seen.append(request)
        await stream.send_all(b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\nX-Thing: a\r\n\r\nhello")

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, handler)
            pool = _pool()
            response = await pool.request(url + "/prefix", "POST", "/v1/y?a=1", [("x-request-id", "r1")], b"body!")
            assert (response.status_code, response.headers["x-thing"]) == (201, "a")
            assert response.take_complete() == b"hello"
            await response.aclose()
            head, _, body = seen[0].partition(b"\r\n\r\n")
            assert head.startswith(b"POST /prefix/v1/y?a=1 HTTP/1.1\r\n")
            assert b"x-request-id: r1" in head and body == b"body!"
            await pool.aclose()
            nursery.cancel_scope.cancel()


async def test_a_pooled_connection_closed_by_the_engine_is_replaced_transparently() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await _read_request(stream)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await stream.aclose()  # keep-alive advertised, but closed: the next reuse finds EOF

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, handler)
            pool = _pool()
            for _ in range(3):
                response = await pool.request(url, "POST", "/", [], b"")
                assert await response.aread() == b"ok"
                await response.aclose()
            await pool.aclose()
            nursery.cancel_scope.cancel()


async def test_connections_over_the_idle_limit_or_past_their_expiry_are_closed() -> None:
    ended_send, ended = trio.open_memory_channel[int](10)
    numbers = iter(range(1, 100))

    async def handler(stream: trio.SocketStream) -> None:
        number = next(numbers)
        while await _read_request(stream):
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await ended_send.send(number)  # the pool closed this connection

    async def exchange(pool: H1Pool, url: str) -> None:
        response = await pool.request(url, "POST", "/", [], b"")
        assert await response.aread() == b"ok"
        await response.aclose()

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, handler)
            # One idle connection at most: of two answered at once, the second returned is closed.
            pool = H1Pool(connect_timeout=5, write_timeout=5, keepalive_expiry=60, max_idle_per_replica=1)
            first = await pool.request(url, "POST", "/", [], b"")
            second = await pool.request(url, "POST", "/", [], b"")
            for response in (first, second):
                assert await response.aread() == b"ok"
                await response.aclose()
            assert await ended.receive() == 2
            await exchange(pool, url)  # the first connection, kept, serves again
            await pool.aclose()
            assert await ended.receive() == 1
            # No keep-alive time at all: an idle connection is closed when next looked at.
            pool = H1Pool(connect_timeout=5, write_timeout=5, keepalive_expiry=0, max_idle_per_replica=8)
            await exchange(pool, url)
            await exchange(pool, url)
            assert await ended.receive() == 3
            await pool.aclose()
            assert await ended.receive() == 4
            nursery.cancel_scope.cancel()


async def test_errors_are_httpx_types() -> None:
    async def truncated(stream: trio.SocketStream) -> None:
        await _read_request(stream)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await stream.aclose()

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, truncated)
            pool = _pool()
            response = await pool.request(url, "POST", "/", [], b"")
            with pytest.raises(httpx.RemoteProtocolError):
                await response.aread()
            await response.aclose()
            free = trio.socket.socket()
            await free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
            free.close()
            with pytest.raises(httpx.ConnectError):
                await pool.request(f"http://127.0.0.1:{port}", "POST", "/", [], b"")
            await pool.aclose()
            nursery.cancel_scope.cancel()


async def test_an_aborted_wait_for_the_head_fails_at_once_and_is_not_sent_again() -> None:
    requests: list[bytes] = []
    never = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        while request := await _read_request(stream):
            requests.append(request.rpartition(b"\r\n\r\n")[2])
            if request.endswith(b"answer"):
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            else:
                await never.wait()  # silent: the gateway's deadline watch ends the wait

    async def aborted_request(pool: H1Pool, url: str, nursery: trio.Nursery) -> None:
        head = HeadWait()

        async def abort_when_waiting() -> None:
            await trio.testing.wait_all_tasks_blocked()
            head.abort()

        nursery.start_soon(abort_when_waiting)
        with pytest.raises(httpx.ReadError, match="was ended"):
            await pool.request(url, "POST", "/v1/x", [], b"silence", head)

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, handler)
            pool = _pool()
            await aborted_request(pool, url, nursery)  # on a fresh connection
            response = await pool.request(url, "POST", "/v1/x", [], b"answer")
            assert await response.aread() == b"ok"
            await response.aclose()  # back to the pool
            # On the pooled connection: a stale pooled connection is retried on a new one,
            # an aborted wait must not be.
            await aborted_request(pool, url, nursery)
            ended = HeadWait()
            ended.abort()  # ended before the request goes out: nothing is sent
            with pytest.raises(httpx.ReadError, match="was ended"):
                await pool.request(url, "POST", "/v1/x", [], b"late", ended)
            await trio.testing.wait_all_tasks_blocked()
            assert requests == [b"silence", b"answer", b"silence"]
            await pool.aclose()
            nursery.cancel_scope.cancel()
