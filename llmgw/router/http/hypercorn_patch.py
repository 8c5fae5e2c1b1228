"""Hypercorn 0.18's trio server as the gateway runs it: two fixes and three per-request costs removed.

:func:`apply` is the one call that changes Hypercorn, made by
:func:`~llmgw.router.http.serve.serve_gateway` before it serves (in the single process
and in every gateway worker); importing any llmgw module patches nothing. It is
idempotent, and it refuses to run (:class:`HypercornUnchecked`) on a Hypercorn release
series other than :data:`CHECKED_HYPERCORN`, because every patch below replaces or wraps
private parts of it. What it does, without changing a byte on the wire:

* **A close race that can stop the whole gateway.** ``TCPServer`` writes responses
  under its ``send_lock`` but closes the connection (``send_eof`` in ``_close``)
  without it. When the app finishes a response (so its task closes a ``Connection:
  close`` connection) at the moment the reading task meets a protocol error (a client
  that half-closed or sent junk after its request) and writes Hypercorn's own error
  response, the write hits trio's conflict detector and raises
  ``trio.BusyResourceError`` out of the connection handler, which cancels
  ``serve_listeners`` and with it every connection (found by
  tests/component/test_gateway_fuzz.py). ``TCPServer.protocol_send`` is wrapped so that
  such a write is dropped (the connection is being closed anyway) and the connection is
  treated as closed.
* **The keep-alive idle timer.** ``TCPServer`` arms it with ``TrioSingleTask.restart``
  after every response (a lock, a cancelled task, a fresh task started with
  ``nursery.start``) and disarms it with ``stop`` when the next request arrives (the lock
  again, a cancel). :class:`IdleTimer` replaces it, per connection, with one task that
  lives as long as the connection and sleeps on a cancel-scope deadline that is re-armed
  lazily: arming and disarming are attribute writes (the end of
  ``TCPServer._read_data`` or ``TCPServer._close`` ends the task). The behaviour is
  Hypercorn's: an idle connection is closed ``keep_alive_timeout`` seconds after its
  last response; when the worker is terminating, an idle connection is closed at once
  and a busy one as soon as it becomes idle. Without ``read_timeout`` (the gateway sets
  none) the read loop also skips a ``fail_after(inf)`` per receive. Profiled on the
  gateway (py-spy, non-streaming requests on keep-alive connections), this and the
  next item were about a sixth of the gateway's CPU per request.
* **Two writes per response.** ``H11Protocol`` writes the response head, then the body,
  then (for a ``content-length`` body) an empty end-of-message, each through the
  connection's send lock, a shielded cancel scope and a ``send`` syscall. For a response
  that declares its ``content-length`` (whose body therefore follows at once: every
  non-streaming answer of the gateway), the patched ``stream_send`` holds the head's bytes and
  writes them with the first body bytes, or with the end of the message if there is no
  body, and skips the empty write. Responses without ``content-length`` (event streams,
  chunked) are written exactly as before, head first, so a stream's head is never held
  back waiting for the first token.
* **A close it did not announce.** Hypercorn closes a connection after a response that
  ended while its request's body was still unread (an app that refused the request at
  its head), but the response does not say so, and a keep-alive client sent its next
  request into the closing connection and got no answer. Such a response now carries
  ``connection: close`` (:func:`_final_headers`), as Hypercorn's own at the keep-alive
  request limit does.
* **h11 for simple requests.** Hypercorn's HTTP/1.1 connections use the lane of
  :mod:`llmgw.router.http.h1lane` (see there).

It also lets the app learn that a request's stream closed without a task of its own
waiting for ``http.disconnect``
(:data:`~llmgw.router.http.extensions.ON_CLOSE_KEY`; the gateway's forward uses it to
cancel the request, and with it the upstream request, when the client goes away).
:func:`apply` checks that Hypercorn's TCP server still has the attributes the timer
relies on and leaves the timer as it is (logging why) if not.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
from itertools import chain
from typing import Any

import h11
import trio
from hypercorn.events import Closed, RawData
from hypercorn.protocol import h11 as hypercorn_h11
from hypercorn.protocol.events import Body, EndBody, Response, StreamClosed
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.trio import tcp_server

from . import eagerio, h1lane
from .extensions import ON_CLOSE_KEY

log = logging.getLogger(__name__)

_MARK = "_llmgw_fast_installed"
_CLOSE_RACE_MARK = "_llmgw_close_race_fixed"

# Attribute on a TCPServer holding the cancel scope of its read loop (see _stop_reading).
_READING = "_llmgw_reading"
# Attribute on an H11Protocol holding a response head not yet written (None: none held).
_HELD = "_llmgw_held_head"

#: The Hypercorn release series the patches were checked against (pyproject.toml holds
#: ``hypercorn>=0.18,<0.19`` for the same reason). A new series must be read against
#: every patched method before it is added here.
CHECKED_HYPERCORN = "0.18"


class HypercornUnchecked(RuntimeError):
    """The installed Hypercorn is not of the series the gateway's patches were checked against."""


def check_version(installed: str) -> None:
    """Return if Hypercorn ``installed`` (a version string) is of :data:`CHECKED_HYPERCORN`'s series.

    Raises :class:`HypercornUnchecked`, naming both versions and the fix, otherwise.
    """
    if installed == CHECKED_HYPERCORN or installed.startswith(CHECKED_HYPERCORN + "."):
        return
    raise HypercornUnchecked(
        f"hypercorn {installed} is installed, but the gateway's patches to it "
        f"(llmgw.router.http.hypercorn_patch) were checked against hypercorn {CHECKED_HYPERCORN}.x only; "
        f"install that series (pip install 'hypercorn=={CHECKED_HYPERCORN}.*') or check the patches "
        "against the new release and run tests/component/test_hypercorn_patch.py"
    )


def apply() -> None:
    """Check Hypercorn's version and patch it as the module docstring says; returns nothing.

    Idempotent: later calls return at once. Raises :class:`HypercornUnchecked` (patching
    nothing) on an unchecked Hypercorn release.
    """
    global _applied
    if _applied:
        return
    check_version(importlib.metadata.version("hypercorn"))
    _fix_close_race()
    _patch_timer_and_writes()
    h1lane.install()
    _applied = True


_applied = False


class IdleTimer:
    """Drop-in for ``TrioSingleTask`` as ``TCPServer.idle_task``: one task per connection.

    ``restart(task_group, server._idle_timeout)`` arms the timer (the first call starts
    the watching task in the connection's task group), ``stop()`` disarms it, and
    :meth:`detach` (called when the connection closes) ends the watching task. When the
    deadline passes while armed, or the worker terminates while the connection is idle
    (or later, once it becomes idle), the connection is closed as Hypercorn's
    ``_idle_timeout`` does. Cancellation of the connection's task group ends the task.
    """

    __slots__ = ("_server", "_scope", "_idle", "_idle_since", "_closed", "_became_idle")

    def __init__(self) -> None:
        self._server: Any = None
        self._scope: trio.CancelScope | None = None
        self._idle = False
        self._idle_since = 0.0
        self._closed = False
        self._became_idle: trio.Event | None = None

    async def restart(self, task_group: Any, action: Any) -> None:
        """Arm the timer: the connection closes ``keep_alive_timeout`` seconds from now unless stopped."""
        if self._closed:
            return
        if self._server is None:
            self._server = action.__self__  # TCPServer._idle_timeout, bound
            await task_group._nursery.start(self._watch)
        self.rearm()

    async def stop(self) -> None:
        """Disarm the timer (a request is being served)."""
        self.disarm()

    def disarm(self) -> None:
        """:meth:`stop`, synchronously (the fast lane calls it directly, not through an
        ``Updated`` event and Hypercorn's send)."""
        self._idle = False

    def rearm(self) -> bool:
        """:meth:`restart`, synchronously, once its watching task runs; return False (and do
        nothing) before then, when :meth:`restart` must be awaited."""
        server = self._server
        if server is None:
            return False
        if self._closed:
            return True
        now = trio.current_time()
        self._idle = True
        self._idle_since = now
        scope = self._scope
        # A deadline already set (from an earlier idle period) is left alone: when it
        # fires, the watcher re-arms it from _idle_since. So a busy keep-alive connection
        # costs no deadline changes per request, only a wake-up per keep-alive period.
        if scope is not None and scope.deadline == math.inf:
            scope.deadline = now + server.config.keep_alive_timeout
        self._wake()
        return True

    def detach(self) -> None:
        """The connection is closing: end the watching task without closing anything."""
        self._closed = True
        if self._scope is not None:
            self._scope.cancel()
        self._wake()

    def _wake(self) -> None:
        woken = self._became_idle
        if woken is not None:
            self._became_idle = None
            woken.set()

    async def _watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        server = self._server
        terminated = server.context.terminated
        task_status.started()
        while True:
            if self._closed:
                return
            timeout = server.config.keep_alive_timeout
            deadline = self._idle_since + timeout if self._idle else math.inf
            scope = self._scope = trio.CancelScope(deadline=deadline)
            with scope:
                if terminated.is_set():
                    await trio.lowlevel.checkpoint()
                else:
                    await terminated.wait()
            self._scope = None
            if self._closed:
                return
            if terminated.is_set():
                if self._idle:
                    break
                # Terminating while a request is being served: Hypercorn closes the
                # connection once it is idle again (or it closes by itself).
                woken = self._became_idle = trio.Event()
                await woken.wait()
                if self._closed:
                    return
                break
            if self._idle and trio.current_time() >= self._idle_since + timeout:
                break  # idle for the whole keep-alive period
            # else: busy, or idle for less than the period: wait again from _idle_since
        with trio.CancelScope(shield=True):
            await server._initiate_server_close()


async def _read_until_closed(server: Any) -> None:
    """``TCPServer._read_data`` for a server without ``read_timeout`` (the gateway's case):
    the same loop, minus a ``fail_after(inf)`` context manager around every receive, and
    reading with :func:`llmgw.router.http.eagerio.receive_some` (no schedule point when the
    bytes are there).

    Hands every received chunk to the protocol; on EOF, or when the stream is closed or
    broken, tells the protocol the connection closed and returns.
    """
    stream = server.stream
    protocol = server.protocol
    answering = h1lane.ANSWERING_ATTR
    setattr(server, answering, False)
    with trio.CancelScope() as reading:
        setattr(server, _READING, reading)
        while True:
            # Right after the lane took a whole request the client is waiting for its
            # answer: wait for the socket first (h1lane.ANSWERING_ATTR).
            wait_first = getattr(server, answering)
            if wait_first:
                setattr(server, answering, False)
            try:
                data = await eagerio.receive_some(stream, tcp_server.MAX_RECV, wait_first=wait_first)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                break
            await protocol.handle(RawData(bytes(data)))
            if not data:
                break
    await protocol.handle(Closed())


def _stop_reading(server: Any) -> None:
    """End the connection's read loop (:func:`_read_until_closed`) once the connection is closed.

    A reader can wait on something other than the socket: h11 answers PAUSED to a request
    that arrives before the previous response was recycled, and Hypercorn's reader then
    waits for ``can_read``. When the worker is terminating, Hypercorn closes such a
    connection after the response instead of recycling it, and nothing wakes that reader:
    the connection (and a stopping gateway with it) waited for the whole graceful timeout.
    """
    reading = getattr(server, _READING, None)
    if reading is not None:
        reading.cancel()


def _has_content_length(headers: list[tuple[bytes, bytes]]) -> bool:
    """Return whether the (lower-case, as ASGI requires) response headers declare a content-length."""
    for name, _ in headers:
        if name == b"content-length":
            return True
    return False


def _final_headers(protocol: Any, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Return a final response's headers as Hypercorn sends them, plus ``connection: close``
    where the connection will close after the response.

    Hypercorn adds it at the keep-alive request limit. It also closes, without saying so,
    a connection whose request body is still unread when the response ends (h11 cannot
    start the next request; ``_maybe_recycle``): an app that answers before reading the
    body (a refused key, a body too large by its content-length) leaves the body unread
    when it arrives after the head. Said in the response, a keep-alive client opens a new
    connection for its next request instead of sending it into the closing one and
    getting no answer. A request without a body is never in ``SEND_BODY`` here: h11
    gives its end with its head, and Hypercorn reads both before the app runs.
    """
    headers = list(chain(headers, protocol.config.response_headers("h11")))
    if (protocol.keep_alive_requests >= protocol.config.keep_alive_max_requests
            or protocol.connection.their_state is h11.SEND_BODY):
        headers.append((b"connection", b"close"))
    return headers


def _h11_bytes(protocol: Any, event: Any) -> bytes | None:
    """Return the bytes for ``event`` from h11 (None where Hypercorn would drop the write)."""
    try:
        return protocol.connection.send(event)
    except h11.LocalProtocolError:
        if protocol.connection.their_state != h11.ERROR:
            raise
        return None


def _fix_close_race() -> None:
    """Wrap ``TCPServer.protocol_send`` to drop a write that races a close (idempotent)."""
    server_class = tcp_server.TCPServer
    if getattr(server_class.protocol_send, _CLOSE_RACE_MARK, False):
        return
    original = server_class.protocol_send

    async def protocol_send(self: Any, event: Any) -> None:
        try:
            await original(self, event)
        except trio.BusyResourceError:
            if not isinstance(event, RawData):
                raise
            # Another task is closing this connection (send_eof): drop the write and
            # let the protocol see the close, as Hypercorn does for a broken stream.
            await self.protocol.handle(Closed())

    setattr(protocol_send, _CLOSE_RACE_MARK, True)
    server_class.protocol_send = protocol_send  # type: ignore[method-assign]


def _patch_timer_and_writes() -> None:
    """Install :class:`IdleTimer`, the lean read loop, one write per response and the
    on-close hook (idempotent)."""
    H11Protocol = hypercorn_h11.H11Protocol
    if getattr(H11Protocol, _MARK, False):
        return
    server_class = tcp_server.TCPServer
    if not all(hasattr(tcp_server, name) for name in ("TrioSingleTask", "MAX_RECV")) or not all(
        hasattr(server_class, name) for name in ("_initiate_server_close", "_close", "_read_data")
    ):
        log.warning("hypercorn changed: keep-alive timer left as it is (llmgw.router.http.hypercorn_patch)")
    else:
        tcp_server.TrioSingleTask = IdleTimer  # type: ignore[attr-defined,misc]
        original_close = tcp_server.TCPServer._close

        async def _close(self: Any) -> None:
            idle = getattr(self, "idle_task", None)
            if isinstance(idle, IdleTimer):
                idle.detach()
            await original_close(self)
            _stop_reading(self)

        tcp_server.TCPServer._close = _close  # type: ignore[method-assign]
        original_read_data = tcp_server.TCPServer._read_data

        async def _read_data(self: Any) -> None:
            # The client's side is done (EOF, error, read timeout): the connection is going
            # down, so the timer has nothing left to close and must not hold the
            # connection's task group open.
            try:
                if self.config.read_timeout:
                    await original_read_data(self)
                else:
                    await _read_until_closed(self)
            finally:
                idle = getattr(self, "idle_task", None)
                if isinstance(idle, IdleTimer):
                    idle.detach()

        tcp_server.TCPServer._read_data = _read_data  # type: ignore[method-assign]
    original = H11Protocol.stream_send

    async def stream_send(self: Any, event: Any) -> None:
        held: bytes | None = self.__dict__.get(_HELD)
        if held is None:
            if type(event) is Response and event.status_code >= 200:
                data = _h11_bytes(self, h11.Response(headers=_final_headers(self, event.headers),
                                                     status_code=event.status_code))
                if not data:
                    return
                if _has_content_length(event.headers):
                    self.__dict__[_HELD] = data
                else:
                    await self.send(RawData(data=data))  # a stream's head goes out at once
                return
            if type(event) is EndBody:
                data = _h11_bytes(self, h11.EndOfMessage())
                if data:
                    await self.send(RawData(data=data))
                return
            await original(self, event)
            return
        self.__dict__[_HELD] = None
        if type(event) is Body:
            data = _h11_bytes(self, h11.Data(data=event.data))
            await self.send(RawData(data=held + data if data else held))
            return
        if type(event) is EndBody:
            data = _h11_bytes(self, h11.EndOfMessage())
            await self.send(RawData(data=held + data if data else held))
            return
        await self.send(RawData(data=held))  # anything else: the head goes first, as before
        await original(self, event)

    H11Protocol.stream_send = stream_send  # type: ignore[method-assign]

    original_handle = HTTPStream.handle

    async def handle(self: Any, event: Any) -> None:
        await original_handle(self, event)
        if type(event) is StreamClosed:
            scope = getattr(self, "scope", None)
            hook = scope.get("extensions", {}).get(ON_CLOSE_KEY) if scope else None
            if hook is not None:
                hook()

    HTTPStream.handle = handle  # type: ignore[method-assign]
    setattr(H11Protocol, _MARK, True)
