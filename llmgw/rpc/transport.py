"""Any ``trio.abc.Stream`` as a pycapnp byte stream.

pycapnp reads and writes through an asyncio ``BufferedProtocol`` that drives a
transport with ``pause_reading``/``resume_reading``/``write``/``write_eof``/``close``.
:class:`StreamTransport` is that transport, backed by one reader task and one
writer task on a trio stream (TCP, TLS, in-memory pairs alike).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import ssl
from typing import Any, AsyncIterator

import trio

import capnp

from llmgw.rpc import kjtrio
from llmgw.trioutil import unwrap_single_group

log = logging.getLogger(__name__)

#: Largest single read from the stream; Cap'n Proto frames are copied into KJ's buffer from here.
READ_CHUNK = 256 * 1024
#: Bytes queued for the writer above which pycapnp is told to stop writing (backpressure).
WRITE_HIGH_WATER = 1024 * 1024
#: How long a closing connection may take to flush and say goodbye (TLS close_notify) before it is cut.
CLOSE_TIMEOUT = 2.0

_STREAM_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError)


class StreamTransport:
    """An asyncio-transport facade over a trio stream, for one pycapnp protocol."""

    def __init__(self, stream: trio.abc.Stream, protocol: Any) -> None:
        self._stream = stream
        self._protocol = protocol
        self._reading = False
        self._read_resumed = trio.Event()
        self._out: collections.deque[bytes] = collections.deque()
        self._out_size = 0
        self._write_paused = False
        self._write_wakeup = trio.Event()
        self._eof_requested = False
        self._closing = False
        self._lost = False
        self._reader_scope = trio.CancelScope()
        self.finished = trio.Event()

    # -- asyncio transport API used by pycapnp's protocol ----------------------------------

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        self._reading = True
        self._read_resumed.set()

    def write(self, data: bytes) -> None:
        if self._closing:
            return
        self._out.append(data)
        self._out_size += len(data)
        self._write_wakeup.set()
        if not self._write_paused and self._out_size > WRITE_HIGH_WATER:
            self._write_paused = True
            self._protocol.pause_writing()

    def can_write_eof(self) -> bool:
        return isinstance(self._stream, trio.abc.HalfCloseableStream)

    def write_eof(self) -> None:
        self._eof_requested = True
        self._write_wakeup.set()

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Stop reading, flush what is queued, then close the stream (in the writer task)."""
        if self._closing:
            return
        self._closing = True
        self._reader_scope.cancel()
        self._write_wakeup.set()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    # -- trio side ----------------------------------------------------------------------

    def _connection_lost(self, exc: BaseException | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._closing = True
        self._reader_scope.cancel()
        self._write_wakeup.set()
        self._protocol.connection_lost(exc)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Pump bytes both ways until the connection ends; closes the stream on the way out."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._reader)
                task_status.started()
                await self._writer()
                nursery.cancel_scope.cancel()
        finally:
            self._connection_lost(None)
            with trio.CancelScope(shield=True):
                await self._close_stream()
            self.finished.set()

    async def _close_stream(self) -> None:
        with trio.move_on_after(CLOSE_TIMEOUT) as scope:
            with contextlib.suppress(*_STREAM_ERRORS):
                await self._stream.aclose()
        if scope.cancelled_caught:
            await trio.aclose_forcefully(self._stream)

    async def _reader(self) -> None:
        protocol = self._protocol
        with self._reader_scope:
            try:
                while True:
                    while not self._reading:
                        self._read_resumed = trio.Event()
                        await self._read_resumed.wait()
                    data = await self._stream.receive_some(READ_CHUNK)
                    if not data:
                        protocol.eof_received()
                        break
                    view = memoryview(data)
                    while view:
                        # While KJ has a read pending this is its own buffer; otherwise the
                        # protocol parks the bytes in its overflow buffer until the next read.
                        buffer = protocol.get_buffer(len(view))
                        n = min(len(buffer), len(view))
                        buffer[:n] = view[:n]
                        protocol.buffer_updated(n)
                        view = view[n:]
            except _STREAM_ERRORS as exc:
                self._connection_lost(exc)
                return
        if not self._closing:
            # The peer closed its side: nothing more will arrive.
            self._connection_lost(None)

    async def _writer(self) -> None:
        stream = self._stream
        eof_sent = False
        while True:
            await self._write_wakeup.wait()
            self._write_wakeup = trio.Event()
            try:
                while self._out:
                    data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
                    self._out.clear()
                    self._out_size = 0
                    await stream.send_all(data)
                    if self._write_paused and not self._out:
                        self._write_paused = False
                        if not self._lost:
                            self._protocol.resume_writing()
                if self._eof_requested and not eof_sent and not self._lost:
                    eof_sent = True
                    await stream.send_eof()  # type: ignore[attr-defined]
            except _STREAM_ERRORS as exc:
                self._connection_lost(exc)
                return
            if self._closing:
                return


@contextlib.asynccontextmanager
async def open_capnp_stream(stream: trio.abc.Stream) -> AsyncIterator[Any]:
    """Wrap ``stream`` as a pycapnp ``AsyncIoStream`` for the duration of the block.

    Yields the pycapnp stream object (give it to ``capnp.TwoPartyClient`` or
    ``capnp.TwoPartyServer``). On exit the stream is flushed (bounded by
    :data:`CLOSE_TIMEOUT`) and closed. Must run inside :func:`kjtrio.capnp_runtime`.
    """
    if not kjtrio.runtime_active():
        raise RuntimeError("open_capnp_stream() needs a running capnp runtime (llmgw.rpc.kjtrio.capnp_runtime)")
    created: list[Any] = []
    protocol = capnp.AsyncIoStream._connect(created.append)
    transport = StreamTransport(stream, protocol)
    protocol.connection_made(transport)
    with unwrap_single_group():
        async with trio.open_nursery() as nursery:
            await nursery.start(transport.run)
            try:
                yield created[0]
            finally:
                transport.close()
                with trio.CancelScope(shield=True):
                    await transport.finished.wait()
