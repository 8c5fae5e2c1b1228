"""Mutual-TLS connections for the RPC port: listen, dial, and say clearly why a connection failed."""

from __future__ import annotations

import functools
import logging
import ssl
from typing import Awaitable, Callable, Sequence

import trio

from llmgw.logthrottle import LogThrottle
from llmgw.rpc.tls import Identity, explain_tls_error, peer_identity

log = logging.getLogger(__name__)
#: Refused, idle and failed connections, per reason and peer host: a scanner or a node with
#: the wrong certificate retrying every second writes one line, then one per interval.
_refusals = LogThrottle(log)

#: A TCP connect on a LAN takes milliseconds; a dead or black-holed address must not stall a failover list.
CONNECT_TIMEOUT = 5.0
#: Two round trips plus certificate checks; a peer that cannot finish in this time is not worth waiting for.
HANDSHAKE_TIMEOUT = 10.0


class ConnectError(ConnectionError):
    """Could not reach or authenticate a peer; the message says why and what to do."""


def split_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` or ``[v6]:port``. Raises ``ValueError`` naming the bad address."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected host:port, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


async def connect(address: str, context: ssl.SSLContext, *, timeout: float = CONNECT_TIMEOUT) -> trio.SSLStream:
    """Dial ``address`` (host:port) and complete the TLS handshake.

    Returns the handshaken stream (the caller closes it). Raises
    :class:`ConnectError` with an operator-facing message when the address cannot be
    reached within ``timeout`` or TLS fails. With TLS 1.3 a server that refuses this
    client's certificate is only noticed on the first read: treat the first call as
    part of connecting.
    """
    host, port = split_address(address)
    try:
        with trio.fail_after(timeout):
            tcp = await trio.open_tcp_stream(host, port)
    except trio.TooSlowError:
        raise ConnectError(f"cannot reach {address}: no answer within {timeout:g}s") from None
    except OSError as exc:
        cause: BaseException = exc
        while isinstance(cause.__cause__, (OSError, BaseExceptionGroup)):
            cause = cause.__cause__
            if isinstance(cause, BaseExceptionGroup):
                cause = cause.exceptions[0]
        cause = cause if isinstance(cause, OSError) else exc
        raise ConnectError(f"cannot reach {address}: {cause.strerror or cause}") from None
    stream = trio.SSLStream(tcp, context, server_hostname=host)
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            await stream.do_handshake()
    except trio.TooSlowError:
        await trio.aclose_forcefully(stream)
        raise ConnectError(f"{address}: TLS handshake did not finish within {HANDSHAKE_TIMEOUT:g}s") from None
    except (trio.BrokenResourceError, ssl.SSLError, OSError) as exc:
        await trio.aclose_forcefully(stream)
        raise ConnectError(explain_tls_error(exc, side="client", peer=address)) from None
    return stream


async def connect_first(addresses: Sequence[str], context: ssl.SSLContext) -> tuple[str, trio.SSLStream]:
    """Dial each of ``addresses`` in turn (:func:`connect`); return the first that answers
    and its handshaken stream (the caller closes it). Raises :class:`ConnectError` with
    every address's reason when none does (or none was given)."""
    errors = []
    for address in addresses:
        try:
            return address, await connect(address, context)
        except ConnectError as exc:
            errors.append(str(exc))
    raise ConnectError("; ".join(errors) or "no control plane address given")


#: Called per accepted connection with its stream and the client's identity (None: the
#: client presented no certificate, which only a context made with ``allow_anonymous`` lets through).
Handler = Callable[[trio.SSLStream, Identity | None], Awaitable[None]]


async def _accept(handler: Handler, context: ssl.SSLContext, tcp: trio.SocketStream) -> None:
    try:
        host, port = tcp.socket.getpeername()[:2]
        peer = f"{host}:{port}"
    except OSError:
        host = peer = "?"
    stream = trio.SSLStream(tcp, context, server_side=True)
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            await stream.do_handshake()
        anonymous = context.verify_mode == ssl.CERT_OPTIONAL and not stream.getpeercert(binary_form=True)
        identity = None if anonymous else peer_identity(stream)
    except trio.TooSlowError:
        _refusals.failure(("idle", host), logging.WARNING,
                          "rpc: %s did not finish the TLS handshake within %gs", peer, HANDSHAKE_TIMEOUT)
        await trio.aclose_forcefully(stream)
        return
    except (trio.BrokenResourceError, ssl.SSLError, OSError) as exc:
        reason = explain_tls_error(exc, side="server", peer=host)  # the same text for each retry
        _refusals.failure(("tls", reason), logging.WARNING, "rpc: refused a connection: %s", reason)
        await trio.aclose_forcefully(stream)
        return
    except PermissionError as exc:
        _refusals.failure(("identity", host, str(exc)), logging.WARNING, "rpc: refused %s: %s", peer, exc)
        await trio.aclose_forcefully(stream)
        return
    try:
        await handler(stream, identity)
    except Exception:  # noqa: BLE001 - one broken connection must not take down the listener
        _refusals.failure(("failed", str(identity)), logging.ERROR,
                          "rpc: connection from %s (%s) failed", peer, identity, exc_info=True)
    finally:
        await trio.aclose_forcefully(stream)


async def listen(
    handler: Handler,
    host: str,
    port: int,
    context: ssl.SSLContext,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept mutual-TLS connections on exactly ``host:port`` until cancelled.

    Each connection runs ``handler(stream, identity)`` in its own task once the
    handshake succeeded and the client certificate named an llmgw identity;
    refused connections are logged with the reason. Signals the bound port as
    started value (``port=0`` picks a free one).
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, functools.partial(_accept, handler, context), listeners)
        task_status.started(bound)
