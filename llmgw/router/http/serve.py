"""Run the gateway app under Hypercorn's trio server, as a task in the caller's nursery.

The gateway binds its listening socket itself and hands it to Hypercorn
(``hypercorn.trio.run.worker_serve(..., sockets=...)``, the entry point Hypercorn's own
trio worker uses). That way a bind failure is a plain ``OSError`` raised before anything
starts, the bound port is read from the socket (port 0 works), and the socket has
exactly one owner, which closes it on the way out. Hypercorn is patched for the gateway
(:func:`~llmgw.router.http.hypercorn_patch.apply`) when serving starts, not before.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any, Callable
from wsgiref.handlers import format_date_time

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app
from quart import Quart

from . import hypercorn_patch

log = logging.getLogger(__name__)

# Seconds open connections get to finish (e.g. a stream in progress) once shutdown
# starts, unless the caller says otherwise (the server passes ``gateway.shutdown_grace``).
# Short, because an LLM stream could otherwise hold shutdown for minutes; clients of a
# stopped gateway retry elsewhere.
GRACEFUL_SHUTDOWN_S = 3.0

# Seconds streams that were cut when the grace ran out get to write their last SSE event
# and end, before Hypercorn cancels the connections still open. Writing one event to a
# client socket takes microseconds; this only covers a client that reads slowly.
CUT_SLACK_S = 2.0

# Seconds on top of the graceful period for the app's own shutdown (closing the
# upstream client). Past it the server task is cancelled outright.
SHUTDOWN_SLACK_S = 5.0

# Seconds an idle client keep-alive connection is kept open.
KEEP_ALIVE_S = 5.0

# Pending connections the kernel queues before the server accepts them; bursts of
# clients opening connections at once are normal for an inference endpoint.
LISTEN_BACKLOG = 1024


class _GatewayConfig(Config):
    """Hypercorn's Config, formatting the ``date`` response header once per second
    instead of once per response (the header has one-second resolution anyway)."""

    _date_second = -1
    _date_headers: list[tuple[bytes, bytes]] = []

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        """Returns the server's response headers: the same list for a whole second (the
        HTTP/1.1 lane formats its lines once for it), which callers must not change."""
        if not self.include_date_header or self.include_server_header or self.alt_svc_headers \
                or self._quic_addresses:
            return super().response_headers(protocol)
        now = int(time.time())
        if now != self._date_second:
            self._date_headers = [(b"date", format_date_time(now).encode("ascii"))]
            self._date_second = now
        return self._date_headers


def _config(graceful_timeout: float) -> Config:
    config = _GatewayConfig()
    config.graceful_timeout = graceful_timeout + CUT_SLACK_S  # Hypercorn cancels what is left then
    config.keep_alive_timeout = KEEP_ALIVE_S
    config.backlog = LISTEN_BACKLOG
    config.accesslog = None
    config.errorlog = logging.getLogger("llmgw.router.hypercorn")
    config.include_server_header = False
    return config


async def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """Return a non-blocking TCP socket bound to ``host``:``port`` and listening.

    With ``reuse_port`` the socket sets SO_REUSEPORT, so several gateway processes can
    listen on the same port and the kernel spreads new connections over them.

    Raises ``OSError`` with the address in the message if it cannot be bound.
    """
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    if not infos:
        raise OSError(f"cannot resolve gateway address {host!r}")
    family, type_, proto, _, address = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # SSE chunks go out at once
        try:
            sock.bind(address)
        except OSError as error:
            raise OSError(
                error.errno, f"cannot bind the gateway to {host}:{port}: {error.strerror} "
                "(is another server using this port? choose another in server.yaml)"
            ) from error
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_gateway(
    app: Any,
    host: str,
    port: int,
    *,
    graceful_timeout: float = GRACEFUL_SHUTDOWN_S,
    on_grace_over: Callable[[], object] | None = None,
    reuse_port: bool = False,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` (an ASGI app, normally from :func:`~llmgw.router.app.create_app`) on host:port.

    Binds exactly ``host``:``port`` (``port`` 0 picks a free port) and reports the bound
    port with ``task_status.started(port)`` once the socket is listening and the app's
    startup hooks have run; use it as ``port = await nursery.start(serve_gateway, app,
    host, 0)``. Runs until cancelled.

    Cancellation shuts down cleanly: no new connections are accepted, idle keep-alive
    connections are closed, open requests get ``graceful_timeout`` seconds to finish;
    then ``on_grace_over()`` is called (the gateway cuts its streams there:
    :meth:`~llmgw.router.http.drain.StreamCuts.cut_all`), and what is still open
    :data:`CUT_SLACK_S` later is cancelled. The app's shutdown hooks run (closing the
    upstream client), and the listening socket is closed before this returns. That
    shutdown is shielded from the cancellation and bounded by ``graceful_timeout +``
    :data:`CUT_SLACK_S` ``+`` :data:`SHUTDOWN_SLACK_S`; it returns as soon as the open
    requests are done.

    Raises ``OSError`` (before ``started``) if the address cannot be bound, e.g. the
    port is in use, and :class:`~llmgw.router.http.hypercorn_patch.HypercornUnchecked`
    (before binding) on a Hypercorn release the gateway's patches were not checked
    against. ``reuse_port`` lets other processes bind the same port with
    ``reuse_port`` too (one gateway per core; each has its own routing state).
    """
    hypercorn_patch.apply()
    config = _config(graceful_timeout)
    # A Quart app's __call__ only awaits its asgi_app (where the gateway's middlewares
    # sit): served directly, every request skips that frame.
    asgi = app.asgi_app if isinstance(app, Quart) else app
    sock = await _bind(host, port, reuse_port)
    bound_port: int = sock.getsockname()[1]
    shutdown = trio.Event()
    server_scope = trio.CancelScope(shield=True)
    grace_scope = trio.CancelScope(shield=True)

    async def run_server(*, task_status: trio.TaskStatus[list[str]]) -> None:
        # Shielded: the caller's cancellation reaches the server as `shutdown` instead,
        # so Hypercorn runs its graceful shutdown and the app's lifespan shutdown.
        with server_scope:
            try:
                await worker_serve(
                    wrap_app(asgi, config.wsgi_max_body_size, "asgi"),
                    config,
                    sockets=Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[]),
                    shutdown_trigger=shutdown.wait,
                    task_status=task_status,
                )
            finally:
                grace_scope.cancel()  # every request done: no grace left to watch

    async def end_of_grace() -> None:
        # Shielded like the server: runs from shutdown until the server has stopped.
        with grace_scope:
            await shutdown.wait()
            await trio.sleep(graceful_timeout)
            log.info("gateway shutdown grace (%gs) over: ending the streams still open", graceful_timeout)
            if on_grace_over is not None:
                on_grace_over()

    with sock:
        async with trio.open_nursery() as nursery:
            try:
                nursery.start_soon(end_of_grace)
                await nursery.start(run_server)
                log.info("gateway listening on %s:%d", host, bound_port)
                task_status.started(bound_port)
                await trio.sleep_forever()
            finally:
                shutdown.set()
                server_scope.deadline = trio.current_time() + graceful_timeout + CUT_SLACK_S + SHUTDOWN_SLACK_S
