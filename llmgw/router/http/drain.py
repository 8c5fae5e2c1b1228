"""The relayed streams' upstream reads: their deadlines, and ending them when a stopping
gateway's shutdown grace runs out.

A relayed stream reads its replica chunk by chunk, each chunk within a deadline
(``gateway.chunk_timeout``; the first within ``gateway.first_byte_timeout``). A cancel
scope per read costs more CPU than the rest of the read (measured at 1,000 events/s per
stream: a fifth of the gateway's CPU per event), so while :meth:`StreamCuts.watch` runs
(the gateway starts it when it starts serving), a read has no scope of its own: its
:class:`WatchedRead` holds the deadline as a number, and the watch task, waking every
:data:`WATCH_TICK_S` while streams are open, closes the upstream connection of a read
past its deadline. The read then fails, and the relay reports it as the deadline it was.
Without the watch task (a gateway that is not serving through its lifespan), each read
gets its own deadline scope instead
(:meth:`~llmgw.router.http.upstream.BodyReader.next`).

A stopping gateway (:func:`~llmgw.router.http.serve.serve_gateway`) lets its in-flight
requests finish for ``gateway.shutdown_grace`` seconds. A stream still running then
must end with an SSE error event and the stream's end, never a bare close.
:meth:`StreamCuts.cut_all` closes the upstream connection of every open stream (or
cancels the read's scope) and makes every later read raise :class:`StreamCut`, so the
relay writes its error event and returns while the client connection is still open.
"""

from __future__ import annotations

import math
from typing import Callable

import trio

#: Seconds between two checks of the open streams' deadlines. A deadline fires up to this
#: late; deadlines are seconds to minutes (gateway.chunk_timeout), so 50 ms is noise, and
#: 20 wakeups a second while streams are open cost nothing measurable.
WATCH_TICK_S = 0.05

#: Why a watched read was ended.
DEADLINE, CUT = "deadline", "cut"

#: A watched read's deadline while its reader is not reading (sending a chunk to the client).
NOT_READING = math.inf


class StreamCut(Exception):
    """Raised by a relayed stream's read once the gateway's streams are being cut."""


class WatchedRead:
    """One relayed stream's upstream reads while :meth:`StreamCuts.watch` runs.

    The reader sets :attr:`deadline` (trio time) before each read; ``abort`` closes the
    upstream connection, failing the read in progress or the next one. :attr:`ended` says
    why it was aborted (:data:`DEADLINE` or :data:`CUT`; None: it was not).
    """

    __slots__ = ("deadline", "abort", "ended")

    def __init__(self, abort: Callable[[], None]) -> None:
        self.deadline = NOT_READING
        self.abort = abort
        self.ended: str | None = None

    def end(self, why: str) -> None:
        """Abort the read (once) because of ``why``."""
        if self.ended is None:
            self.ended = why
            self.abort()


class StreamCuts:
    """The upstream reads of one gateway's relayed streams: their deadlines, and the switch
    that ends them all."""

    __slots__ = ("reading", "watched", "uncut", "cut", "_watching", "_opened")

    def __init__(self) -> None:
        #: The cancel scopes of the unwatched reads waiting now (added and removed by the reader).
        self.reading: set[trio.CancelScope] = set()
        #: The open streams' watched reads (added and removed by the reader).
        self.watched: set[WatchedRead] = set()
        #: Watched reads the cut leaves alone (requests waiting for their response head).
        self.uncut: set[WatchedRead] = set()
        #: True once :meth:`cut_all` was called: readers raise :class:`StreamCut`.
        self.cut = False
        self._watching: trio.CancelScope | None = None
        self._opened = trio.Event()

    @property
    def watching(self) -> bool:
        """Whether :meth:`watch` runs (reads may then go without a scope of their own)."""
        return self._watching is not None

    def open(self, abort: Callable[[], None], *, cut: bool = True) -> WatchedRead:
        """Return a :class:`WatchedRead` for a stream whose upstream connection ``abort``
        closes, watched until :meth:`close` is called with it. ``cut=False``: a read
        :meth:`cut_all` leaves alone (only its deadline is watched)."""
        read = WatchedRead(abort)
        (self.watched if cut else self.uncut).add(read)
        self._opened.set()  # wakes the watch if it sleeps for want of streams
        return read

    def close(self, read: WatchedRead) -> None:
        """Stop watching ``read`` (its stream ended)."""
        self.watched.discard(read)
        self.uncut.discard(read)

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """End each watched read that passes its deadline, every :data:`WATCH_TICK_S`
        while any is open, until :meth:`stop_watching` or cancellation. Reports started
        once reads may rely on it; on return they get scopes of their own again."""
        with trio.CancelScope() as scope:
            self._watching = scope
            task_status.started()
            try:
                while True:
                    if not self.watched and not self.uncut:
                        self._opened = trio.Event()
                        await self._opened.wait()
                    await trio.sleep(WATCH_TICK_S)
                    now = trio.current_time()
                    late = [r for r in self.watched if r.deadline < now] + [r for r in self.uncut if r.deadline < now]
                    for read in late:
                        read.end(DEADLINE)
            finally:
                self._watching = None

    def stop_watching(self) -> None:
        """Make :meth:`watch` return (the gateway stops serving)."""
        scope = self._watching
        if scope is not None:
            scope.cancel()

    def cut_all(self) -> int:
        """End every stream: abort the watched reads and cancel the others in progress,
        refuse later ones. Returns the number of streams ended."""
        self.cut = True
        reading = list(self.reading)
        for scope in reading:
            scope.cancel()
        watched = list(self.watched)
        for read in watched:
            read.end(CUT)
        return len(reading) + len(watched)
