"""A lean HTTP/1.1 client for the gateway's hop to the engines: one keep-alive pool per replica.

Why not httpx on this path: the gateway forwards small JSON requests and relays the
answers, and per request httpx + httpcore cost more CPU than the rest of the hop (event
objects, header models, two socket writes for head and body, a state machine per
connection). This client does only what the hop needs:

* the request head and body leave in one write (one syscall, one TCP segment when small);
* the response head is parsed with ``bytes`` operations; the body is framed by
  ``content-length``, ``transfer-encoding: chunked`` (decoded, so what is yielded is the
  payload the engine wrote) or the end of the connection;
* a connection is returned to its replica's pool only after its response body was read
  to the end on a keep-alive connection; anything else (a cancelled stream, an error)
  closes it, so a pooled connection never holds stale bytes;
* a pooled connection the engine closed while idle is detected on reuse (EOF before any
  response byte) and the request is sent once more on a new connection: the engine did
  not see it. Idle connections expire after ``keepalive_expiry`` seconds.

Errors are raised as ``httpx`` exception types so callers handle both clients alike:
``httpx.ConnectError``/``ConnectTimeout`` (nothing was sent), ``httpx.WriteError``/
``WriteTimeout``, ``httpx.ReadError`` and ``httpx.RemoteProtocolError`` (the exchange
broke). Sockets are trio ``SocketStream``s, which set TCP_NODELAY, so each relayed
chunk leaves at once. Deadlines for the response (first byte, gaps) are the caller's:
wrap calls in ``trio.move_on_after``; cancellation closes the connection and propagates.
"""

from __future__ import annotations

import os
import time
from typing import AsyncIterator, Iterable
from urllib.parse import urlsplit

import httpx
import trio

from . import eagerio

# Bytes asked for per receive; SSE chunks and small JSON answers fit in one.
RECV_BYTES = 65_536

# Largest response head accepted (status line and headers); engines send a few hundred bytes.
MAX_HEAD_BYTES = 64 * 1024

# Largest chunk-size line accepted in a chunked body (hex size plus extensions).
MAX_CHUNK_LINE_BYTES = 4096


class Headers(dict):  # type: ignore[type-arg]
    """Response headers by lower-case name (a repeated header keeps its last value)."""


class H1Response:
    """One response whose head has arrived; read the body with :meth:`aiter_raw` or :meth:`aread`.

    ``status_code`` and ``headers`` are set. :meth:`aclose` must be called when done: it
    returns the connection to the pool if the body was read to the end, else closes it.
    """

    __slots__ = ("status_code", "headers", "_conn", "_pool", "_framing", "_remaining", "_done", "_closed", "_decoder",
                 "_wait_first")

    def __init__(self, status_code: int, headers: Headers, conn: _Conn, pool: H1Pool, framing: str, length: int) -> None:
        self.status_code = status_code
        self.headers = headers
        self._conn = conn
        self._pool = pool
        self._framing = framing  # "length", "chunked", "close" or "none"
        self._remaining = length
        self._done = framing == "none" or (framing == "length" and length == 0)
        self._closed = False
        self._decoder = ChunkedDecoder() if framing == "chunked" else None
        self._wait_first = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """Yield the body's payload bytes as they arrive (chunked framing removed):
        :meth:`next_piece` until the body's end.

        Raises ``httpx.ReadError``/``RemoteProtocolError`` if the connection breaks or the
        framing is invalid. Reading twice yields nothing the second time.
        """
        while piece := await self.next_piece():
            yield piece

    async def next_piece(self) -> bytes:
        """Return the body's next payload bytes as they arrive (chunked framing removed); b""
        once the body has ended (and on every call after).

        One coroutine per piece, no generator in between: a relayed stream calls it once per
        event, and each layer of async iteration costs microseconds there. Raises
        ``httpx.ReadError`` if the connection breaks and ``httpx.RemoteProtocolError`` for
        invalid framing or an end before the body's. Cancellation leaves the response
        half-read (``aclose`` then closes its connection).
        """
        if self._done or self._closed:
            return b""
        conn = self._conn
        if self._decoder is not None:
            data = conn.take_all()
            while True:
                if data:
                    piece = self._decode(data)
                    if piece or self._done:
                        return piece
                # A streamed body's next piece is an engine's next token: rarely there yet
                # when the last one has just been relayed, so the read waits for it first (a
                # read that finds nothing is a syscall and an exception per event); after a
                # read that filled its buffer (the engine is ahead), the next reads at once.
                data = await conn.recv(wait_first=self._wait_first)
                self._wait_first = len(data) < RECV_BYTES
        if self._framing == "length":
            remaining = self._remaining
            data = conn.take(remaining) or await conn.recv_body()
            if len(data) > remaining:  # bytes past the body: not ours to relay
                conn.buffer = data[remaining:]
                data = data[:remaining]
            self._remaining = remaining - len(data)
            if self._remaining <= 0:
                self._done = True
            return data
        data = conn.take_all() or await conn.recv(eof_ok=True)  # until the engine closes the connection
        if not data:
            self._done = True
        return data

    @property
    def ended(self) -> bool:
        """Whether the body has been read to its end."""
        return self._done

    def has_buffered(self) -> bool:
        """Return whether body bytes already read (with the head) wait in the connection's buffer."""
        return bool(self._conn.buffer) and not self._closed

    def socket_fd(self) -> int | None:
        """Return the descriptor of a chunked body's plain TCP socket with nothing buffered
        (the case :meth:`piece_nowait` serves), else None."""
        conn = self._conn
        if self._decoder is None or self._done or self._closed or conn.buffer:
            return None
        if type(conn.stream) is not trio.SocketStream:
            return None
        return conn.stream.socket.fileno()

    def piece_nowait(self) -> bytes | None:
        """Return the payload of what a chunked body's socket holds now (maybe b"": part of
        a chunk), without waiting; None if it holds nothing. Check :attr:`ended` after.

        Only for a response :meth:`socket_fd` gives a descriptor for. Raises as
        :meth:`next_piece` does.
        """
        # The socket read itself, without eagerio's layers: this runs once per relayed event.
        try:
            data = os.read(self._conn.stream.socket.fileno(), RECV_BYTES)
        except BlockingIOError:
            return None
        except OSError as error:
            raise _broken(error) from error
        if not data:
            raise _ended_early()
        return self._decode(data)

    def _decode(self, data: bytes) -> bytes:
        """Return the payload ``data`` (from the wire) completes; at the body's end, leave what
        follows it in the connection's buffer and mark the body done."""
        decoder = self._decoder
        assert decoder is not None
        piece = decoder.feed(data)
        if decoder.ended:
            self._conn.buffer = decoder.rest
            self._done = True
        return piece

    def take_complete(self) -> bytes | None:
        """Return the whole body if it has already arrived with the head, else None (read it then).

        The common case for short JSON answers: no await, no deadline machinery needed.
        """
        if self._closed:
            return None
        if self._done:
            return b"" if self._framing in ("length", "none") else None
        if self._framing == "length" and len(self._conn.buffer) >= self._remaining:
            data = self._conn.take(self._remaining)
            self._remaining = 0
            self._done = True
            return data
        return None

    async def aread(self) -> bytes:
        """Return the whole body (see :meth:`aiter_raw` for errors)."""
        parts = [data async for data in self.aiter_raw()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release_if_reusable(self) -> bool:
        """Return True if the response is now released: already closed, or read to the end on a
        reusable connection (which goes back to the pool, no await needed). False: use :meth:`aclose`."""
        if self._closed:
            return True
        conn = self._conn
        if self._done and self._framing != "close" and conn.keep_alive and not conn.buffer:
            self._closed = True
            self._pool.put_back(conn)
            return True
        return False

    def abort(self) -> None:
        """Close the connection at once, failing a read in progress on it (a read past its
        deadline, a stream cut). Never raises; :meth:`aclose` must still be called."""
        self._conn.keep_alive = False
        self._conn.close_now()

    async def aclose(self) -> None:
        """Release the connection: back to the pool if reusable, else closed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        if self._done and self._framing != "close" and conn.keep_alive and not conn.buffer:
            self._pool.put_back(conn)
        else:
            await conn.aclose()


class _Conn:
    """One TCP connection to a replica with its unread bytes."""

    __slots__ = ("stream", "buffer", "keep_alive", "idle_since", "key")

    def __init__(self, stream: trio.SocketStream, key: tuple[str, int]) -> None:
        self.stream = stream
        self.buffer = b""
        self.keep_alive = True
        self.idle_since = 0.0
        self.key = key

    async def recv(self, *, eof_ok: bool = False, wait_first: bool = False) -> bytes:
        """Return the next bytes from the socket (b"" at EOF if ``eof_ok``, else ReadError);
        ``wait_first``: wait for them before reading (:func:`~.eagerio.receive_some`)."""
        try:
            data = await eagerio.receive_some(self.stream, RECV_BYTES, wait_first=wait_first)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            raise _broken(error) from error
        if not data and not eof_ok:
            raise _ended_early()
        return data

    async def recv_body(self) -> bytes:
        """Return the next body bytes; a premature EOF raises RemoteProtocolError."""
        return await self.recv()

    def take(self, limit: int) -> bytes:
        """Return up to ``limit`` buffered bytes, removing them from the buffer."""
        buffer = self.buffer
        if not buffer:
            return b""
        if len(buffer) <= limit:
            self.buffer = b""
            return buffer
        self.buffer = buffer[limit:]
        return buffer[:limit]

    def take_all(self) -> bytes:
        """Return and clear the whole buffer."""
        buffer, self.buffer = self.buffer, b""
        return buffer

    async def aclose(self) -> None:
        """Close the socket (never raises; shielded from cancellation)."""
        with trio.CancelScope(shield=True):
            try:
                await self.stream.aclose()
            except Exception:  # closing a broken socket: nothing to do about it
                pass

    def close_now(self) -> None:
        """Close the socket at once, without a task or a checkpoint (never raises).

        What ``SocketStream.aclose`` does minus its final checkpoint: trio is told the
        descriptor is closing (waiters on it get ``ClosedResourceError``), then it is
        closed. For the pool's synchronous paths (an idle connection past its expiry or
        over the pool's limit), which must not start a task outside any nursery.
        """
        try:
            self.stream.socket.close()
        except OSError:  # closing a broken socket: nothing to do about it
            pass


def _broken(error: BaseException) -> httpx.ReadError:
    return httpx.ReadError(f"connection to replica broke while reading: {error!r}")


def _ended_early() -> httpx.RemoteProtocolError:
    return httpx.RemoteProtocolError("replica closed the connection in the middle of a response")


class ChunkedDecoder:
    """Decodes an HTTP/1.1 chunked body fed in pieces as they arrive (RFC 9112 section 7.1).

    :meth:`feed` returns the payload bytes complete so far. Once the last chunk and its
    trailers have arrived, :attr:`ended` is True and :attr:`rest` holds the bytes after the
    body (there should be none). Trailers are skipped. Invalid framing raises
    ``httpx.RemoteProtocolError``.
    """

    __slots__ = ("_buffer", "_remaining", "_need_crlf", "_last", "ended", "rest")

    def __init__(self) -> None:
        self._buffer = b""
        self._remaining = 0  # payload bytes of the current chunk still to come
        self._need_crlf = False  # the CRLF closing the current chunk is still to come
        self._last = False  # the last chunk's size line was read: its trailers are coming
        self.ended = False
        self.rest = b""

    def feed(self, data: bytes) -> bytes:
        """Add ``data`` (bytes from the wire); return the payload it completes (maybe b"")."""
        buffer = self._buffer + data if self._buffer else data
        remaining = self._remaining
        out: list[bytes] = []
        # The common case of a stream: one whole chunk per read, nothing held.
        if not remaining and not self._need_crlf and not self._last:
            line_end = buffer.find(b"\r\n")
            if line_end > 0:
                remaining = _chunk_size(buffer, line_end)
                if remaining and len(buffer) == line_end + remaining + 4 and buffer.endswith(b"\r\n"):
                    self._buffer = b""
                    return buffer[line_end + 2:-2]
                buffer = buffer[line_end + 2:]
                self._last = remaining == 0
        while buffer and not self.ended:
            if remaining:
                piece = buffer[:remaining]
                out.append(piece)
                buffer = buffer[len(piece):]
                remaining -= len(piece)
                self._need_crlf = remaining == 0
                continue
            if self._need_crlf:
                if len(buffer) < 2:
                    break
                if buffer[:2] != b"\r\n":
                    raise httpx.RemoteProtocolError("replica sent a chunk without its closing CRLF")
                buffer = buffer[2:]
                self._need_crlf = False
                continue
            if self._last:  # trailers up to the empty line
                if buffer.startswith(b"\r\n"):
                    self.rest = buffer[2:]
                elif b"\r\n\r\n" in buffer:
                    self.rest = buffer[buffer.index(b"\r\n\r\n") + 4:]
                elif len(buffer) > MAX_HEAD_BYTES:
                    raise httpx.RemoteProtocolError("replica sent over-long chunked trailers")
                else:
                    break
                self.ended = True
                buffer = b""
                break
            line_end = buffer.find(b"\r\n")
            if line_end < 0:
                if len(buffer) > MAX_CHUNK_LINE_BYTES:
                    raise httpx.RemoteProtocolError("replica sent an over-long chunk-size line")
                break
            size = _chunk_size(buffer, line_end)
            buffer = buffer[line_end + 2:]
            if size == 0:
                self._last = True
            remaining = size
        self._remaining = remaining
        self._buffer = buffer
        return out[0] if len(out) == 1 else b"".join(out)


def _chunk_size(buffer: bytes, line_end: int) -> int:
    """Return the size on the chunk-size line ending at ``line_end``; raise RemoteProtocolError if invalid."""
    line = buffer[:line_end]
    try:
        size = int(line.split(b";", 1)[0], 16)
    except ValueError:
        raise httpx.RemoteProtocolError(f"replica sent an invalid chunk size {line[:40]!r}") from None
    if size < 0:
        raise httpx.RemoteProtocolError("replica sent a negative chunk size")
    return size


def _parse_head(head: bytes) -> tuple[int, Headers, bool]:
    """Return (status, headers, keep_alive) from a response head without its final CRLFCRLF."""
    lines = head.split(b"\r\n")
    status_line = lines[0]
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise httpx.RemoteProtocolError(f"replica sent an invalid status line {status_line[:80]!r}")
    try:
        status = int(parts[1])
    except ValueError:
        raise httpx.RemoteProtocolError(f"replica sent an invalid status line {status_line[:80]!r}") from None
    headers = Headers()
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise httpx.RemoteProtocolError(f"replica sent an invalid header line {line[:80]!r}")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    connection = headers.get("connection", "").lower()
    keep_alive = "close" not in connection if parts[0] == b"HTTP/1.1" else "keep-alive" in connection
    return status, headers, keep_alive


class H1Pool:
    """Keep-alive HTTP/1.1 connections to replicas, pooled per (host, port).

    Use from inside one trio run; :meth:`aclose` closes every idle connection (connections
    lent to open responses are closed by those responses' ``aclose``).
    """

    def __init__(self, *, connect_timeout: float, write_timeout: float, keepalive_expiry: float,
                 max_idle_per_replica: int) -> None:
        self._connect_timeout = connect_timeout
        self._write_timeout = write_timeout
        self._expiry = keepalive_expiry
        self._max_idle = max_idle_per_replica
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._closed = False
        self._targets: dict[str, tuple[str, int, bytes, str]] = {}

    def _target(self, base_url: str) -> tuple[str, int, bytes, str]:
        """Return (host, port, Host header value, path prefix) for an ``http://host:port[/prefix]`` URL (cached).

        Raises ``httpx.UnsupportedProtocol`` for anything but plain ``http://``.
        """
        found = self._targets.get(base_url)
        if found is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise httpx.UnsupportedProtocol(f"replica endpoint {base_url!r} is not an http://host:port URL")
            port = parts.port or 80
            found = (parts.hostname, port, parts.netloc.encode("latin-1"), parts.path.rstrip("/"))
            self._targets[base_url] = found
        return found

    def put_back(self, conn: _Conn) -> None:
        """Return a connection whose response was read to the end to its replica's pool."""
        idle = self._idle.setdefault(conn.key, [])
        if self._closed or len(idle) >= self._max_idle:
            conn.close_now()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def _take_idle(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # most recently used first: least likely to be expired
            if now - conn.idle_since < self._expiry:
                return conn
            conn.close_now()
        return None

    async def _connect(self, host: str, port: int) -> _Conn:
        try:
            with trio.fail_after(self._connect_timeout):
                stream = await trio.open_tcp_stream(host, port)
        except trio.TooSlowError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} took longer than {self._connect_timeout:g}s") from None
        except OSError as error:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {error}") from error
        return _Conn(stream, (host, port))

    async def request(self, base_url: str, method: str, target: str, headers: Iterable[tuple[str, str]],
                      body: bytes, head: HeadWait | None = None) -> H1Response:
        """Send one request to the engine at ``base_url`` and return once the response head arrived.

        ``target`` is the path and query (``/v1/chat/completions?x=1``); ``headers`` must
        not include Host, Content-Length or Connection (set here). ``head``: the wait for
        the response head, which its :meth:`HeadWait.abort` ends (the connection is closed,
        never retried): ``httpx.ReadError``. Raises as the module docstring says; the caller
        must ``aclose`` the returned response.
        """
        if self._closed:
            raise httpx.ConnectError("the gateway's upstream client is closed")
        host, port, host_header, prefix = self._target(base_url)
        if prefix:
            target = prefix + target
        key = (host, port)
        lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n" % (
            method.encode("ascii"), target.encode("latin-1"), host_header, len(body))]
        for name, value in headers:
            lines.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
        lines.append(b"\r\n")
        lines.append(body)
        payload = b"".join(lines)
        for attempt in range(2):
            conn = self._take_idle(key) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(host, port)
            if head is not None:
                head.conn = conn
            try:
                if head is not None and head.aborted:
                    raise _StaleConnection()
                return await self._exchange(conn, payload, method)
            except _StaleConnection:
                await conn.aclose()
                if head is not None and head.aborted:
                    raise httpx.ReadError(f"the wait for replica {host}:{port}'s answer was ended") from None
                if not reused:  # a fresh connection closed on us: the engine is refusing
                    raise httpx.RemoteProtocolError(f"replica {host}:{port} closed the connection without answering") from None
                continue
            except BaseException:
                await conn.aclose()
                raise
            finally:
                if head is not None:
                    head.conn = None
        raise AssertionError("unreachable: the second attempt uses a fresh connection")

    async def _exchange(self, conn: _Conn, payload: bytes, method: str) -> H1Response:
        """Send ``payload`` on ``conn`` and read the response head."""
        # The kernel almost always takes the whole request at once; only a write that has
        # to wait for room gets a deadline (a cancel scope per request was measurable).
        sent = eagerio.try_send(conn.stream, payload)
        if sent < len(payload):
            try:
                with trio.CancelScope(relative_deadline=self._write_timeout) as write_scope:
                    await conn.stream.send_all(memoryview(payload)[sent:] if sent else payload)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
                raise _StaleConnection() from error
            if write_scope.cancelled_caught:
                raise httpx.WriteTimeout(f"sending the request took longer than {self._write_timeout:g}s")
        buffer = b""
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buffer) > MAX_HEAD_BYTES:
                raise httpx.RemoteProtocolError("replica sent an over-long response head")
            try:
                # The answer cannot be there before the engine has read the request.
                data = await eagerio.receive_some(conn.stream, RECV_BYTES, wait_first=not buffer)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
                if not buffer:
                    raise _StaleConnection() from error
                raise httpx.ReadError(f"connection to replica broke while reading the response head: {error!r}") from error
            if not data:
                if not buffer:
                    raise _StaleConnection()
                raise httpx.RemoteProtocolError("replica closed the connection in the middle of the response head")
            buffer += data
        status, headers, keep_alive = _parse_head(buffer[:end])
        conn.buffer = buffer[end + 4:]
        conn.keep_alive = keep_alive
        if status < 200:  # 1xx (e.g. 100 Continue) is not used by engines for these calls
            raise httpx.RemoteProtocolError(f"replica sent an unexpected informational status {status}")
        length = 0
        if method == "HEAD" or status in (204, 304):
            framing = "none"
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            framing = "chunked"
        elif "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError:
                raise httpx.RemoteProtocolError(f"replica sent an invalid content-length {headers['content-length']!r}") from None
            framing = "length"
        else:
            framing = "close"
            conn.keep_alive = False
        return H1Response(status, headers, conn, self, framing, length)

    async def aclose(self) -> None:
        """Close every idle pooled connection; further requests raise ConnectError."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                await conn.aclose()


class HeadWait:
    """A request's wait for its response head, ended from outside by :meth:`abort` (the
    deadline's watch): the connection in use is closed, and no other is tried."""

    __slots__ = ("conn", "aborted")

    def __init__(self) -> None:
        self.conn: _Conn | None = None
        self.aborted = False

    def abort(self) -> None:
        """End the wait (never raises)."""
        self.aborted = True
        conn = self.conn
        if conn is not None:
            conn.keep_alive = False
            conn.close_now()


class _StaleConnection(Exception):
    """The connection was closed by the engine before any response byte (retry on a fresh one)."""

