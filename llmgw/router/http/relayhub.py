"""One task that relays every open event stream's pieces that need no waiting.

A relayed event costs the kernel two socket calls (read it from the engine, write it to the
client). In a task per stream it also costs a trip through trio's scheduler per event:
re-arming the engine's socket in trio's epoll (trio registers one-shot, so that is an
``epoll_ctl`` per wait), the wake-up, and the resumption of the task's whole await stack
(the ASGI layers, the relay, the read). Measured on the gateway at 16 streams of 1,000
events/s, that trip was about as much CPU as the Rust routers spend per event in all.

:class:`RelayHub` keeps the engine socket of every stream handed to it registered, once and
level-triggered, in an epoll of its own, and waits on that epoll's descriptor in trio: one
wait for each batch of ready streams instead of one per event. For each ready stream it
calls the stream's step (synchronous: read what is there, decode, account, write to the
client at once), at most :data:`MAX_BATCH` streams between two waits so that other tasks
run in between.

Each stream stays its request task's: :meth:`RelayHub.relay` hands the stream over and
waits until the hub hands it back (the step said so: the body ended, a read failed, the
client could not take a piece at once; or :meth:`RelayHub.detach` was called, as the
stream's deadline watch does before it closes the engine's connection; or the hub stopped).
The task then carries on by itself and may hand the stream over again. A task cancelled
while its stream is in the hub takes it back on the way out, synchronously: the hub never
holds a stream its owner has left.
"""

from __future__ import annotations

import logging
import select
from typing import Callable

import trio

log = logging.getLogger(__name__)

#: Ready streams stepped between two waits of the hub. A step is a read and a write (tens
#: of microseconds), so 64 keep the hub's turn under a few milliseconds however many
#: streams are open, and other tasks (new requests, the streams' owners) run in between.
MAX_BATCH = 64

#: A stream's step: relay what its socket holds now; return False to hand it back to its owner.
Step = Callable[[float], bool]


class RelayHub:
    """The streams handed over by their tasks, relayed by :meth:`run` (see the module docstring)."""

    __slots__ = ("_epoll", "_streams", "_scope", "steps")

    def __init__(self) -> None:
        #: Steps run, all streams together (tests read it to know the hub relayed).
        self.steps = 0
        self._epoll: select.epoll | None = None
        self._streams: dict[int, tuple[Step, trio.Event]] = {}
        self._scope: trio.CancelScope | None = None

    @property
    def running(self) -> bool:
        """Whether :meth:`run` runs: streams handed over now are relayed."""
        return self._epoll is not None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Relay the streams handed over until :meth:`stop` or cancellation; reports started
        once it takes them.

        On the way out every stream still held is handed back to its owner, and the hub's
        epoll is closed.
        """
        if not hasattr(select, "epoll"):  # not Linux: the streams' tasks relay by themselves
            task_status.started()
            return
        epoll = select.epoll()
        self._epoll = epoll
        try:
            with trio.CancelScope() as self._scope:
                task_status.started()
                await self._serve(epoll)
        finally:
            self._epoll = None
            self._scope = None
            for fd in list(self._streams):
                self.detach(fd, epoll)
            epoll.close()

    def stop(self) -> None:
        """Make :meth:`run` return (the gateway stops serving)."""
        if self._scope is not None:
            self._scope.cancel()

    async def _serve(self, epoll: select.epoll) -> None:
        """Step the ready streams, batch by batch, forever."""
        streams = self._streams
        while True:
            await trio.lowlevel.wait_readable(epoll)
            now = trio.current_time()
            for fd, _ in epoll.poll(0, MAX_BATCH):
                held = streams.get(fd)
                if held is None:
                    continue
                self.steps += 1
                try:
                    keep = held[0](now)
                except Exception:  # a bug in a step: its owner carries on without the hub
                    log.exception("relaying a stream in the hub failed; its request carries on by itself")
                    keep = False
                if not keep:
                    self.detach(fd)

    async def relay(self, fd: int, step: Step) -> None:
        """Relay the stream whose engine socket is ``fd`` with ``step`` until it is handed back.

        ``step(now)`` is called (with trio's clock) whenever ``fd`` is readable; returning
        False hands the stream back. Returns at once if the hub is not running.
        Cancellation takes the stream back and propagates.
        """
        epoll = self._epoll
        if epoll is None:
            return
        self.detach(fd)  # a stream still held on this descriptor (never: owners take theirs back)
        try:
            epoll.register(fd, select.EPOLLIN)
        except FileExistsError:  # registered by a stream on a descriptor since closed and reused
            epoll.modify(fd, select.EPOLLIN)
        except OSError:  # not a descriptor epoll takes now (closed): the owner's read says why
            return
        handed_back = trio.Event()
        self._streams[fd] = (step, handed_back)
        try:
            await handed_back.wait()
        finally:
            self.detach(fd)

    def detach(self, fd: int, epoll: select.epoll | None = None) -> None:
        """Hand the stream on ``fd`` back to its owner now (nothing if the hub does not hold
        it). Call it before closing ``fd``. Never raises."""
        held = self._streams.pop(fd, None)
        if held is None:
            return
        epoll = epoll or self._epoll
        if epoll is not None:
            try:
                epoll.unregister(fd)
            except (OSError, ValueError):  # already closed: the kernel dropped it
                pass
        held[1].set()
