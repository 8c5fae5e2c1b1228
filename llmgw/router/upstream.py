"""The gateway's HTTP client towards engine replicas.

One pooled ``httpx.AsyncClient`` (trio-compatible through httpcore) for all replicas:
keep-alive connections are reused across requests, every phase has a deadline, and the
client is closed when the gateway app shuts down. Requests go out with
``Accept-Encoding: identity`` so the bytes the engine sends are exactly the bytes the
gateway relays (no re-compression, no buffering inside a decoder).
"""

from __future__ import annotations

import logging
from typing import Mapping

import attrs
import httpx
import trio

from .replicas import Replica

log = logging.getLogger(__name__)

# Seconds to establish a TCP connection to a replica. Replicas sit on the same network
# as the gateway: a healthy one accepts in milliseconds, so waiting longer only delays
# the retry on another replica.
CONNECT_TIMEOUT_S = 5.0

# Seconds allowed between two reads from a replica. A non-streaming completion sends
# nothing until it is finished, which on a slow CPU replica with a long max_tokens can
# take minutes; a streaming one sends a chunk per token. 600 s covers the former.
READ_TIMEOUT_S = 600.0

# Seconds to write the request body (prompts are at most a few MB over a LAN).
WRITE_TIMEOUT_S = 30.0

# Seconds to wait for a free pooled connection. The pool is unbounded (see below), so
# this only bites if the client is being closed.
POOL_TIMEOUT_S = 30.0

# Idle keep-alive connections are dropped after this many seconds: just under the 5 s
# keep-alive of uvicorn (vLLM, SGLang), so the gateway never reuses a connection the
# engine is about to close.
KEEPALIVE_EXPIRY_S = 4.0

# Idle connections kept per client in total. Concurrency itself is not capped here
# (admission control does that before routing): a pool cap would silently queue
# requests behind each other across unrelated replicas.
MAX_KEEPALIVE_CONNECTIONS = 256

# Seconds allowed to close an upstream response during cleanup (shielded from the
# cancellation that usually triggered the cleanup).
CLOSE_TIMEOUT_S = 5.0

# Request headers copied from the client to the replica. Authorization is not: the
# client's key is a gateway key, not the engine's.
FORWARDED_REQUEST_HEADERS = ("content-type", "accept", "user-agent")


@attrs.frozen
class UpstreamTimeouts:
    """Deadlines, in seconds, for talking to replicas (see the module constants)."""

    connect: float = CONNECT_TIMEOUT_S
    read: float = READ_TIMEOUT_S
    write: float = WRITE_TIMEOUT_S
    pool: float = POOL_TIMEOUT_S

    def to_httpx(self) -> httpx.Timeout:
        """Return these deadlines as an ``httpx.Timeout``."""
        return httpx.Timeout(connect=self.connect, read=self.read, write=self.write, pool=self.pool)


class UpstreamConnectError(Exception):
    """The request never reached ``replica`` (connection refused, unreachable, timed out).

    Safe to retry on another replica: the engine did not see the request.
    """

    def __init__(self, replica: Replica, cause: Exception) -> None:
        super().__init__(f"could not connect to replica {replica.id} at {replica.endpoint}: {cause!r}")
        self.replica = replica
        self.cause = cause


class UpstreamClient:
    """Sends requests to replicas over one pooled ``httpx.AsyncClient``.

    Create it inside a trio run (the app does so when serving starts) and close it with
    :meth:`aclose`.
    """

    def __init__(self, timeouts: UpstreamTimeouts = UpstreamTimeouts()) -> None:
        self.timeouts = timeouts
        self._client = httpx.AsyncClient(
            timeout=timeouts.to_httpx(),
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=MAX_KEEPALIVE_CONNECTIONS,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
            follow_redirects=False,
            trust_env=False,  # an operator's HTTP(S)_PROXY must not capture LAN traffic to engines
        )

    async def open(
        self,
        replica: Replica,
        method: str,
        path: str,
        *,
        query: bytes = b"",
        headers: Mapping[str, str],
        body: bytes,
        request_id: str,
    ) -> httpx.Response:
        """Send one request to ``replica`` and return once the response head has arrived.

        ``path`` starts with ``/`` (e.g. ``/v1/chat/completions``) and is appended to the
        replica's endpoint; only :data:`FORWARDED_REQUEST_HEADERS` of ``headers`` are sent,
        plus ``x-request-id``. ``body`` is sent byte for byte.

        Returns a response whose body has not been read: the caller must read or
        iterate it and then ``await response.aclose()`` (see :func:`close_quietly`).

        Raises :class:`UpstreamConnectError` when the connection could not be made
        (retryable), ``httpx.TimeoutException`` when the replica went silent past a
        deadline, and other ``httpx.HTTPError`` when the exchange broke. Cancellation
        closes the half-open connection and propagates.
        """
        url = replica.endpoint.rstrip("/") + path
        if query:
            url += "?" + query.decode("latin-1")
        out_headers = {name: headers[name] for name in FORWARDED_REQUEST_HEADERS if name in headers}
        out_headers["x-request-id"] = request_id
        out_headers["accept-encoding"] = "identity"
        request = self._client.build_request(method, url, headers=out_headers, content=body)
        try:
            return await self._client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as error:
            raise UpstreamConnectError(replica, error) from error

    async def aclose(self) -> None:
        """Close every pooled connection; the client cannot be used afterwards."""
        await self._client.aclose()


async def close_quietly(response: httpx.Response) -> None:
    """Close ``response`` (returning or dropping its connection), even while cancelled.

    Shielded and bounded by :data:`CLOSE_TIMEOUT_S`; errors while closing are logged,
    not raised, because this runs during cleanup of a request that already failed or
    finished.
    """
    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
        try:
            await response.aclose()
        except Exception:  # closing a broken connection can fail in many ways; none matter
            log.debug("error while closing upstream response", exc_info=True)
