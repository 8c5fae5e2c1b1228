"""Two per-request costs of Hypercorn 0.18's trio HTTP/1.1 server, removed without changing a byte on the wire.

Profiled on the gateway (py-spy, non-streaming requests on keep-alive connections), about a
sixth of the gateway's CPU per request went to two pieces of Hypercorn bookkeeping:

* **The keep-alive idle timer.** ``TCPServer`` arms it with ``TrioSingleTask.restart``
  after every response (a lock, a cancelled task, a fresh task started with
  ``nursery.start``) and disarms it with ``stop`` when the next request arrives (the lock
  again, a cancel). :class:`IdleTimer` replaces it, per connection, with one task that
  lives as long as the connection and whose cancel-scope deadline is moved: arming and
  disarming are two attribute writes (``TCPServer._close`` ends the task). The behaviour is Hypercorn's: an idle connection is closed
  ``keep_alive_timeout`` seconds after its last response; when the worker is terminating,
  an idle connection is closed at once and a busy one as soon as it becomes idle.
* **Two writes per response.** ``H11Protocol`` writes the response head, then the body,
  then (for a ``content-length`` body) an empty end-of-message, each through the
  connection's send lock, a shielded cancel scope and a ``send`` syscall. For a response
  that declares its ``content-length`` (whose body therefore follows at once: every
  non-streaming answer of the gateway), :func:`_stream_send` holds the head's bytes and
  writes them with the first body bytes, or with the end of the message if there is no
  body, and skips the empty write. Responses without ``content-length`` (event streams,
  chunked) are written exactly as before, head first, so a stream's head is never held
  back waiting for the first token.

:func:`install` patches Hypercorn's classes (idempotent); importing
:mod:`llmgw.router.app` installs it, as it installs :mod:`llmgw.router.hypercorn_fix`.
It checks that Hypercorn still has the attributes it relies on and leaves Hypercorn
untouched (logging why) if not.
"""

from __future__ import annotations

import logging
import math
from itertools import chain
from typing import Any

import h11
import trio
from hypercorn.events import RawData
from hypercorn.protocol import h11 as hypercorn_h11
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.trio import tcp_server

log = logging.getLogger(__name__)

_MARK = "_llmgw_fast_installed"

# Attribute on an H11Protocol holding a response head not yet written (None: none held).
_HELD = "_llmgw_held_head"


class IdleTimer:
    """Drop-in for ``TrioSingleTask`` as ``TCPServer.idle_task``: one task per connection.

    ``restart(task_group, server._idle_timeout)`` arms the timer (the first call starts
    the watching task in the connection's task group), ``stop()`` disarms it, and
    :meth:`detach` (called when the connection closes) ends the watching task. When the
    deadline passes while armed, or the worker terminates while the connection is idle
    (or later, once it becomes idle), the connection is closed as Hypercorn's
    ``_idle_timeout`` does. Cancellation of the connection's task group ends the task.
    """

    __slots__ = ("_server", "_scope", "_idle", "_closed", "_became_idle")

    def __init__(self) -> None:
        self._server: Any = None
        self._scope: trio.CancelScope | None = None
        self._idle = False
        self._closed = False
        self._became_idle: trio.Event | None = None

    async def restart(self, task_group: Any, action: Any) -> None:
        """Arm the timer: the connection closes ``keep_alive_timeout`` seconds from now unless stopped."""
        if self._closed:
            return
        server = self._server
        if server is None:
            server = self._server = action.__self__  # TCPServer._idle_timeout, bound
            await task_group._nursery.start(self._watch)
        self._idle = True
        if self._scope is not None:
            self._scope.deadline = trio.current_time() + server.config.keep_alive_timeout
        self._wake()

    async def stop(self) -> None:
        """Disarm the timer (a request is being served)."""
        self._idle = False
        if self._scope is not None:
            self._scope.deadline = math.inf

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
            deadline = trio.current_time() + server.config.keep_alive_timeout if self._idle else math.inf
            scope = self._scope = trio.CancelScope(deadline=deadline)
            with scope:
                if terminated.is_set():
                    await trio.lowlevel.checkpoint()
                else:
                    await terminated.wait()
            self._scope = None
            if self._closed:
                return
            if self._idle:
                break
            if terminated.is_set():
                # Terminating while a request is being served: Hypercorn closes the
                # connection once it is idle again (or it closes by itself).
                woken = self._became_idle = trio.Event()
                await woken.wait()
                if self._closed:
                    return
                break
            # else: a deadline that a new request beat; wait again, disarmed
        with trio.CancelScope(shield=True):
            await server._initiate_server_close()


def _has_content_length(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, _ in headers:
        if name == b"content-length":
            return True
    return False


def _h11_bytes(protocol: Any, event: Any) -> bytes | None:
    """Return the bytes for ``event`` from h11 (None where Hypercorn would drop the write)."""
    try:
        return protocol.connection.send(event)
    except h11.LocalProtocolError:
        if protocol.connection.their_state != h11.ERROR:
            raise
        return None


def install() -> None:
    """Patch Hypercorn's trio TCP server and HTTP/1.1 protocol as the module docstring says (idempotent)."""
    H11Protocol = hypercorn_h11.H11Protocol
    if getattr(H11Protocol, _MARK, False):
        return
    if not hasattr(tcp_server, "TrioSingleTask") or not hasattr(tcp_server.TCPServer, "_initiate_server_close"):
        log.warning("hypercorn changed: keep-alive timer left as it is (llmgw.router.hypercorn_fast)")
    else:
        tcp_server.TrioSingleTask = IdleTimer  # type: ignore[attr-defined,misc]
        original_close = tcp_server.TCPServer._close

        async def _close(self: Any) -> None:
            idle = getattr(self, "idle_task", None)
            if isinstance(idle, IdleTimer):
                idle.detach()
            await original_close(self)

        tcp_server.TCPServer._close = _close  # type: ignore[method-assign]
    original = H11Protocol.stream_send

    async def stream_send(self: Any, event: Any) -> None:
        held: bytes | None = self.__dict__.get(_HELD)
        if held is None:
            if type(event) is Response and event.status_code >= 200 and _has_content_length(event.headers):
                headers = list(chain(event.headers, self.config.response_headers("h11")))
                if self.keep_alive_requests >= self.config.keep_alive_max_requests:
                    headers.append((b"connection", b"close"))
                data = _h11_bytes(self, h11.Response(headers=headers, status_code=event.status_code))
                if data:
                    self.__dict__[_HELD] = data
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
    setattr(H11Protocol, _MARK, True)
