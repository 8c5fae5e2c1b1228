"""The gateway's HTTP client towards engine replicas.

One pooled ``httpx.AsyncClient`` (trio-compatible through httpcore) for all replicas:
keep-alive connections are reused across requests, every phase has a deadline, and the
client is closed when the gateway app shuts down. Requests go out with
``Accept-Encoding: identity`` so the bytes the engine sends are exactly the bytes the
gateway relays (no re-compression, no buffering inside a decoder).

Deadlines (:class:`UpstreamTimeouts`, each a module constant below, overridable in
``server.yaml`` under ``gateway:``): connect; first byte (the response head, and then
the first body chunk, each within it); the gap between body chunks. A deadline raises
:class:`UpstreamDeadline` (an ``httpx.TimeoutException``) naming the phase, so the
caller answers 504 before the first byte and ends a stream with an error event after it;
a connect failure raises :class:`UpstreamConnectError` (retryable on another replica).
Each failure is counted in the gateway's metrics (``upstream_error(replica, kind)``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping, NoReturn

import attrs
import httpx
import trio

from llmgw.config.defaults import (
    DEFAULT_UPSTREAM_CHUNK_TIMEOUT, DEFAULT_UPSTREAM_CONNECT_TIMEOUT, DEFAULT_UPSTREAM_FIRST_BYTE_TIMEOUT,
)

from ..replicas import Replica
from .drain import CUT, DEADLINE, NOT_READING, StreamCut, StreamCuts
from .upstream_pool import H1Pool, H1Response, HeadWait

if TYPE_CHECKING:
    from ..metrics import GatewayMetrics
    from .relayhub import RelayHub

log = logging.getLogger(__name__)

# The connect, first-byte and chunk deadlines are server.yaml's ``gateway:`` section; their
# defaults and reasons are in llmgw.config.defaults.

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

# Seconds added to httpx's own per-read timeout on top of the longer of the first-byte
# and chunk deadlines, so the gateway's deadlines (which name the phase) fire first;
# httpx's only backs them up.
READ_BACKSTOP_SLACK_S = 5.0

# Request headers copied from the client to the replica. Authorization is not: the
# client's key is a gateway key, not the engine's (the engine's own secret goes instead). W3C trace context passes through
# (engines join the client's trace); with tracing on the gateway's own span replaces it.
FORWARDED_REQUEST_HEADERS = ("content-type", "accept", "user-agent", "traceparent", "tracestate")


# Headers of the gateway's own JSON calls to engines (UpstreamClient.call).
_JSON_HEADERS = {"content-type": "application/json"}


@attrs.frozen
class UpstreamTimeouts:
    """Deadlines, in seconds, for talking to replicas (see the module constants).

    ``first_byte`` bounds the wait for the response head and then for the first body
    chunk; ``chunk`` bounds each later gap between body chunks.
    """

    connect: float = DEFAULT_UPSTREAM_CONNECT_TIMEOUT
    first_byte: float = DEFAULT_UPSTREAM_FIRST_BYTE_TIMEOUT
    chunk: float = DEFAULT_UPSTREAM_CHUNK_TIMEOUT
    write: float = WRITE_TIMEOUT_S
    pool: float = POOL_TIMEOUT_S

    def to_httpx(self) -> httpx.Timeout:
        """Return these deadlines as an ``httpx.Timeout`` (its read timeout is only a backstop)."""
        read = max(self.first_byte, self.chunk) + READ_BACKSTOP_SLACK_S
        return httpx.Timeout(connect=self.connect, read=read, write=self.write, pool=self.pool)


class UpstreamDeadline(httpx.TimeoutException):
    """``replica`` stayed silent past the ``phase`` deadline (``seconds``).

    ``phase`` is ``"first_byte"`` (no response head), ``"first_chunk"`` (head but no
    body) or ``"chunk"`` (a gap between body chunks). A subclass of
    ``httpx.TimeoutException`` so code handling httpx timeouts handles it too.
    """

    _WHAT = {
        "first_byte": ("sent no response", "gateway.first_byte_timeout"),
        "first_chunk": ("sent no body after the response head", "gateway.first_byte_timeout"),
        "chunk": ("went silent in the middle of the response", "gateway.chunk_timeout"),
    }

    def __init__(self, replica_id: str, phase: str, seconds: float) -> None:
        what, key = self._WHAT[phase]
        super().__init__(f"replica {replica_id} {what} within {seconds:g}s (the {key} deadline in server.yaml)")
        self.replica_id = replica_id
        self.phase = phase
        self.seconds = seconds


class UpstreamConnectError(Exception):
    """The request never reached ``replica`` (connection refused, unreachable, timed out).

    Safe to retry on another replica: the engine did not see the request.
    """

    def __init__(self, replica: Replica, cause: Exception) -> None:
        super().__init__(f"could not connect to replica {replica.id} at {replica.endpoint}: {cause!r}")
        self.replica = replica
        self.cause = cause


class UpstreamClient:
    """Sends requests to replicas over keep-alive connections pooled per replica.

    The transport is :class:`~llmgw.router.http.upstream_pool.H1Pool` (a lean HTTP/1.1 client: one
    write per request, no per-request header models); its errors are ``httpx`` types.

    ``watch``: the gateway's relayed streams (:class:`~llmgw.router.http.drain.StreamCuts`);
    while their watch task runs, it also keeps the first-byte deadlines of :meth:`open`.
    Create it inside a trio run (the app does so when serving starts) and close it with
    :meth:`aclose`.
    """

    def __init__(
        self, timeouts: UpstreamTimeouts = UpstreamTimeouts(), *, metrics: GatewayMetrics | None = None,
        watch: StreamCuts | None = None,
    ) -> None:
        self.timeouts = timeouts
        self._metrics = metrics
        self._watch = watch  # keeps the first-byte deadlines while its watch task runs
        # No proxy settings from the environment: an operator's HTTP(S)_PROXY must not
        # capture LAN traffic to engines. No redirects are followed.
        self._pool = H1Pool(
            connect_timeout=timeouts.connect,
            write_timeout=timeouts.write,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
            max_idle_per_replica=MAX_KEEPALIVE_CONNECTIONS,
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
        extra_headers: Mapping[str, str] | None = None,
    ) -> H1Response:
        """Send one request to ``replica`` and return once the response head has arrived.

        ``path`` starts with ``/`` (e.g. ``/v1/chat/completions``) and is appended to the
        replica's endpoint; only :data:`FORWARDED_REQUEST_HEADERS` of ``headers`` are sent,
        plus ``x-request-id``, ``extra_headers`` (e.g. the gateway's ``traceparent``,
        replacing the client's) and, when the replica has a secret, ``Authorization: Bearer``
        with it. ``body`` is sent byte for byte.

        Returns a response whose body has not been read: the caller must read it with
        :meth:`read_body` or :meth:`body_reader` (which apply the body deadlines) and then
        ``await response.aclose()`` (see :func:`close_quietly`).

        Raises :class:`UpstreamConnectError` when the connection could not be made
        (retryable), :class:`UpstreamDeadline` when no response head came within the
        first-byte deadline, other ``httpx.TimeoutException`` (write) and
        ``httpx.HTTPError`` when the exchange broke. Cancellation closes the half-open
        connection and propagates.
        """
        target = path + "?" + query.decode("latin-1") if query else path
        out_headers = {name: value for name in FORWARDED_REQUEST_HEADERS if (value := headers.get(name)) is not None}
        out_headers["x-request-id"] = request_id
        out_headers["accept-encoding"] = "identity"
        if extra_headers:
            out_headers.update(extra_headers)
        if replica.api_key:  # the engine's own secret; the client's key never reaches the engine
            out_headers["authorization"] = f"Bearer {replica.api_key}"
        response: H1Response | None = None
        watch = self._watch
        # Under the first-byte deadline: kept by the streams' watch task while it runs (a
        # cancel scope per request was measurable), else by a scope of its own.
        watched = None
        try:
            if watch is not None and watch.watching:
                head = HeadWait()
                watched = watch.open(head.abort, cut=False)
                watched.deadline = trio.current_time() + self.timeouts.first_byte
                try:
                    response = await self._pool.request(replica.endpoint, method, target, out_headers.items(), body,
                                                        head)
                finally:
                    watch.close(watched)
            else:
                with trio.move_on_after(self.timeouts.first_byte):
                    response = await self._pool.request(replica.endpoint, method, target, out_headers.items(), body)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as error:
            self._count(replica.id, "connect")
            raise UpstreamConnectError(replica, error) from error
        except httpx.HTTPError:
            if watched is None or watched.ended is None:
                self._count(replica.id, "protocol")
                raise
        if response is None:
            self._count(replica.id, "first_byte_timeout")
            raise UpstreamDeadline(replica.id, "first_byte", self.timeouts.first_byte)
        if response.status_code >= 500:
            self._count(replica.id, "status_5xx")
        return response

    def body_reader(self, response: H1Response, replica_id: str, cuts: StreamCuts | None = None) -> BodyReader:
        """Return a :class:`BodyReader` over the body of ``response`` (from :meth:`open`),
        under the body deadlines; the caller must :meth:`~BodyReader.close` it, then close
        ``response``.

        ``cuts`` are the gateway's relayed streams (:mod:`~llmgw.router.http.drain`):
        while their watch task runs, the deadlines are kept by it (no cancel scope per
        piece), else each read gets a deadline scope, listed in ``cuts.reading`` while it
        waits.
        """
        return BodyReader(response, replica_id, self.timeouts, cuts, self._count)

    async def read_body(self, response: H1Response, replica_id: str) -> bytes:
        """Return the whole body of ``response``, read by :meth:`body_reader`.

        Raises as :meth:`BodyReader.next` does; does not close ``response``.
        """
        whole = response.take_complete()  # already here with the head: no deadlines to apply
        if whole is not None:
            return whole
        parts = []
        reader = self.body_reader(response, replica_id)
        try:
            while piece := await reader.next():
                parts.append(piece)
        finally:
            reader.close()
        return b"".join(parts)

    async def call(self, replica: Replica, method: str, path: str, body: bytes, request_id: str) -> tuple[int, bytes]:
        """Send a JSON ``body`` to ``path`` on ``replica``; return (status, whole response body).

        For the gateway's own calls to an engine (``/tokenize``, loading adapters). Opens,
        reads and closes the response under the deadlines of :meth:`open` and
        :meth:`read_body`; raises as they do.
        """
        response = await self.open(replica, method, path, headers=_JSON_HEADERS, body=body, request_id=request_id)
        try:
            return response.status_code, await self.read_body(response, replica.id)
        finally:
            await close_quietly(response)

    def _count(self, replica_id: str, kind: str) -> None:
        if self._metrics is not None:
            self._metrics.upstream_error(replica_id, kind)

    async def aclose(self) -> None:
        """Close every pooled connection; the client cannot be used afterwards."""
        await self._pool.aclose()


class BodyReader:
    """Reads one response's body piece by piece under the upstream deadlines
    (:meth:`UpstreamClient.body_reader` makes it).

    The first piece must come within the first-byte deadline of the head, each later one
    within the chunk deadline of the previous one. :meth:`close` when done (it stops the
    watch of the stream's reads); it does not close the response.
    """

    __slots__ = ("_response", "_replica_id", "_timeouts", "_cuts", "_count", "_watched", "_phase", "_limit",
                 "_hub", "_hub_fd", "_forward", "_pending", "_error", "_last")

    def __init__(self, response: H1Response, replica_id: str, timeouts: UpstreamTimeouts, cuts: StreamCuts | None,
                 count: Callable[[str, str], None]) -> None:
        self._response = response
        self._replica_id = replica_id
        self._timeouts = timeouts
        self._cuts = cuts
        self._count = count
        self._watched = cuts.open(self._abort) if cuts is not None and cuts.watching else None
        self._phase, self._limit = "first_chunk", timeouts.first_byte
        # While the body is in a relay hub (:meth:`via_hub`): the hub, the socket it watches,
        # what each piece goes to, and what the hub handed back.
        self._hub: RelayHub | None = None
        self._hub_fd = -1
        self._forward: Callable[[bytes], Awaitable[None] | None] | None = None
        self._pending: Awaitable[None] | None = None
        self._error: httpx.HTTPError | None = None
        # The body's last piece as the hub read it, not forwarded: :meth:`next` returns it.
        self._last = b""

    @property
    def ended(self) -> bool:
        """Whether the body has been read to its end: the piece :meth:`next` returned last
        was its last (b"" or not)."""
        return self._response.ended

    def has_buffered(self) -> bool:
        """Return whether bytes of the body were read with what came before them (the head):
        :meth:`next` then does not wait for the socket unless they are only part of a chunk."""
        return self._response.has_buffered()

    async def next(self) -> bytes:
        """Return the body's next piece; b"" once the body has ended.

        Raises :class:`UpstreamDeadline` when the piece did not come within its deadline,
        :class:`~llmgw.router.http.drain.StreamCut` once ``cuts.cut_all()`` was called,
        ``httpx.HTTPError`` when the exchange broke (each counted in the gateway's
        metrics). Cancellation propagates.
        """
        last = self._last
        if last:
            self._last = b""
            return last
        cuts = self._cuts
        if cuts is not None and cuts.cut:
            raise StreamCut
        limit = self._limit
        watched = self._watched
        ended: str | None = None  # why the read was ended: CUT, DEADLINE or not at all
        if watched is not None:
            if watched.ended is not None:  # the watch closed the connection between two reads
                self._failed(httpx.ReadError(f"the gateway closed the connection to replica {self._replica_id}"))
            watched.deadline = trio.current_time() + limit
            try:
                piece = await self._response.next_piece()
            except httpx.HTTPError as error:
                self._failed(error)
            # Not reading while the piece goes to the client: a slow client is not a
            # silent replica.
            watched.deadline = NOT_READING
        else:
            scope = trio.CancelScope(deadline=trio.current_time() + limit)
            reading = cuts.reading if cuts is not None else None
            if reading is not None:
                reading.add(scope)
            try:
                with scope:
                    piece = await self._response.next_piece()
            except httpx.HTTPError:
                self._count(self._replica_id, "protocol")
                raise
            finally:
                if reading is not None:
                    reading.discard(scope)
            if scope.cancelled_caught:
                ended = CUT if cuts is not None and cuts.cut else DEADLINE
        if ended is not None:
            self._raise_ended(ended)
        if self._phase == "first_chunk":
            self._phase, self._limit = "chunk", self._timeouts.chunk
        return piece

    def _failed(self, error: httpx.HTTPError) -> NoReturn:
        """Raise for a watched read that failed with ``error``: StreamCut or
        :class:`UpstreamDeadline` if the watch ended it (it closed the connection under the
        read), else ``error`` itself, counted."""
        watched = self._watched
        if watched is None or watched.ended is None:
            self._count(self._replica_id, "protocol")
            raise error
        watched.deadline = NOT_READING
        self._raise_ended(watched.ended)

    def _raise_ended(self, why: str) -> NoReturn:
        """Raise for a read the gateway ended (``why``: CUT or DEADLINE), counting a deadline."""
        if why == CUT:
            raise StreamCut
        self._count(self._replica_id, f"{self._phase}_timeout")
        raise UpstreamDeadline(self._replica_id, self._phase, self._limit)

    async def via_hub(self, hub: RelayHub, forward: Callable[[bytes], Awaitable[None] | None]) -> None:
        """Relay the body's next pieces to ``forward`` in ``hub`` while they need no waiting,
        all but its last.

        For a body past its first piece whose deadlines the watch keeps, on a plain socket
        with nothing buffered; otherwise (and when the hub is not running) returns at once.
        Returns when the hub hands the body back: it ended (:meth:`next` then returns its
        last piece, not forwarded, for its owner to send with the response's end in one
        write; then b""), the watch ended it, or a read failed (raised here as :meth:`next`
        raises it).
        ``forward(piece)`` runs in the hub's task and returns None once the piece is sent,
        else an awaitable for the rest of it, which is awaited here before returning.
        Cancellation takes the body back from the hub and propagates.
        """
        watched = self._watched
        fd = self._response.socket_fd()
        if watched is None or fd is None or self._phase == "first_chunk" or not hub.running:
            return
        self._hub, self._hub_fd, self._forward = hub, fd, forward
        watched.deadline = trio.current_time() + self._limit
        try:
            await hub.relay(fd, self._step)
        finally:  # on cancellation, close() drops a write the hub handed back
            self._hub = self._forward = None  # (the relay holds this reader: no cycle left)
            if watched.ended is None:
                watched.deadline = NOT_READING
        error, self._error = self._error, None
        if error is not None:
            self._failed(error)
        pending, self._pending = self._pending, None
        if pending is not None:
            await pending

    def _step(self, now: float) -> bool:
        """The hub's step (:data:`~llmgw.router.http.relayhub.Step`): relay what the socket holds."""
        try:
            piece = self._response.piece_nowait()
        except httpx.HTTPError as error:
            self._error = error
            return False
        if piece is None:
            return True
        self._watched.deadline = now + self._limit  # type: ignore[union-attr]
        ended = self._response.ended
        if piece:
            if ended:  # the last piece: handed back with the body
                self._last = piece
                return False
            pending = self._forward(piece)  # type: ignore[misc]
            if pending is not None:  # the client has no room: the owner awaits the rest
                self._pending = pending
                return False
        return not ended

    def _abort(self) -> None:
        """Close the connection (the watch's abort): taken from the hub first if it is there."""
        hub = self._hub
        if hub is not None:
            hub.detach(self._hub_fd)
        self._response.abort()

    def close(self) -> None:
        """Stop watching this body's reads, and drop a write the hub handed back that was
        never awaited (its owner was cancelled). Idempotent."""
        pending, self._pending = self._pending, None
        close = getattr(pending, "close", None)
        if close is not None:
            close()
        watched = self._watched
        if watched is not None and self._cuts is not None:
            self._watched = None
            self._cuts.close(watched)


def describe_error(error: BaseException) -> str:
    """Return ``error`` as "Type: message" (just "Type" when it has no message) for logs and errors."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def release_or_close(response: H1Response) -> Awaitable[None] | None:
    """Release ``response`` now when that needs no wait (see :meth:`H1Response.release_if_reusable`):
    None; else return :func:`close_quietly` of it, for the caller to await."""
    return None if response.release_if_reusable() else close_quietly(response)


async def close_quietly(response: H1Response) -> None:
    """Close ``response`` (returning or dropping its connection), even while cancelled.

    Shielded and bounded by :data:`CLOSE_TIMEOUT_S`; errors while closing are logged,
    not raised, because this runs during cleanup of a request that already failed or
    finished.
    """
    if response.release_if_reusable():  # the common case: nothing to await, no cancel scopes
        return
    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
        try:
            await response.aclose()
        except Exception:  # closing a broken connection can fail in many ways; none matter
            log.debug("error while closing upstream response", exc_info=True)
