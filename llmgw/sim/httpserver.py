"""A lean HTTP/1.1 server on trio + h11: keep-alive, whole-body requests, plain or chunked responses.

One task per connection reads a request (headers and body, bounded), calls the
handler with a :class:`Request` and a :class:`Responder`, and loops while the
connection stays reusable. No pipelining: the next request is read only after the
response has been sent. trio's ``SocketStream`` sets TCP_NODELAY, so each chunk
of a streamed response leaves as soon as it is sent.

Protocol errors get a 400 (or 413 for an oversized body) and the connection is
closed; a client that goes away mid-response ends only its own connection task.
"""

from __future__ import annotations

import json
import sys
from typing import Awaitable, Callable

import attrs
import h11
import trio

#: Largest request body accepted (token-id prompts of a long context fit easily).
MAX_BODY_BYTES = 32 * 1024 * 1024
#: Largest request head; h11's default.
MAX_HEAD_BYTES = 64 * 1024
#: Idle keep-alive connections are closed after this many seconds (clients reconnect).
KEEPALIVE_TIMEOUT_S = 120.0
#: A request whose head and body take longer than this to arrive is dropped.
REQUEST_READ_TIMEOUT_S = 60.0
#: Bytes read per receive call.
RECV_BYTES = 65_536

SERVER_HEADER = (b"server", b"llmgw-sim")


@attrs.define
class Request:
    """One HTTP request with its whole body."""

    method: str
    path: str
    query: str
    headers: list[tuple[bytes, bytes]]
    body: bytes


class ClientGone(Exception):
    """The client closed the connection while a response was being sent."""


class Responder:
    """Sends exactly one response on a connection: :meth:`send`, or :meth:`start` + :meth:`chunk`s + :meth:`end`.

    Every method raises :class:`ClientGone` if the peer has gone away.
    """

    def __init__(self, conn: h11.Connection, stream: trio.abc.Stream) -> None:
        self._conn = conn
        self._stream = stream
        self.started = False
        self.status = 0

    async def _write(self, event: h11.Event) -> None:
        data = self._conn.send(event)
        if data:
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ClientGone() from exc

    async def send(self, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
        """Send a complete response with a Content-Length."""
        self.started = True
        self.status = status
        headers = [
            SERVER_HEADER,
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
        ]
        data = self._conn.send(h11.Response(status_code=status, headers=headers))
        data += self._conn.send(h11.Data(data=body)) if body else b""
        data += self._conn.send(h11.EndOfMessage())
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ClientGone() from exc

    async def send_json(self, status: int, obj: object) -> None:
        """Send ``obj`` as a JSON response."""
        await self.send(status, json.dumps(obj, separators=(",", ":")).encode())

    async def start(self, status: int, content_type: bytes) -> None:
        """Send the head of a streamed (chunked) response."""
        self.started = True
        self.status = status
        headers = [SERVER_HEADER, (b"content-type", content_type), (b"cache-control", b"no-cache")]
        await self._write(h11.Response(status_code=status, headers=headers))

    async def chunk(self, data: bytes) -> None:
        """Send one chunk of a streamed response."""
        if data:
            await self._write(h11.Data(data=data))

    async def end(self) -> None:
        """Finish a streamed response."""
        await self._write(h11.EndOfMessage())


Handler = Callable[[Request, Responder], Awaitable[None]]


async def _next_event(conn: h11.Connection, stream: trio.abc.Stream) -> h11.Event:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        try:
            data = await stream.receive_some(RECV_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        conn.receive_data(data)


async def _read_request(conn: h11.Connection, stream: trio.abc.Stream) -> Request | None:
    """Return the next request, or None when the client closed cleanly. Raises h11 errors."""
    event = await _next_event(conn, stream)
    if isinstance(event, h11.ConnectionClosed):
        return None
    if not isinstance(event, h11.Request):
        raise h11.RemoteProtocolError("expected a request", error_status_hint=400)
    target = event.target.decode("latin-1")
    path, _, query = target.partition("?")
    body = bytearray()
    with trio.fail_after(REQUEST_READ_TIMEOUT_S):
        while True:
            ev = await _next_event(conn, stream)
            if isinstance(ev, h11.Data):
                body += ev.data
                if len(body) > MAX_BODY_BYTES:
                    raise h11.RemoteProtocolError("request body too large", error_status_hint=413)
            elif isinstance(ev, h11.EndOfMessage):
                break
            elif isinstance(ev, h11.ConnectionClosed):
                return None
    return Request(event.method.decode("ascii"), path, query, list(event.headers), bytes(body))


async def serve_connection(stream: trio.SocketStream, handler: Handler) -> None:
    """Serve requests on one connection until it closes; closes ``stream`` on return."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    async with stream:
        while True:
            try:
                with trio.move_on_after(KEEPALIVE_TIMEOUT_S) as idle:
                    first = await _next_event_peek(conn, stream)
                if idle.cancelled_caught or first is None:
                    return
                request = await _read_request(conn, stream)
            except h11.RemoteProtocolError as exc:
                await _send_protocol_error(conn, stream, exc)
                return
            except trio.TooSlowError:
                return
            if request is None:
                return
            responder = Responder(conn, stream)
            try:
                await handler(request, responder)
                if not responder.started:
                    await responder.send(500, b'{"error":{"message":"no response","type":"InternalServerError","code":500}}')
            except ClientGone:
                return
            except Exception as exc:  # a handler bug must cost one request, not the server
                print(f"llmgw-sim: internal error on {request.method} {request.path}: {exc!r}", file=sys.stderr)
                if responder.started:
                    return
                try:
                    await responder.send_json(500, {"error": {"message": f"internal error: {exc}", "type": "InternalServerError", "param": None, "code": 500}})
                except ClientGone:
                    return
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is not h11.DONE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return


async def _next_event_peek(conn: h11.Connection, stream: trio.abc.Stream) -> bool | None:
    """Wait until request bytes are buffered: return True, or None if the peer closed. Consumes no event."""
    if conn.trailing_data[0]:
        return True
    try:
        data = await stream.receive_some(RECV_BYTES)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return None
    if not data:
        return None
    conn.receive_data(data)
    return True


async def _send_protocol_error(conn: h11.Connection, stream: trio.abc.Stream, exc: h11.RemoteProtocolError) -> None:
    status = exc.error_status_hint or 400
    body = json.dumps({"error": {"message": f"bad HTTP request: {exc}", "type": "BadRequestError", "param": None, "code": status}}).encode()
    try:
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            data = conn.send(h11.Response(status_code=status, headers=[SERVER_HEADER, (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]))
            data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
            await stream.send_all(data)
    except (h11.LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def serve(handler: Handler, listeners: list[trio.SocketListener]) -> None:
    """Serve connections on ``listeners`` (from ``trio.open_tcp_listeners``) until cancelled; closes them."""
    await trio.serve_listeners(lambda s: serve_connection(s, handler), listeners)
