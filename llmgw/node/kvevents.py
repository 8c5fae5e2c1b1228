"""The agent's KV-event subscriber: one per shard whose engine publishes vLLM KV events.

The engine (vLLM, or ``python -m llmgw.sim``) CONNECTS its PUB socket to a loopback
endpoint this subscriber BINDS, and BINDS a ROUTER replay socket this subscriber asks
when it misses batches. Each message is ``[topic, seq (8 bytes BE), msgpack
KVEventBatch]`` (``../shared/reference/vllm.md``; the format lives in
:mod:`llmgw.kvwire`).

The subscriber keeps a *mirror*: the set of 64-bit block hashes the engine holds
(``BlockStored`` is idempotent, ``BlockRemoved`` and ``AllBlocksCleared`` remove), and
sends *net* changes up through a ``send`` callback, batched at a bounded rate: a block
stored and removed between two sends is never sent at all. A reset (the replica holds
exactly ``stored``) is sent first, after ``AllBlocksCleared``, after a sequence gap that
replay could not fill (a *resync*), after :meth:`KvSubscriber.engine_restarted`, and
when the caller asks for one (:meth:`KvSubscriber.resend_full`, a new session).

Lost messages: a sequence gap on the PUB path is filled from replay (with a deadline).
Because vLLM's PUB socket has been seen to deliver nothing while its replay socket had
every batch, replay is also polled from the next expected sequence whenever the PUB
path has been quiet for :data:`QUIET_REPLAY_INTERVAL`, so no event is silently lost.

pyzmq has no trio integration: sockets are non-blocking and read after
``trio.lowlevel.wait_readable`` on zmq's edge-triggered FD, always draining while
``zmq.EVENTS`` says POLLIN (the rule :mod:`llmgw.sim.publisher` follows too).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Awaitable, Callable, Iterable

import attrs
import trio
import zmq

from llmgw import kvhash
from llmgw import kvwire as wire
from llmgw.logthrottle import LogThrottle, is_disconnection, reason
from llmgw.node.ports import free_port
from llmgw.spec import KvDelta, split_delta

__all__ = [
    "MIN_SEND_INTERVAL",
    "QUIET_REPLAY_INTERVAL",
    "REPLAY_TIMEOUT",
    "KvEventsConfig",
    "KvMirror",
    "KvSubscriber",
]

log = logging.getLogger(__name__)
#: Sends fail on every retry while the agent is cut off from its control plane: one line
#: per endpoint, then one per interval with a count.
_send_failures = LogThrottle(log)

#: At most one send per this many seconds: a busy engine publishes a batch per step
#: (hundreds per second); the router needs changes within a fraction of a second, not each step.
MIN_SEND_INTERVAL = 0.05
#: Pending changes (hashes) that make a send go out before MIN_SEND_INTERVAL: a burst
#: (a long prompt's prefill) reaches the router at once instead of waiting.
FLUSH_PENDING_HASHES = 4096
#: With no message on the PUB path for this long, replay is asked from the next expected
#: sequence: events reach the router within about a second even if PUB delivers nothing.
QUIET_REPLAY_INTERVAL = 1.0
#: Deadline of one replay (request to end marker). The replay socket answers from memory;
#: an engine that cannot answer in this time is busy or gone, and the gap becomes a resync.
REPLAY_TIMEOUT = 2.0
#: After a failed send, the next (a full copy) waits this long: a broken session is not hammered.
SEND_RETRY_INTERVAL = 1.0
#: vLLM's end-of-replay frames after the empty delimiter.
_REPLAY_END = [b"", wire.REPLAY_END_SEQ, b""]


@attrs.frozen
class KvEventsConfig:
    """Where one shard's engine publishes KV events, persisted with the shard.

    ``endpoint``: a loopback ``tcp://host:port`` the agent's SUB socket BINDS (the engine
    connects to it). ``replay_endpoint``: where the engine BINDS its replay ROUTER socket.
    ``topic``: the first frame of every message. ``block_size``: tokens per block as the
    agent launched the engine (0: learned from the first ``BlockStored``).
    """

    endpoint: str
    replay_endpoint: str
    topic: str = "kv"
    block_size: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict (see :meth:`from_dict`)."""
        return attrs.asdict(self)

    @classmethod
    def on_free_ports(cls, host: str, *, block_size: int, topic: str = "kv",
                      avoid: set[int] = frozenset()) -> KvEventsConfig:  # type: ignore[assignment]
        """Returns a config whose two endpoints are TCP ports on ``host`` that were free a
        moment ago (the kernel's choice), different from each other and from ``avoid`` (the
        ports the node gave its shards: the kernel hands a port just released out again);
        the caller persists it with the shard. Raises OSError as :func:`~llmgw.node.ports.free_port`."""
        events = free_port(host, avoid)
        replay = free_port(host, avoid | {events})
        return cls(f"tcp://{host}:{events}", f"tcp://{host}:{replay}", topic, block_size)

    def ports(self) -> tuple[int, ...]:
        """Returns the TCP ports of the two endpoints (those with one; ``tcp://host:port``)."""
        found = []
        for endpoint in (self.endpoint, self.replay_endpoint):
            _, _, port = endpoint.rpartition(":")
            if port.isdigit():
                found.append(int(port))
        return tuple(found)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KvEventsConfig:
        """Returns the config; raises KeyError/TypeError/ValueError if ``data`` is malformed."""
        return cls(
            endpoint=str(data["endpoint"]),
            replay_endpoint=str(data["replay_endpoint"]),
            topic=str(data.get("topic", "kv")),
            block_size=int(data.get("block_size", 0)),
        )


def _as_hash(value: object) -> int:
    """Returns a block hash as vLLM's uint64 event form (ints as they are, 32-byte digests folded)."""
    if isinstance(value, int):
        return value & kvhash.UINT64_MASK
    if isinstance(value, (bytes, bytearray)):
        return kvhash.event_hash(value)
    raise ValueError(f"block hash must be an int or bytes, got {type(value).__name__}")


class KvMirror:
    """The blocks one engine holds, and the net change not yet sent (pure, no I/O).

    ``events_applied``/``gaps``/``resyncs`` are cumulative counters that go into every delta.
    """

    def __init__(self, block_size: int = 0) -> None:
        self.block_size = block_size
        self.blocks: set[int] = set()
        self._added: set[int] = set()
        self._removed: set[int] = set()
        self.reset_pending = True  # the first send is a full copy
        self.events_applied = 0
        self.gaps = 0
        self.resyncs = 0

    @property
    def pending(self) -> int:
        """Returns how many hashes the next send carries (the whole mirror when a reset is pending)."""
        return len(self.blocks) if self.reset_pending else len(self._added) + len(self._removed)

    @property
    def has_pending(self) -> bool:
        """Returns True when a send is due (a reset, or any net change)."""
        return self.reset_pending or bool(self._added) or bool(self._removed)

    def stored(self, hashes: Iterable[int]) -> None:
        """Adds blocks; a block already held changes nothing (vLLM repeats BlockStored)."""
        for h in hashes:
            if h in self.blocks:
                continue
            self.blocks.add(h)
            if h in self._removed:
                self._removed.discard(h)  # removed then stored again since the last send: no net change
            else:
                self._added.add(h)

    def removed(self, hashes: Iterable[int]) -> None:
        """Removes blocks; a block not held changes nothing."""
        for h in hashes:
            if h not in self.blocks:
                continue
            self.blocks.discard(h)
            if h in self._added:
                self._added.discard(h)  # stored then removed since the last send: never sent
            else:
                self._removed.add(h)

    def clear(self) -> None:
        """Drops every block; the next send is a reset (to nothing, or what is stored by then)."""
        self.blocks.clear()
        self._added.clear()
        self._removed.clear()
        self.reset_pending = True

    def apply(self, event: dict[str, Any]) -> None:
        """Applies one decoded event map; raises ValueError if it is malformed. Unknown types are skipped."""
        kind = event.get("type")
        medium = event.get("medium")  # device memory (wire.MEDIUM, also on CPU); offloaded tiers are not mirrored
        if kind == "BlockStored":
            if medium not in (None, wire.MEDIUM):
                return
            size = event.get("block_size")
            if not self.block_size and isinstance(size, int) and size > 0:
                self.block_size = size
            self.stored([_as_hash(h) for h in event.get("block_hashes") or ()])
        elif kind == "BlockRemoved":
            if medium not in (None, wire.MEDIUM):
                return
            self.removed([_as_hash(h) for h in event.get("block_hashes") or ()])
        elif kind == "AllBlocksCleared":
            self.clear()
        else:
            return
        self.events_applied += 1

    def full_copy(self) -> KvDelta:
        """Returns a reset delta holding every block of the mirror (changes nothing)."""
        return self._delta(True, tuple(self.blocks), ())

    def take(self) -> KvDelta:
        """Returns the pending change (a full copy when a reset is pending) and marks it sent."""
        if self.reset_pending:
            delta = self.full_copy()
        else:
            delta = self._delta(False, tuple(self._added), tuple(self._removed))
        self._added.clear()
        self._removed.clear()
        self.reset_pending = False
        return delta

    def _delta(self, reset: bool, stored: tuple[int, ...], removed: tuple[int, ...]) -> KvDelta:
        return KvDelta(
            reset=reset, stored=stored, removed=removed, block_size=self.block_size,
            events_applied=self.events_applied, gaps=self.gaps, resyncs=self.resyncs,
        )


class _Socket:
    """A non-blocking zmq socket read under trio (edge-triggered FD: drain while POLLIN)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.fd = sock.getsockopt(zmq.FD)

    def readable(self) -> bool:
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    async def recv(self) -> list[bytes]:
        """Returns the next message; waits (cancellably) until one is there."""
        while not self.readable():
            await trio.lowlevel.wait_readable(self.fd)
        return self.sock.recv_multipart(zmq.NOBLOCK)

    def close(self) -> None:
        """Closes the socket (trio is told first, so no task waits on a dead FD). Idempotent."""
        if not self.sock.closed:
            trio.lowlevel.notify_closing(self.fd)
            self.sock.close(linger=0)


class KvSubscriber:
    """Mirrors one engine's KV cache from its events and sends net changes (module docstring).

    ``endpoint`` is bound by :meth:`run` (SUB); ``replay_endpoint`` is the engine's replay
    ROUTER; ``topic`` filters messages; ``block_size`` is what the engine was launched with
    (0: learned from the events). Counters: ``events_applied``, ``gaps``, ``resyncs``.
    """

    def __init__(self, endpoint: str, replay_endpoint: str, *, topic: str = "kv", block_size: int = 0) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self.mirror = KvMirror(block_size)
        self.next_seq = 0  # the engine's publisher counts from 0
        self.replayed_batches = 0  # batches that arrived by replay (gap fills and quiet polls)
        self.bound = False  # True once run() has bound the SUB socket (stays True after)
        self._held: list[tuple[int, bytes]] = []  # PUB batches received behind a gap, until it is filled
        self._restarts = 0  # engine_restarted() calls: replay answers from before one are dropped
        self._wake = trio.Event()
        self._ctx: zmq.Context | None = None
        self._dealer: _Socket | None = None

    @property
    def events_applied(self) -> int:
        return self.mirror.events_applied

    @property
    def gaps(self) -> int:
        return self.mirror.gaps

    @property
    def resyncs(self) -> int:
        return self.mirror.resyncs

    def full_copy(self) -> KvDelta:
        """Returns a reset delta with every block the mirror holds (for a new session)."""
        return self.mirror.full_copy()

    def resend_full(self) -> None:
        """Makes the next send a full copy (split if large) and wakes the sender now."""
        self.mirror.reset_pending = True
        self._wake.set()

    def engine_restarted(self) -> None:
        """Clears the mirror (a new engine holds nothing) and expects sequence 0 again;
        the next send is a reset."""
        self.mirror.clear()
        self.next_seq = 0
        self._held = []
        self._restarts += 1
        self._wake.set()

    async def run(
        self,
        send: Callable[[KvDelta], Awaitable[None]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Binds the SUB socket, signals started, then mirrors and sends until cancelled.

        ``send`` gets each delta in order (never two at once); an exception from it is
        logged and the next send, after :data:`SEND_RETRY_INTERVAL`, is a full copy.
        Raises zmq.ZMQError if ``endpoint`` cannot be bound (before signalling started).
        Cancellation closes both sockets and the context.
        """
        ctx = zmq.Context()
        self._ctx = ctx
        sub: _Socket | None = None
        try:
            raw = ctx.socket(zmq.SUB)
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub = _Socket(raw)
            raw.bind(self.endpoint)
            self.bound = True
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_loop, send)
                task_status.started()
                await self._receive_loop(sub)
        finally:
            if sub is not None:
                sub.close()
            if self._dealer is not None:
                self._dealer.close()
                self._dealer = None
            ctx.destroy(linger=0)
            self._ctx = None

    # -- receiving -----------------------------------------------------------------

    async def _receive_loop(self, sub: _Socket) -> None:
        while True:
            frames = None
            with trio.move_on_after(QUIET_REPLAY_INTERVAL):
                frames = await sub.recv()
            if frames is None:
                await self._poll_replay()
                continue
            self._on_message(frames)
            # Drain what else is there before any other wait (edge-triggered FD).
            while sub.readable():
                self._on_message(sub.sock.recv_multipart(zmq.NOBLOCK))
            if self._held:
                await self._fill_gap()

    def _on_message(self, frames: list[bytes]) -> None:
        """Handles one PUB message: applies it in order, holds it behind a gap, or skips a duplicate."""
        if len(frames) != 3 or frames[0] != self.topic or len(frames[1]) != 8:
            log.warning("KV events on %s: skipped a malformed message (%d frames)", self.endpoint, len(frames))
            return
        seq = wire.decode_seq(frames[1])
        if seq < self.next_seq:
            return  # already applied (replay and PUB both delivered it)
        if seq > self.next_seq or self._held:
            if not self._held:
                self.mirror.gaps += 1
            self._held.append((seq, frames[2]))
            return
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            _, events, _ = wire.decode_batch(payload)
            for event in events:
                if isinstance(event, dict):
                    self.mirror.apply(event)
        except ValueError as exc:
            log.warning("KV events on %s: batch %d is malformed (%s); resyncing", self.endpoint, seq, exc)
            self._resync()
        self.next_seq = seq + 1
        if self.mirror.has_pending:
            self._wake.set()

    def _resync(self) -> None:
        """The mirror cannot be trusted: purge it; the next send is a reset. Counted."""
        self.mirror.resyncs += 1
        self.mirror.clear()
        self._wake.set()

    def _apply_in_order(self, batches: Iterable[tuple[int, bytes]]) -> None:
        """Applies ``batches`` (any order, duplicates allowed) from ``next_seq`` on; a hole
        that nothing fills is a resync, after which the batches past it are applied."""
        for seq, payload in sorted(dict(batches).items()):
            if seq < self.next_seq:
                continue
            if seq > self.next_seq:
                log.warning(
                    "KV events on %s: batches %d..%d lost and not in replay; resyncing the mirror",
                    self.endpoint, self.next_seq, seq - 1,
                )
                self._resync()
            self._apply(seq, payload)

    async def _fill_gap(self) -> None:
        """Asks replay for what the PUB path missed, then applies it with the held batches."""
        restarts = self._restarts
        replayed = await self._replay(self.next_seq)
        if restarts != self._restarts:  # the engine restarted meanwhile: all of it is stale
            return
        held, self._held = self._held, []
        self._apply_in_order([*(replayed or ()), *held])

    async def _poll_replay(self) -> None:
        """The PUB path was quiet: applies whatever replay has from the next expected sequence."""
        restarts = self._restarts
        replayed = await self._replay(self.next_seq)
        if replayed and restarts == self._restarts:
            self._apply_in_order(replayed)

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Returns the batches replay holds from ``start`` (seq order), or None if it did not
        answer completely within :data:`REPLAY_TIMEOUT` (the socket is then replaced, so a late
        answer cannot be mistaken for the next one's)."""
        dealer = self._dealer_socket()
        out: list[tuple[int, bytes]] = []
        with trio.move_on_after(REPLAY_TIMEOUT):
            try:
                dealer.sock.send_multipart([b"", wire.encode_seq(start)], zmq.NOBLOCK)
            except zmq.Again:  # no engine connected yet
                return None
            while True:
                frames = await dealer.recv()
                if frames[1:] == _REPLAY_END:
                    self.replayed_batches += len(out)
                    return sorted(out)
                if len(frames) == 4 and frames[1] == self.topic and len(frames[2]) == 8:
                    out.append((wire.decode_seq(frames[2]), frames[3]))
        dealer.close()
        self._dealer = None
        return None

    def _dealer_socket(self) -> _Socket:
        if self._dealer is None:
            assert self._ctx is not None
            raw = self._ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.IMMEDIATE, 1)  # no engine listening yet: sending fails at once
            raw.connect(self.replay_endpoint)
            self._dealer = _Socket(raw)
        return self._dealer

    # -- sending -------------------------------------------------------------------

    async def _send_loop(self, send: Callable[[KvDelta], Awaitable[None]]) -> None:
        last = -math.inf
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if not self.mirror.has_pending:
                continue
            # Bounded rate: wait out the interval unless a burst is pending.
            due = last + MIN_SEND_INTERVAL
            while trio.current_time() < due and self.mirror.pending < FLUSH_PENDING_HASHES:
                with trio.move_on_at(due):
                    await self._wake.wait()
                self._wake = trio.Event()
            last = trio.current_time()
            delta = self.mirror.take()
            try:
                for part in split_delta(delta):
                    await send(part)
            except Exception as exc:  # noqa: BLE001 - a broken session must not end the subscriber
                _send_failures.failure(
                    self.endpoint, logging.WARNING, "KV events on %s: sending a delta failed (%s); a full copy follows",
                    self.endpoint, reason(exc), exc_info=not is_disconnection(exc),
                )
                self.mirror.reset_pending = True
                await trio.sleep(SEND_RETRY_INTERVAL)
                self._wake.set()
