"""A fast lane through Hypercorn 0.18's HTTP/1.1 protocol for simple, complete requests.

Profiled on the gateway under load (py-spy, keep-alive connections, small JSON requests
and answers), Hypercorn's HTTP/1.1 machinery was about a quarter of the gateway's CPU
per request: h11's state machine parsing the request into events and serializing the
response, an ``HTTPStream`` per request, a memory channel and an app task per request
(``TaskGroup.spawn_app``), and the recycling of the connection after the response. The
gateway's hot path needs none of it: a request arrives whole in one read, and the
answer is a head plus a body of known length, or an event stream.

:class:`FastLaneProtocol` is Hypercorn's ``H11Protocol`` with a lane in front: when a
connection has nothing else in progress and one read holds a **simple** request whole
(see :func:`parse_simple_request`), the lane parses it with one regular expression,
builds the same ASGI scope Hypercorn builds, and runs the app with ``receive``/``send``
of its own (:class:`_Exchange`), which frame the response as h11 would (content-length,
or chunked when the app gives none). The exchanges of a connection run one after another
in one task of the connection's task group (:class:`_ExchangeRunner`), not in a task
each; when the client goes away, the exchange in progress is cancelled (the runner's
one cancel scope), so an app on the lane needs no cancel scope of its own to stop
working for a client that left.
Anything else (a partial or malformed request, ``Transfer-Encoding``, ``Expect``,
``Upgrade``, ``Connection: close``, ``HEAD``, HTTP/1.0, an over-long head) goes to
``H11Protocol`` unchanged, so h11 keeps answering the odd and the broken with its own
errors. Requests that arrive pipelined wait for the response before them, as h11
makes them wait.

What the lane keeps from Hypercorn: the scope's fields, the ``date`` header and
``Connection: close`` after ``keep_alive_max_requests``, the keep-alive idle timer
(``Updated`` events), ``mark_request``, a broken connection on a write treated as
closed (as ``protocol_send`` does; the lane writes to the stream itself, without the
send lock and the shielded scope: it is the connection's only writer while an exchange
runs, and a write cut short ends the exchange by closing), closing after the response
when the worker is terminating, ``http.disconnect`` for a client that went away (and
:data:`~llmgw.router.http.extensions.ON_CLOSE_KEY`), a 500 for an app that fails before
responding, and closing the connection when it fails mid-response. The lane stays
closed when Hypercorn's access log or ``server_names`` are configured (the gateway
sets neither).

:func:`install` makes Hypercorn's trio server use :class:`FastLaneProtocol` for HTTP/1.1
connections (idempotent); :func:`llmgw.router.http.hypercorn_patch.apply` calls it when
the gateway starts serving.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any, Awaitable, Final, Mapping
from urllib.parse import unquote

import h11
import trio
from hypercorn import protocol as hypercorn_protocol
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.h11 import H11Protocol

from . import eagerio
from .extensions import BODY_SINK_KEY, FAST_LANE_KEY, ON_CLOSE_KEY, WHOLE_BODY_KEY

log = logging.getLogger(__name__)

# A request line the lane takes: a method whose request has a body or none (not HEAD,
# whose response has none; not CONNECT or TRACE), an origin-form target of visible
# ASCII, HTTP/1.1 (HTTP/1.0 defaults to closing and has no chunked framing).
_REQUEST_LINE: Final = re.compile(rb"(GET|POST|PUT|PATCH|DELETE|OPTIONS) (/[!-~]*) HTTP/1\.1")

# Header lines, each "token: value CRLF": a token name (RFC 9110), a value of visible
# characters, spaces, tabs and obs-text. No lone CR or LF, no NUL or other controls,
# no obs-fold continuation lines: anything else is h11's to judge. The same pattern
# checks the response headers an app hands over.
_HEADER_LINES: Final = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t -~\x80-\xff]*\r\n)*")

# Content-Length digits the lane accepts (10**15 bytes); longer goes to h11.
_MAX_LENGTH_DIGITS: Final = 15

# Request headers that need HTTP/1.1 machinery the lane does not have.
_NOT_SIMPLE: Final = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"te"})

# Seconds the lane's error path (a 500 head of a few bytes, then closing the connection)
# may take while shielded from cancellation: it must run even when the connection's
# task group is being cancelled, but not hold it up.
_ABORT_WRITE_TIMEOUT_S: Final = 5.0

_REASONS: Final = {status.value: status.phrase.encode("ascii") for status in HTTPStatus}

# Exchange states.
_REQUEST, _RESPONSE, _DONE = 0, 1, 2

#: Set (True) by the lane on Hypercorn's ``TCPServer`` when it has handed a request whole to
#: the app: the connection's reader (``hypercorn_patch``) then waits for the socket before
#: its next read instead of reading first. An HTTP/1.1 client sends its next request only
#: after this one's response, so that read would find nothing (a syscall and an exception
#: per request); a pipelining client's bytes are there at the next scheduler pass.
ANSWERING_ATTR: Final = "_llmgw_answering"


class SimpleRequest:
    """A request the lane can serve: ``method`` (str), ``target`` (bytes), ``headers``
    (lower-case names, stripped values), ``body`` (bytes, whole) and ``size`` (bytes of
    the read it used, head and body)."""

    __slots__ = ("method", "target", "headers", "body", "size")

    def __init__(self, method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                 size: int) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.size = size


def parse_simple_request(data: bytes, max_head: int) -> SimpleRequest | None:
    """Return the simple request at the start of ``data``, or None if there is none.

    None means "not for the lane": the head or the body is not all in ``data``, the head
    is longer than ``max_head`` bytes, or the request is not simple (see the module
    docstring); h11 then parses it, and answers it or rejects it. Never raises.
    """
    head_end = data.find(b"\r\n\r\n", 0, max_head)
    if head_end < 0:
        return None
    line_end = data.find(b"\r\n")
    match = _REQUEST_LINE.fullmatch(data, 0, line_end)
    if match is None or line_end == head_end:  # no headers at all: no Host
        return None
    block_start = line_end + 2
    block_end = head_end + 2
    if _HEADER_LINES.fullmatch(data, block_start, block_end) is None:
        return None
    headers: list[tuple[bytes, bytes]] = []
    length = -1
    hosts = 0
    for line in data[block_start:head_end].split(b"\r\n"):
        name, _, value = line.partition(b":")
        name = name.lower()
        value = value.strip(b" \t")
        if name == b"content-length":
            if length >= 0 or not value.isdigit() or len(value) > _MAX_LENGTH_DIGITS:
                return None
            length = int(value)
        elif name == b"host":
            hosts += 1
        elif name in _NOT_SIMPLE or (name == b"connection" and value.lower() != b"keep-alive"):
            return None
        headers.append((name, value))
    if hosts != 1:
        return None
    body_start = head_end + 4
    size = body_start + max(length, 0)
    if len(data) < size:
        return None
    body = data[body_start:size] if length > 0 else b""
    return SimpleRequest(match.group(1).decode("ascii"), match.group(2), headers, body, size)


class FastLaneProtocol(H11Protocol):
    """Hypercorn's ``H11Protocol`` with the fast lane of the module docstring in front."""

    #: Requests the lane has served, all connections together (the tests read it to know
    #: which path served a request).
    served = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lane_open = not self.config.server_names and self.config.log.access_logger is None
        self._scheme = "https" if self.ssl else "http"
        self._root_path = self.config.root_path  # a property of Hypercorn's config: read once
        # The ASGI app inside Hypercorn's ASGIWrapper, which only drops the two arguments
        # Hypercorn adds: the lane calls it directly (None: call Hypercorn's app, e.g. WSGI).
        self._asgi: Any = self.app.app if type(self.app) is ASGIWrapper else None
        self._exchange: _Exchange | None = None
        self._exchange_done: trio.Event | None = None
        self._runner: _ExchangeRunner | None = None
        self._closed = False
        # The connection's stream, written directly (see the module docstring); None if
        # Hypercorn's send callback is not TCPServer.protocol_send: writes then go through it.
        server = getattr(self.send, "__self__", None)
        self._server: Any = server
        self._stream: Any = getattr(server, "stream", None)
        # The connection's idle timer when it is llmgw's (hypercorn_patch.IdleTimer): told
        # directly, not through an ``Updated`` event and Hypercorn's send (its type checks
        # are ABC checks, and two coroutines per event); None: the events go as before.
        timer = getattr(server, "idle_task", None)
        self._timer: Any = timer if hasattr(timer, "rearm") else None

    async def handle(self, event: Any) -> None:
        if type(event) is RawData and self._lane_open and event.data:
            data = event.data
            while data:
                if self._exchange is not None:
                    # More bytes while a response is in progress (a pipelining client):
                    # they wait for it, as h11 pauses reading.
                    done = self._exchange_done
                    if done is None:
                        done = self._exchange_done = trio.Event()
                    await done.wait()
                    if self._closed:
                        return
                if not self._lane_free():
                    break
                request = parse_simple_request(data, self.config.h11_max_incomplete_size)
                if request is None:
                    break
                data = data[request.size:]
                await self._start(request)
            if not data:
                return
            event = RawData(data=data)
        elif type(event) is Closed:
            self._closed = True
            exchange = self._exchange
            if exchange is not None:
                exchange.client_gone()
            runner = self._runner
            if runner is not None:
                runner.close(cancel=exchange is not None)
        await super().handle(event)

    def _lane_free(self) -> bool:
        """Return whether h11 has nothing in progress: no stream, idle, nothing buffered."""
        connection = self.connection
        return (
            self.stream is None
            and type(connection) is h11.Connection
            and connection.their_state is h11.IDLE
            and connection.our_state is h11.IDLE
            and not connection.trailing_data[0]
            and not self.context.terminated.is_set()
        )

    async def _start(self, request: SimpleRequest) -> None:
        """Run the app for ``request`` in a task of the connection's task group."""
        raw_path, _, query = request.target.partition(b"?")
        path = raw_path.decode("ascii")
        scope = {
            "type": "http",
            "http_version": "1.1",
            "asgi": {"spec_version": "2.1", "version": "3.0"},
            "method": request.method,
            "scheme": self._scheme,
            "path": unquote(path) if "%" in path else path,
            "raw_path": raw_path,
            "query_string": query,
            "root_path": self._root_path,
            "headers": request.headers,
            "client": self.client,
            "server": self.server,
            "state": self.connection_state.copy(),
            "extensions": {WHOLE_BODY_KEY: request.body, FAST_LANE_KEY: True},
        }
        self.keep_alive_requests += 1
        FastLaneProtocol.served += 1
        if self.context.max_requests is not None:  # else Hypercorn's mark_request does nothing
            await self.context.mark_request()
        if self._timer is not None:
            self._timer.disarm()
        else:
            await self.send(Updated(idle=False))
        exchange = self._exchange = _Exchange(self, scope)
        scope["extensions"][BODY_SINK_KEY] = exchange
        if self._stream is not None:
            setattr(self._server, ANSWERING_ATTR, True)
        runner = self._runner
        if runner is None:
            self._runner = _ExchangeRunner(exchange)
            self.task_group.spawn(self._runner.run)
        else:
            runner.hand(exchange)

    async def write(self, data: bytes) -> None:
        """Write ``data`` to the client; a broken or closed connection counts as closed.

        Cancellation can cut a write short: the exchange then closes the connection.
        """
        stream = self._stream
        if stream is None:
            await self.send(RawData(data=data))
            return
        try:
            await eagerio.send_all(stream, data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            await self.handle(Closed())

    def _at_keep_alive_limit(self) -> bool:
        """Return whether the response in progress is the last one the connection may serve."""
        return self.keep_alive_requests >= self.config.keep_alive_max_requests

    async def _end_exchange(self, close: bool) -> None:
        """The response is complete (or abandoned): recycle or close, then let held bytes in.

        Closing is shielded from cancellation: a connection left open here would wait
        for a response that never comes.
        """
        self._exchange = None
        waiting = self._exchange_done
        self._exchange_done = None
        try:
            if close or self._closed or self.context.terminated.is_set():
                self._closed = True
                with trio.CancelScope(shield=True):
                    await self.send(Closed())
            elif self._timer is None or not self._timer.rearm():
                await self.send(Updated(idle=True))  # re-arms the idle timer: no checkpoint
        finally:
            if waiting is not None:
                waiting.set()


class _ExchangeRunner:
    """The task running a connection's lane exchanges, one after another.

    It starts with the connection's first lane request and lives as long as the
    connection. Each later exchange is handed to it (:meth:`hand`: a wake-up) instead of
    being spawned as a task of its own, and it runs them all in one cancel scope, which
    :meth:`close` cancels when the client goes away mid-exchange; a task and a cancel
    scope per request were each a measurable part of the gateway's CPU per request.
    The lane hands over an exchange only once the one before has completed its response,
    so at most one waits here while the app of the one before returns.
    """

    __slots__ = ("_next", "_task", "_parked", "_scope", "_closing")

    def __init__(self, first: _Exchange) -> None:
        self._next: _Exchange | None = first
        self._task: trio.lowlevel.Task | None = None
        self._parked = False
        self._scope = trio.CancelScope()
        self._closing = False

    async def run(self) -> None:
        """Run the exchanges handed over until :meth:`close`; returns then (at once if
        cancelled: the exchange in progress is cancelled, one waiting never runs)."""
        self._task = trio.lowlevel.current_task()
        with self._scope:
            while True:
                exchange = self._next
                if exchange is not None:
                    self._next = None
                    await exchange.run()
                elif self._closing:
                    return
                else:
                    self._parked = True
                    await trio.lowlevel.wait_task_rescheduled(self._unpark)

    def _unpark(self, _: object) -> trio.lowlevel.Abort:
        self._parked = False
        return trio.lowlevel.Abort.SUCCEEDED

    def hand(self, exchange: _Exchange) -> None:
        """Run ``exchange`` next (the one before has completed its response)."""
        self._next = exchange
        self._wake()

    def close(self, cancel: bool) -> None:
        """The connection closed: with ``cancel`` (an exchange was in progress: its client
        went away) cancel it; else end once the exchange in progress, if any, returns."""
        self._closing = True
        if cancel:
            self._scope.cancel()
        self._wake()

    def _wake(self) -> None:
        if self._parked:
            self._parked = False
            trio.lowlevel.reschedule(self._task)


class _Exchange:
    """One request on the lane: the app's ``receive`` and ``send``, and the response framing."""

    __slots__ = ("protocol", "scope", "state", "body_given", "gone", "gone_event", "head", "chunked",
                 "remaining", "no_body", "close_after")

    def __init__(self, protocol: FastLaneProtocol, scope: dict[str, Any]) -> None:
        self.protocol = protocol
        self.scope = scope
        self.state = _REQUEST
        self.body_given = False
        self.gone = False  # receive() now answers http.disconnect
        self.gone_event: trio.Event | None = None
        self.head: bytes | None = None  # a response head held back to go out with the first body bytes
        self.chunked = False
        self.remaining = -1  # body bytes the declared content-length still expects (-1: none declared)
        self.no_body = False
        self.close_after = False

    async def run(self) -> None:
        """Run the app; then, if it did not finish its response, answer 500 or close.

        App errors are logged as Hypercorn logs them; cancellation (the connection's task
        group going down) propagates after the connection is told to close.
        """
        protocol = self.protocol
        try:
            asgi = protocol._asgi
            if asgi is not None:
                await asgi(self.scope, self.receive, self.send)
            else:
                await protocol.app(self.scope, self.receive, self.send, trio.to_thread.run_sync, trio.from_thread.run)
        except trio.Cancelled:
            raise
        except BaseExceptionGroup as error:
            _, others = error.split(trio.Cancelled)
            if others is None:
                raise
            await protocol.config.log.exception("Error in ASGI Framework")
        except Exception:
            await protocol.config.log.exception("Error in ASGI Framework")
        finally:
            # The sink (this exchange, or a middleware's wrapper of it) in the scope is a
            # reference cycle: dropped here, the request's objects are freed at once rather
            # than left to the garbage collector (whose pauses were a tail latency).
            self.scope["extensions"].pop(BODY_SINK_KEY, None)
            if self.state != _DONE:
                with trio.CancelScope(shield=True, relative_deadline=_ABORT_WRITE_TIMEOUT_S):
                    await self._abort()

    async def _abort(self) -> None:
        """The app ended without completing its response: 500 if none was started, then close."""
        started = self.state != _REQUEST and self.head is None  # a held head was never sent
        self.state = _DONE
        self._mark_gone()
        protocol = self.protocol
        if not started and not protocol._closed:
            head = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n%s\r\n" % (
                _server_header_lines(protocol.config))
            await protocol.write(head)
        await protocol._end_exchange(close=True)

    async def receive(self) -> dict[str, Any]:
        """The ASGI receive: the whole body first, then ``http.disconnect`` once the client
        is gone or the response is complete."""
        if not self.body_given:
            self.body_given = True
            return {"type": "http.request", "body": self.scope["extensions"][WHOLE_BODY_KEY], "more_body": False}
        if not self.gone:
            event = self.gone_event
            if event is None:
                event = self.gone_event = trio.Event()
            await event.wait()
        return {"type": "http.disconnect"}

    def client_gone(self) -> None:
        """The connection closed while this exchange was in progress: tell the app."""
        self._mark_gone()
        hook = self.scope["extensions"].get(ON_CLOSE_KEY)
        if hook is not None:
            hook()

    def _mark_gone(self) -> None:
        self.gone = True
        event = self.gone_event
        if event is not None:
            event.set()

    async def send(self, message: dict[str, Any]) -> None:
        """The ASGI send for ``http.response.start`` and ``http.response.body``.

        Raises ``ValueError`` for a malformed response head or a body that does not match
        its declared ``content-length``, and ``RuntimeError`` for a message out of order or
        of another type (as Hypercorn raises for HTTP/1.1); the app's failure then ends
        the exchange (500, or the connection closes).
        """
        kind = message["type"]
        protocol = self.protocol
        if kind == "http.response.body" and self.state == _RESPONSE:
            body = message.get("body", b"")
            more = message.get("more_body", False)
            data = self._frame(body, more)
            if data:
                await protocol.write(data)  # if cancelled here, run() closes the connection
            if not more:
                await self._complete(self.close_after)
        elif kind == "http.response.start" and self.state == _REQUEST:
            head = self._head(int(message["status"]), message.get("headers", ()))
            self.state = _RESPONSE
            if self.remaining < 0 or self.no_body:
                await protocol.write(head)  # a stream's head goes out at once
            else:
                self.head = head
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} in state {self.state}")

    def send_piece(self, body: bytes) -> Awaitable[None] | None:
        """Send ``body`` as the next piece of a chunked response (the lane's
        :class:`~llmgw.router.http.forward.BodySink`).

        Frames it and writes it at once (:func:`~.eagerio.try_send`), without the ASGI
        message and its checks: returns None when the kernel took it all, else the
        coroutine that writes the rest. Anything but a started chunked response with its
        head gone goes through :meth:`send` (and its errors).
        """
        protocol = self.protocol
        stream = protocol._stream
        if self.state != _RESPONSE or not self.chunked or stream is None:
            return self.send({"type": "http.response.body", "body": body, "more_body": True})
        if not body:
            return None
        data = b"%x\r\n%s\r\n" % (len(body), body)
        head = self.head
        if head is not None:  # held by start(): it goes with the first piece
            self.head = None
            data = head + data
        sent = eagerio.try_send(stream, data)
        if sent == len(data):
            return None
        return protocol.write(data[sent:] if sent else data)  # no room: wait for it (or for the close)

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        """Start a chunked response: ``status`` and ``headers`` (lower-case names, no framing
        headers), its head held back to go out with the first piece (:meth:`send_piece`, or
        the final ``http.response.body``) or with :meth:`flush` (the lane's
        :class:`~llmgw.router.http.forward.BodySink`). Raises as :meth:`respond` does.
        """
        if not await self._framed_here(status, headers):
            return
        self.close_after = close = self.protocol._at_keep_alive_limit()
        self.head = self._whole_head(status, headers, b"transfer-encoding: chunked\r\n", close)
        self.chunked = True
        self.state = _RESPONSE

    def flush(self) -> Awaitable[None] | None:
        """Send the head :meth:`start` held, if it still is (the lane's
        :class:`~llmgw.router.http.forward.BodySink`): None when there is none, else the
        coroutine that writes it."""
        head = self.head
        if head is None or self.state != _RESPONSE:
            return None
        self.head = None
        return self.protocol.write(head)

    async def _framed_here(self, status: int, headers: Mapping[str, str]) -> bool:
        """Return whether :meth:`start` or :meth:`respond` frame a response of ``status``
        themselves; if not (no body, or a status the lane does not frame), start it through
        :meth:`send` and return False. Raises ``RuntimeError`` if a response was already started."""
        if self.state != _REQUEST:
            raise RuntimeError("a response was already started on this exchange")
        if status not in (204, 304) and 200 <= status <= 999:
            return True
        await self.send({"type": "http.response.start", "status": status, "headers": [
            (name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]})
        return False

    def _whole_head(self, status: int, headers: Mapping[str, str], framing: bytes, close: bool) -> bytes:
        """Return the head of a response whose headers the app gave as a dict: its own,
        ``framing``, the server's and with ``close`` a ``connection: close``.

        Raises ``ValueError`` for framing headers among ``headers`` or characters HTTP does
        not allow.
        """
        if "content-length" in headers or "transfer-encoding" in headers or "connection" in headers:
            raise ValueError("the server sets the framing headers itself")
        block = "".join([f"{name}: {value}\r\n" for name, value in headers.items()]).encode("latin-1")
        if _HEADER_LINES.fullmatch(block) is None:
            raise ValueError("response headers with characters HTTP does not allow")
        return b"HTTP/1.1 %d %s\r\n%s%s%s%s\r\n" % (
            status, _REASONS.get(status, b""), block, framing, _server_header_lines(self.protocol.config),
            b"connection: close\r\n" if close else b"")

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """Send a whole response in one write: ``status``, ``headers`` (lower-case names, no
        framing headers: the content-length is added here) and ``body`` (the lane's
        :class:`~llmgw.router.http.forward.BodySink`).

        Does what ``http.response.start`` and one final ``http.response.body`` do, without
        the two messages and their list of encoded header pairs. Raises ``ValueError`` for
        headers HTTP does not allow (or framing headers), ``RuntimeError`` if a response was
        already started; the exchange then ends as for :meth:`send`'s errors.
        """
        if not await self._framed_here(status, headers):
            await self.send({"type": "http.response.body", "body": body})
            return
        protocol = self.protocol
        close = protocol._at_keep_alive_limit()
        head = self._whole_head(status, headers, b"content-length: %d\r\n" % len(body), close)
        self.state = _RESPONSE  # a write cut short now closes the connection (run())
        await protocol.write(head + body)
        await self._complete(close)

    async def _complete(self, close: bool) -> None:
        """The response has gone out whole: tell the app, recycle or (``close``) close."""
        self.state = _DONE
        self._mark_gone()
        await self.protocol._end_exchange(close)

    def _head(self, status: int, headers: Any) -> bytes:
        """Return the response head, and set the framing (content-length, chunked or none)."""
        if not 200 <= status <= 999:
            raise ValueError(f"the fast lane sends no {status} responses")
        protocol = self.protocol
        lines = []
        for name, value in headers:
            name = bytes(name).strip()
            value = bytes(value).strip()
            lower = name.lower()
            if lower == b"content-length":
                if not value.isdigit():
                    raise ValueError(f"bad content-length {value!r}")
                self.remaining = int(value)
            elif lower == b"transfer-encoding":
                continue  # the framing is the server's, as h11 decides it
            elif lower == b"connection" and b"close" in value.lower():
                self.close_after = True
            lines.append(b"%s: %s\r\n" % (name, value))
        lines.append(_server_header_lines(protocol.config))
        if status in (204, 304):
            self.no_body = True
        elif self.remaining < 0:
            self.chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        if protocol._at_keep_alive_limit() and not self.close_after:
            self.close_after = True
            lines.append(b"connection: close\r\n")
        block = b"".join(lines)
        if _HEADER_LINES.fullmatch(block) is None:
            raise ValueError("response headers with characters HTTP does not allow")
        return b"HTTP/1.1 %d %s\r\n%s\r\n" % (status, _REASONS.get(status, b""), block)

    def _frame(self, body: bytes, more: bool) -> bytes:
        """Return the bytes to write for one body message (with a held head before them)."""
        if self.no_body:
            data = b""
        elif self.chunked:
            data = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more:
                data += b"0\r\n\r\n"
        else:
            remaining = self.remaining - len(body)
            if remaining < 0 or (not more and remaining):
                raise ValueError("response body does not match its content-length")
            self.remaining = remaining
            data = bytes(body)
        head = self.head
        if head is not None:
            self.head = None
            return head + data
        return data


def _header_lines(headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(b"%s: %s\r\n" % (name, value) for name, value in headers)


# The last list of server headers seen, and its lines (see _server_header_lines).
_server_lines: tuple[object, bytes] = (None, b"")


def _server_header_lines(config: Any) -> bytes:
    """Return the header lines of the server's own response headers (``date``, ...).

    The gateway's config (``serve._GatewayConfig``) returns the same list for a whole second:
    its lines are formatted once for it instead of for every response.
    """
    global _server_lines
    headers = config.response_headers("h11")
    seen, lines = _server_lines
    if headers is not seen:
        lines = _header_lines(headers)
        _server_lines = (headers, lines)
    return lines


def install() -> None:
    """Make Hypercorn's ``ProtocolWrapper`` use :class:`FastLaneProtocol` for HTTP/1.1 (idempotent)."""
    if hypercorn_protocol.H11Protocol is FastLaneProtocol:
        return
    if hypercorn_protocol.H11Protocol is not H11Protocol:
        log.warning("hypercorn's HTTP/1.1 protocol is already replaced: fast lane not installed")
        return
    hypercorn_protocol.H11Protocol = FastLaneProtocol  # type: ignore[misc]
