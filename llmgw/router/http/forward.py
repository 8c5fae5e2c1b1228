"""The gateway's hot path without Quart: forwarded POSTs handled as raw ASGI.

Quart's request machinery (request and app contexts, routing, the Response model, hooks)
costs about twice as much CPU per request as the whole rest of a proxied request (Hypercorn
plus the hop to the engine), and a gateway is all hot path. :class:`FastForward` sits
in front of the Quart app, inside the gateway's ASGI middlewares (metrics, the shield of
the last send), and handles ``POST`` on the forwarded paths itself; everything else (other
methods, other paths, ``/metrics``, ``/v1/models``) goes to Quart unchanged.

The request itself is handled by :meth:`llmgw.router.app.Gateway.forward` (auth,
admission, routing, retries, usage accounting, the error shapes), given the request as
a :class:`ForwardCall`. What this module adds is only what Quart would do around a
view: the request id (for every HTTP request, also those Quart serves), reading the body
under a size limit and a deadline, cancelling the request when the client disconnects,
and turning the result or a :class:`~llmgw.router.errors.GatewayError` into ASGI
messages.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable, Mapping, Protocol

import trio

from .. import errors
from ..admission import request_too_large
from ..errors import GatewayError
from .cleanup import Releases, shield_last_send
from .extensions import BODY_SINK_KEY, FAST_LANE_KEY, ON_CLOSE_KEY, REQUEST_ID_KEY, WHOLE_BODY_KEY
from .request_id import request_id_from

log = logging.getLogger(__name__)


class BodySink(Protocol):
    """Where a streamed body's pieces go once the response has started."""

    def send_piece(self, body: bytes) -> Awaitable[None] | None:
        """Send ``body`` (non-empty, not the last) as the response's next piece.

        Returns None when it went out at once, else an awaitable the caller must await
        before the next piece (the rest of it is waiting for room on the connection).
        Errors and cancellation are those of the ASGI ``send``.
        """

    def start(self, status: int, headers: Mapping[str, str]) -> Awaitable[None]:
        """Start a streamed (chunked) response: ``status`` and ``headers`` (lower-case names;
        no framing headers, as for :meth:`respond`). Only before anything else was sent.

        A sink may hold the head back to go out with the first piece (one write instead of
        two); :meth:`flush` sends a held head now. The body's last piece and its end go
        with the ASGI ``send``'s final ``http.response.body`` message, as ever.
        Errors and cancellation are those of :meth:`respond`.
        """

    def flush(self) -> Awaitable[None] | None:
        """Send a head :meth:`start` held back now (None: there is none, nothing to await;
        else an awaitable the caller must await). For a body whose first piece is not there
        yet. Errors and cancellation are those of the ASGI ``send``."""

    def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> Awaitable[None]:
        """Send a whole response instead of streaming one: ``status``, ``headers``
        (lower-case names; no ``content-length``, ``transfer-encoding`` or ``connection``:
        the sink frames the body) and ``body``. Only before anything else was sent.

        Errors and cancellation are those of the ASGI ``send`` (``ValueError`` for headers
        HTTP does not allow, ``RuntimeError`` for a response already started).
        """


class SinkWrapper:
    """A :class:`BodySink` that hands every call to the sink it wraps: a middleware's wrapper
    of the server's sink overrides only the calls it watches or changes (and keeps up with
    the protocol as it grows)."""

    __slots__ = ("_sink",)

    def __init__(self, sink: BodySink) -> None:
        self._sink = sink

    def send_piece(self, body: bytes) -> Awaitable[None] | None:
        return self._sink.send_piece(body)

    def start(self, status: int, headers: Mapping[str, str]) -> Awaitable[None]:
        return self._sink.start(status, headers)

    def flush(self) -> Awaitable[None] | None:
        return self._sink.flush()

    def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> Awaitable[None]:
        return self._sink.respond(status, headers, body)


class StreamedBody(Protocol):
    """A body relayed as it comes (an engine's event stream)."""

    async def pump(self, sink: BodySink) -> bytes:
        """Send the body's pieces to ``sink`` until it ends, all but the last; release what
        it holds (once); return the last piece (maybe b""), for the caller to send with the
        end of the response. Its head was started on ``sink`` (:meth:`BodySink.start`)."""

    async def aclose(self) -> None:
        """Release what the body holds if :meth:`pump` never ran (idempotent)."""


#: What :meth:`Gateway.forward` returns: status, response headers, and the body (whole, or
#: a :class:`StreamedBody` to relay as it comes, which the caller must close).
ForwardResult = tuple[int, dict[str, str], "bytes | StreamedBody"]


class _AsgiSink:
    """A :class:`BodySink` over the ASGI ``send`` (for servers that offer none of their own)."""

    __slots__ = ("_send",)

    def __init__(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        self._send = send

    def send_piece(self, body: bytes) -> Awaitable[None]:
        return self._send({"type": "http.response.body", "body": body, "more_body": True})

    def start(self, status: int, headers: Mapping[str, str]) -> Awaitable[None]:
        return self._send({"type": "http.response.start", "status": status, "headers": _encode(headers)})

    def flush(self) -> None:
        return None  # start() sent the head

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        framed = dict(headers)
        framed["content-length"] = str(len(body))
        await self._send({"type": "http.response.start", "status": status, "headers": _encode(framed)})
        await self._send({"type": "http.response.body", "body": body})


class ForwardCall:
    """One forwarded request as :meth:`Gateway.forward` sees it, independent of Quart.

    ``headers`` maps lower-case names to values (first value of a repeated header);
    ``max_bytes`` is the body limit (None: none);
    ``scope`` is the ASGI scope (labels and the trace live in its ``extensions``);
    ``releases`` what the request holds, released once its response is sent (or it failed).
    :meth:`read_body` returns the body.
    """

    __slots__ = ("path", "query", "headers", "request_id", "content_length", "max_bytes", "scope", "releases",
                 "_receive", "_body_timeout")

    def __init__(self, path: str, query: bytes, headers: Mapping[str, str], request_id: str,
                 content_length: int | None, max_bytes: int | None, scope: dict[str, Any],
                 receive: Callable[[], Awaitable[dict[str, Any]]], body_timeout: float) -> None:
        self.path = path
        self.query = query
        self.headers = headers
        self.request_id = request_id
        self.content_length = content_length
        self.max_bytes = max_bytes
        self.scope = scope
        self.releases = Releases()
        self._receive = receive
        self._body_timeout = body_timeout

    async def read_body(self) -> bytes:
        """Return the whole body (once).

        Raises a 413 GatewayError past :attr:`max_bytes`, a 408 when it did not arrive within
        the body timeout, and :class:`_ClientGone` when the client left before sending it all.
        """
        limit = self.max_bytes
        whole: bytes | None = self.scope["extensions"].get(WHOLE_BODY_KEY)
        if whole is not None:  # the fast lane read it all already: no receive, no timer
            if limit is not None and len(whole) > limit:
                raise request_too_large(limit)
            return whole
        parts: list[bytes] = []
        size = 0
        with trio.move_on_after(self._body_timeout) as timer:
            while True:
                message = await self._receive()
                if message["type"] == "http.disconnect":
                    raise _ClientGone()
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if limit is not None and size > limit:
                        raise request_too_large(limit)  # the same 413 as the Quart path
                    parts.append(chunk)
                if not message.get("more_body", False):
                    break
        if timer.cancelled_caught:
            raise errors.http_error(408, f"The request body did not arrive within {self._body_timeout:g}s.")
        return parts[0] if len(parts) == 1 else b"".join(parts)


class _ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class FastForward:
    """ASGI middleware serving ``POST`` on ``paths`` with ``forward``; the rest goes to ``inner``.

    ``forward`` is :meth:`llmgw.router.app.Gateway.forward`; ``config`` the Quart app's
    config, whose ``MAX_CONTENT_LENGTH`` is read per request as Quart reads it (it may be
    changed live). Every HTTP request gets its id here, once: a forwarded POST carries
    it in its :class:`ForwardCall`, any other request in ``scope["extensions"]`` under
    :data:`~llmgw.router.http.extensions.REQUEST_ID_KEY`, where the app's Quart hooks
    read it. Every request not on the fast lane has its last send shielded
    (:func:`~llmgw.router.http.cleanup.shield_last_send`), the forwarded ones and the rest.
    """

    def __init__(self, inner: Any, forward: Callable[[ForwardCall], Awaitable[ForwardResult]],
                 config: Mapping[str, Any], paths: tuple[str, ...], body_timeout: float) -> None:
        self._inner = inner
        self._forward = forward
        self._config = config
        self._paths = frozenset(paths)
        self._body_timeout = body_timeout

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._inner(scope, receive, send)
            return
        extensions = scope.setdefault("extensions", {})
        on_lane = FAST_LANE_KEY in extensions
        if not on_lane:  # the lane finishes its exchange by itself, cancelled or not (h1lane.py)
            send = shield_last_send(send)
        if scope["method"] != "POST" or scope["path"] not in self._paths:
            extensions[REQUEST_ID_KEY] = request_id_from(_header(scope, b"x-request-id"))
            await self._inner(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:  # names are lower-case in ASGI
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        try:
            content_length: int | None = int(headers["content-length"]) if "content-length" in headers else None
        except ValueError:
            content_length = None
        # The app's MAX_CONTENT_LENGTH, read per request as Quart does (it may be changed live).
        call = ForwardCall(scope["path"], scope.get("query_string", b""), headers,
                           request_id_from(headers.get("x-request-id")), content_length,
                           self._config["MAX_CONTENT_LENGTH"], scope, receive, self._body_timeout)
        if on_lane:
            # The lane cancels the request itself when the client goes away (h1lane.py).
            await self._respond(call, send)
            return
        # Hypercorn (as patched by hypercorn_patch, which serve_gateway applies) calls
        # on_close when the request's stream closes: cancelling this scope then does what
        # a task waiting for http.disconnect would, without a task and a nursery per request.
        with trio.CancelScope() as request_scope:
            extensions[ON_CLOSE_KEY] = request_scope.cancel
            await self._respond(call, send)

    async def _respond(self, call: ForwardCall, send: Any) -> None:
        """Run the forward and send its result (or its error); then release what the request
        holds (:attr:`ForwardCall.releases`), however it ended. A client that left before its
        body was complete gets nothing."""
        # The server's own sink (the fast lane's: framing and a direct write), as wrapped by
        # the middlewares between (instrumentation), else one over the ASGI send.
        sink: BodySink = call.scope["extensions"].get(BODY_SINK_KEY) or _AsgiSink(send)
        try:
            try:
                status, headers, content = await self._forward(call)
            except GatewayError as error:
                await _send_error(sink, error, call.request_id)
                return
            except _ClientGone:
                return
            except Exception as error:  # a bug: answer 500 in OpenAI's shape, log the trace
                log.error("gateway request %s failed", call.request_id, exc_info=error)
                await _send_error(sink, errors.internal_error(call.request_id), call.request_id)
                return
            headers.setdefault("x-request-id", call.request_id)
            if isinstance(content, (bytes, bytearray)):
                await sink.respond(status, headers, bytes(content))
                return
            try:
                await sink.start(status, headers)
                last = await content.pump(sink)
                # The last piece and the end in one write, after the body released what it
                # held (the replica's lease is free before the client can send again).
                await send({"type": "http.response.body", "body": last})
            finally:
                with trio.CancelScope(shield=True):
                    await content.aclose()
        finally:
            await call.releases.aclose()


def _header(scope: Mapping[str, Any], name: bytes) -> str | None:
    """Return the first value of header ``name`` (lower-case) in ``scope``, or None."""
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _encode(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]


async def _send_error(sink: BodySink, error: GatewayError, request_id: str) -> None:
    """Send ``error`` as an OpenAI-shaped JSON response with its headers and ``x-request-id``."""
    body = json.dumps(error.body()).encode()
    headers = {name.lower(): str(value) for name, value in dict(error.headers).items()}
    headers["content-type"] = "application/json"
    headers["x-request-id"] = request_id
    for framing in ("content-length", "transfer-encoding", "connection"):
        headers.pop(framing, None)
    await sink.respond(error.status, headers, body)
