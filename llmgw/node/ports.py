"""TCP ports for engines: a fresh free one, and whether a given one is still free.

A shard keeps its port across engine restarts and agents (the control plane routes to
it). Before an engine is started on that port again, :func:`port_is_free` bind-tests
it: a stranger listening there (an orphaned engine, another program) would otherwise
answer the new engine's health checks while the engine itself fails to bind.
"""

from __future__ import annotations

import errno
import socket

__all__ = ["free_port", "port_is_free"]

# Attempts at drawing a port outside the ones given to other shards before giving up.
FREE_PORT_ATTEMPTS = 20


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str, avoid: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """Returns a TCP port that is free on ``host`` right now (bind to port 0, read, close).

    Ports in ``avoid`` (already given to other shards) are skipped. Raises OSError if
    ``host`` is not an address of this machine, or if no port outside ``avoid`` came up.
    """
    for _ in range(FREE_PORT_ATTEMPTS):
        with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port
    raise OSError(f"no free TCP port found on {host} outside the {len(avoid)} ports already in use by shards")


def port_is_free(host: str, port: int) -> bool:
    """Returns True if a server could listen on ``host:port`` now, False if it is taken.

    Binds with SO_REUSEADDR, as engines' HTTP servers do: a port whose last connections
    linger in TIME_WAIT counts as free, one with a listener (on this address or on the
    wildcard) as taken. Raises OSError for other failures (``host`` not of this machine).
    """
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True
