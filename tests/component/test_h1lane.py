"""The fast lane (llmgw.router.http.h1lane) on real sockets under serve_gateway.

Each test counts the requests the lane served, so a lane that silently stopped taking
requests fails here, and checks the bytes on the wire: the framing h11 would have
chosen, requests the lane leaves to h11 on the same connection, pipelining, an app
that fails before or during its response, a client that leaves, and the keep-alive
limit.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from functools import partial
from typing import Any, AsyncIterator

import pytest
import trio
import trio.testing
from hypercorn.config import Config

from llmgw.router.http import eagerio
from llmgw.router.http.extensions import BODY_SINK_KEY, FAST_LANE_KEY, ON_CLOSE_KEY
from llmgw.router.http.h1lane import FastLaneProtocol
from llmgw.router.http.serve import serve_gateway
from tests.component.test_hypercorn_patch import expect_eof, read_response, serve_lifespan

DEADLINE_S = 20

# A body far larger than a loopback socket's buffers take in one write, so that writing it
# must wait (and a cancellation then cuts it short).
CUT_BODY_BYTES = 64 * 1024 * 1024


class App:
    """ASGI app. Paths: ``/echo`` (the body back, with content-length, plus what the scope
    said), ``/stream`` (two chunks, no content-length), ``/empty`` (204), ``/fail`` (raises
    before responding), ``/short`` (declares 10 bytes, sends 2), ``/wait`` (waits for
    ``http.disconnect`` and records it), ``/cut`` (cancelled during its last send),
    ``/hang`` (waits forever, records its cancellation), ``/respond`` (the body back as one
whole response through the lane's sink; ``/respond-204`` a 204 that way, ``/respond-bad`` a
header value HTTP does not allow), ``/sink-stream`` (a stream started through the sink:
two pieces, then the last with the end), ``/sink-flush`` (a stream started through the sink,
its head flushed, then one piece once ``piece_release`` is set), ``/sink-fail`` (starts a
stream through the sink, then raises), ``/tail`` (responds, then waits
    for ``tail_release`` before it returns, or records its cancellation; ``tail_done`` then)."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []
        self.disconnected = trio.Event()
        self.closed_hook_called = False
        self.waiting = trio.Event()
        self.cancelled = trio.Event()
        self.tail_release = trio.Event()
        self.tail_done = trio.Event()
        self.piece_release = trio.Event()
        self.log: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        self.scopes.append(scope)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        self.log.append(path)
        if path == "/hang":
            self.waiting.set()
            try:
                await trio.sleep_forever()
            finally:
                self.cancelled.set()
        if path == "/tail":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            try:
                await self.tail_release.wait()
            except trio.Cancelled:
                self.log.append("/tail cancelled")
                raise
            finally:
                self.tail_done.set()
            self.log.append("/tail returned")
            return
        if path == "/fail":
            raise RuntimeError("the app failed (expected by the test)")
        if path == "/wait":
            scope["extensions"][ON_CLOSE_KEY] = self._hook
            self.waiting.set()
            assert (await receive())["type"] == "http.disconnect"
            self.disconnected.set()
            return
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for part in (b"one", b"two"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == "/cut":  # cancelled during its last send, which cannot go out in one write
            big = b"x" * CUT_BODY_BYTES
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"%d" % len(big))]})
            with trio.CancelScope() as cut:
                cut.cancel()
                await send({"type": "http.response.body", "body": big})
            return
        if path.startswith("/respond"):  # a whole response through the lane's sink
            sink = scope["extensions"][BODY_SINK_KEY]
            status = 204 if path == "/respond-204" else 200
            value = "bad\nvalue" if path == "/respond-bad" else path
            await sink.respond(status, {"content-type": "text/plain", "x-path": value}, body if status == 200 else b"")
            return
        if path.startswith("/sink-"):  # a stream started through the lane's sink
            sink = scope["extensions"][BODY_SINK_KEY]
            await sink.start(200, {"content-type": "text/event-stream"})
            if path == "/sink-fail":
                raise RuntimeError("the app failed after starting its stream (expected by the test)")
            if path == "/sink-flush":
                pending = sink.flush()
                assert pending is not None  # the head was held
                await pending
                await self.piece_release.wait()
                await send({"type": "http.response.body", "body": b"late"})
                return
            for piece in (b"one", b"two"):
                assert sink.send_piece(piece) is None  # the kernel takes a few bytes at once
            await send({"type": "http.response.body", "body": b"three"})
            return
        if path == "/empty":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        length = 10 if path == "/short" else len(body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % length), (b"x-path", scope["raw_path"])]})
        await send({"type": "http.response.body", "body": body[:2] if path == "/short" else body})

    def _hook(self) -> None:
        self.closed_hook_called = True


@asynccontextmanager
async def served(app: App) -> AsyncIterator[trio.SocketStream]:
    """Serve ``app``; yield a client connection to it."""
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_gateway, app, "127.0.0.1", 0))
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            try:
                yield stream
            finally:
                await stream.aclose()
                nursery.cancel_scope.cancel()


def _post(path: str, body: bytes = b"{}", extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n%s" % (path.encode(), len(body), extra, body)


async def _read_to_eof(stream: trio.SocketStream) -> bytes:
    """Return everything ``stream`` receives until the server closes it."""
    received = bytearray()
    while data := await stream.receive_some(1 << 20):
        received += data
    return bytes(received)


async def _read_until(stream: trio.SocketStream, buffer: bytearray, end: bytes) -> bytes:
    while end not in buffer:
        data = await stream.receive_some(65536)
        assert data, f"closed before {end!r}; got {bytes(buffer)!r}"
        buffer += data
    cut = buffer.index(end) + len(end)
    out = bytes(buffer[:cut])
    del buffer[:cut]
    return out


async def test_pipelined_requests_are_answered_in_order_by_the_lane() -> None:
    app = App()
    before = FastLaneProtocol.served
    async with served(app) as stream:
        await stream.send_all(_post("/echo", b"first") + _post("/echo%20two", b"second") + _post("/echo", b"3"))
        buffer = bytearray()
        bodies = []
        for _ in range(3):
            head, body = await read_response(stream, buffer)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            bodies.append(body)
        assert bodies == [b"first", b"second", b"3"]
    assert FastLaneProtocol.served - before == 3
    assert app.scopes[1]["path"] == "/echo two" and app.scopes[1]["raw_path"] == b"/echo%20two"
    assert app.scopes[0]["headers"] == [(b"host", b"x"), (b"content-length", b"5")]
    assert app.scopes[0]["http_version"] == "1.1" and app.scopes[0]["scheme"] == "http"


async def test_requests_left_to_h11_and_lane_requests_share_a_connection() -> None:
    app = App()
    before = FastLaneProtocol.served
    async with served(app) as stream:
        buffer = bytearray()
        chunked = (b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                   b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        # The lane first: h11 then takes the chunked body and the HEAD on the same
        # connection. A request arriving while h11 still finishes its exchange is h11's
        # too, so the last one may go either way; it must be answered all the same.
        for request, expected in ((_post("/echo", b"lane"), b"lane"), (chunked, b"abcde"),
                                  (b"HEAD /echo HTTP/1.1\r\nhost: x\r\n\r\n", None), (_post("/echo", b"again"), b"again")):
            await stream.send_all(request)
            if expected is None:
                head = await _read_until(stream, buffer, b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 ")  # h11 answers HEAD without a body
                assert FastLaneProtocol.served - before == 1
                continue
            head, body = await read_response(stream, buffer)
            assert body == expected


async def test_a_stream_is_chunked_and_204_has_no_body() -> None:
    app = App()
    async with served(app) as stream:
        buffer = bytearray()
        await stream.send_all(_post("/stream"))
        head = await _read_until(stream, buffer, b"\r\n\r\n")
        assert b"\r\ntransfer-encoding: chunked\r\n" in head and b"content-length" not in head
        assert await _read_until(stream, buffer, b"0\r\n\r\n") == b"3\r\none\r\n3\r\ntwo\r\n0\r\n\r\n"
        await stream.send_all(_post("/empty"))
        head = await _read_until(stream, buffer, b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 204 No Content\r\n") and b"transfer-encoding" not in head
        await stream.send_all(_post("/echo", b"after"))  # the connection is still in step
        assert (await read_response(stream, buffer))[1] == b"after"


def _all_on_the_lane(app: App, count: int) -> bool:
    """Return whether the app saw ``count`` requests, all served by the lane (not h11)."""
    return len(app.scopes) == count and all(FAST_LANE_KEY in scope["extensions"] for scope in app.scopes)


async def test_an_app_failing_before_its_response_gets_500_and_the_connection_closes() -> None:
    app = App()
    async with served(app) as stream:
        await stream.send_all(_post("/fail"))
        buffer = bytearray()
        head, body = await read_response(stream, buffer)
        assert head.startswith(b"HTTP/1.1 500 ") and b"\r\nconnection: close" in head and body == b""
        await expect_eof(stream)
    assert _all_on_the_lane(app, 1)


async def test_a_body_short_of_its_content_length_closes_the_connection() -> None:
    app = App()
    async with served(app) as stream:
        await stream.send_all(_post("/short"))
        received = await _read_to_eof(stream)  # the connection closes: no whole response
        head, _, body = received.partition(b"\r\n\r\n")
        assert len(body) < 10
    assert _all_on_the_lane(app, 1)


async def test_a_client_leaving_gets_the_app_a_disconnect_and_the_close_hook() -> None:
    app = App()
    before = FastLaneProtocol.served
    async with served(app) as stream:
        await stream.send_all(_post("/wait"))
        await app.waiting.wait()
        await stream.aclose()
        await app.disconnected.wait()
    assert app.closed_hook_called
    assert FastLaneProtocol.served - before == 1


async def test_a_client_leaving_cancels_the_app_on_the_lane() -> None:
    app = App()
    async with served(app) as stream:
        await stream.send_all(_post("/hang"))
        await app.waiting.wait()
        await stream.aclose()
        await app.cancelled.wait()
    assert _all_on_the_lane(app, 1)


async def test_the_next_request_on_a_connection_runs_once_the_app_before_it_returned() -> None:
    """A connection's lane exchanges run one after another: an app that goes on after its
    response (here until the test lets it) holds the next request until it returns."""
    app = App()
    async with served(app) as stream:
        buffer = bytearray()
        await stream.send_all(_post("/tail"))
        await read_response(stream, buffer)
        await stream.send_all(_post("/echo", b"next"))
        await trio.testing.wait_all_tasks_blocked()
        assert app.log == ["/tail"]
        app.tail_release.set()
        _, body = await read_response(stream, buffer)
        assert body == b"next"
    assert app.log == ["/tail", "/tail returned", "/echo"]
    assert _all_on_the_lane(app, 2)


async def test_an_app_goes_on_after_a_response_that_closed_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing the connection after a response (here at the keep-alive limit) ends the
    connection's read loop; the app's work after its response is not cancelled with it."""
    monkeypatch.setattr(Config, "keep_alive_max_requests", 1)
    app = App()
    async with served(app) as stream:
        await stream.send_all(_post("/tail"))
        received = await _read_to_eof(stream)
        assert received.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nconnection: close" in received
        app.tail_release.set()
        await app.tail_done.wait()
    assert app.log == ["/tail", "/tail returned"]
    assert _all_on_the_lane(app, 1)


async def test_the_keep_alive_limit_closes_after_the_last_allowed_response(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Config, "keep_alive_max_requests", 2)
    app = App()
    async with served(app) as stream:
        buffer = bytearray()
        await stream.send_all(_post("/echo", b"1"))
        head, _ = await read_response(stream, buffer)
        assert b"connection: close" not in head
        await stream.send_all(_post("/echo", b"2"))
        head, body = await read_response(stream, buffer)
        assert b"\r\nconnection: close" in head and body == b"2"
        await expect_eof(stream)
    assert _all_on_the_lane(app, 2)


async def test_an_app_cancelled_during_its_last_send_closes_the_connection() -> None:
    """The response was cut short: the client must see the connection close, not wait forever."""
    app = App()
    async with served(app) as stream:
        await stream.send_all(_post("/cut"))
        received = len(await _read_to_eof(stream))
        assert 0 < received < CUT_BODY_BYTES
    assert _all_on_the_lane(app, 1)


async def test_a_whole_response_through_the_sink_is_framed_and_kept_alive_to_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Config, "keep_alive_max_requests", 3)
    app = App()
    async with served(app) as stream:
        buffer = bytearray()
        await stream.send_all(_post("/respond", b"whole"))
        head, body = await read_response(stream, buffer)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and body == b"whole"
        for line in (b"content-type: text/plain", b"x-path: /respond", b"content-length: 5", b"date: "):
            assert b"\r\n" + line in head
        assert b"connection: close" not in head and b"transfer-encoding" not in head
        await stream.send_all(_post("/respond-204"))
        head = await _read_until(stream, buffer, b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 204 No Content\r\n") and b"content-length" not in head
        await stream.send_all(_post("/respond", b"last"))
        head, body = await read_response(stream, buffer)
        assert b"\r\nconnection: close" in head and body == b"last"
        await expect_eof(stream)
    assert _all_on_the_lane(app, 3)


@pytest.mark.parametrize("path, unsent", [
    ("/respond-bad", b"bad"),  # a whole response with a header HTTP does not allow
    ("/sink-fail", b"text/event-stream"),  # an app failing with its stream's head still held
])
async def test_a_response_that_never_went_out_is_a_500(path: str, unsent: bytes) -> None:
    app = App()
    async with served(app) as stream:
        await stream.send_all(_post(path))
        received = await _read_to_eof(stream)
        assert received.startswith(b"HTTP/1.1 500 ") and unsent not in received
    assert _all_on_the_lane(app, 1)


async def test_the_reader_waits_for_the_next_request_instead_of_reading_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After the lane took a whole request, the client sends nothing until its answer: the
    connection's reader waits for the socket rather than making a read that finds nothing."""
    empty_reads = 0
    real_try_receive = eagerio.try_receive

    def counting_try_receive(stream: trio.SocketStream, max_bytes: int) -> bytes | None:
        nonlocal empty_reads
        data = real_try_receive(stream, max_bytes)
        empty_reads += data is None
        return data

    app = App()
    async with served(app) as stream:
        buffer = bytearray()
        await stream.send_all(_post("/echo", b"first"))  # a new connection's first read may find nothing yet
        await read_response(stream, buffer)
        monkeypatch.setattr(eagerio, "try_receive", counting_try_receive)
        for body in (b"2", b"3", b"4", b"5"):
            await stream.send_all(_post("/echo", body))
            assert (await read_response(stream, buffer))[1] == body
    assert empty_reads == 0
    assert _all_on_the_lane(app, 5)


def _count_writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Return the list every write the server makes from now on is appended to."""
    writes: list[bytes] = []
    real_try_send = eagerio.try_send

    def recording_try_send(stream: trio.abc.SendStream, data: bytes) -> int:
        writes.append(bytes(data))
        return real_try_send(stream, data)

    monkeypatch.setattr(eagerio, "try_send", recording_try_send)
    return writes


async def test_a_stream_started_through_the_sink_sends_its_head_with_the_first_piece(
        monkeypatch: pytest.MonkeyPatch) -> None:
    app = App()
    async with served(app) as stream:
        writes = _count_writes(monkeypatch)
        await stream.send_all(_post("/sink-stream"))
        buffer = bytearray()
        head = await _read_until(stream, buffer, b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        for line in (b"content-type: text/event-stream", b"transfer-encoding: chunked", b"date: "):
            assert b"\r\n" + line in head
        body = await _read_until(stream, buffer, b"0\r\n\r\n")
        assert body == b"3\r\none\r\n3\r\ntwo\r\n5\r\nthree\r\n0\r\n\r\n"
        # Three writes: the head with the first piece, the second, the last with the end.
        assert len(writes) == 3 and writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert writes[0].endswith(b"3\r\none\r\n") and writes[2] == b"5\r\nthree\r\n0\r\n\r\n"
        await stream.send_all(_post("/echo", b"next"))  # the connection is kept alive
        assert (await read_response(stream, buffer))[1] == b"next"
    assert _all_on_the_lane(app, 2)


async def test_a_stream_head_flushed_through_the_sink_goes_before_its_first_piece() -> None:
    app = App()
    async with served(app) as stream:
        await stream.send_all(_post("/sink-flush"))
        buffer = bytearray()
        head = await _read_until(stream, buffer, b"\r\n\r\n")  # while the app waits for its piece
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\ntransfer-encoding: chunked" in head
        assert not buffer
        app.piece_release.set()
        assert await _read_until(stream, buffer, b"0\r\n\r\n") == b"4\r\nlate\r\n0\r\n\r\n"
    assert _all_on_the_lane(app, 1)
