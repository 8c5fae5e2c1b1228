"""Publishes the simulated engine's KV events over ZMQ exactly as vLLM does.

- A PUB socket that CONNECTs to the endpoint, or binds when the endpoint has a
  ``*`` or ``::`` (or is ipc/inproc) — vLLM's rule.
- Events queued with :meth:`KvEventPublisher.emit` during one "engine step" go out
  as one batch: the publishing task wakes on the first event, yields once so
  every request task runnable in the same scheduler pass adds its events, then
  sends ``[topic, seq, msgpack([ts, events, dp_rank])]``.
- The last :data:`REPLAY_BUFFER_STEPS` batches are kept for a ROUTER replay socket
  (always bound) that answers ``[identity, b"", start_seq]`` with every buffered
  batch whose seq >= start_seq, then the end marker.

Sockets are used from the trio thread only, non-blocking: the PUB socket drops on
its high-water mark rather than blocking, and the ROUTER socket is read after
``trio.lowlevel.wait_readable`` on zmq's (edge-triggered) FD, re-checking
``zmq.EVENTS`` before every wait.
"""

from __future__ import annotations

import collections
import time

import trio
import zmq

from llmgw import kvwire

#: Batches kept for replay (vLLM's ``buffer_steps`` default).
REPLAY_BUFFER_STEPS = 10_000
#: Send high-water mark (vLLM's ``hwm`` default): messages past it are dropped, never blocking.
SEND_HWM = 100_000
#: How long closing waits for unsent messages, in ms: enough to flush to a live
#: subscriber, short enough that a dead one never delays exit.
LINGER_MS = 200


def endpoint_binds(endpoint: str) -> bool:
    """Return True when vLLM would bind (rather than connect) its PUB socket to ``endpoint``."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """Batches KV events and publishes them on PUB; serves replays on ROUTER.

    Construct, :meth:`open` (raises zmq.ZMQError if an endpoint cannot be bound
    or connected), run :meth:`run` in a nursery until cancelled, then :meth:`close`.
    """

    def __init__(
        self,
        endpoint: str | None,
        replay_endpoint: str | None = None,
        *,
        topic: str = "kv",
        data_parallel_rank: int = 0,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self.data_parallel_rank = data_parallel_rank
        self.next_seq = 0  # seq of the next batch published
        self.dropped = 0  # batches the PUB socket refused (HWM)
        self._pending: list[kvwire.Event] = []
        self._wake = trio.Event()
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._buffer: collections.deque[tuple[int, bytes, bytes]] = collections.deque(maxlen=REPLAY_BUFFER_STEPS)

    @property
    def enabled(self) -> bool:
        """Return True when events are published anywhere."""
        return self.endpoint is not None

    def emit(self, event: kvwire.Event) -> None:
        """Queue one event for the current step's batch (no-op when disabled). Never blocks."""
        if self.endpoint is None:
            return
        self._pending.append(event)
        self._wake.set()

    def replay_frames(self, start_seq: int) -> list[list[bytes]]:
        """Return the reply frames (after identity) for a replay from ``start_seq``, end marker last."""
        out = [[b"", self.topic, kvwire.encode_seq(seq), payload] for seq, _, payload in self._buffer if seq >= start_seq]
        out.append([b"", b"", kvwire.REPLAY_END_SEQ, b""])
        return out

    def open(self) -> None:
        """Create, bind and connect the sockets (no-op when disabled). Raises zmq.ZMQError; leaves nothing open then."""
        if self.endpoint is None:
            return
        ctx = zmq.Context()
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, SEND_HWM)
            pub.setsockopt(zmq.LINGER, LINGER_MS)
            if endpoint_binds(self.endpoint):
                pub.bind(self.endpoint)
            else:
                pub.connect(self.endpoint)
            if self.replay_endpoint:
                router = ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(self.replay_endpoint)
                self._router = router
        except zmq.ZMQError:
            ctx.destroy(linger=0)
            raise
        self._ctx, self._pub = ctx, pub

    def close(self) -> None:
        """Close the sockets and the context (unsent messages get up to LINGER_MS). Idempotent."""
        if self._ctx is not None:
            if self._router is not None:
                self._router.close()
            if self._pub is not None:
                self._pub.close()
            self._ctx.term()
        self._ctx = self._pub = self._router = None

    async def run(self) -> None:
        """Publish batches and answer replays until cancelled; call after :meth:`open`."""
        if self._pub is None:
            await trio.sleep_forever()
        async with trio.open_nursery() as nursery:
            if self._router is not None:
                nursery.start_soon(self._serve_replays, self._router)
            await self._publish_loop(self._pub)

    async def _publish_loop(self, pub: zmq.Socket) -> None:
        while True:
            await self._wake.wait()
            # One scheduler pass: requests finishing prefill in the same "step" join this batch.
            await trio.lowlevel.cancel_shielded_checkpoint()
            self._wake = trio.Event()
            events, self._pending = self._pending, []
            if events:
                self._publish(pub, events)

    def _publish(self, pub: zmq.Socket, events: list[kvwire.Event]) -> None:
        seq = self.next_seq
        self.next_seq += 1
        payload = kvwire.encode_batch(time.time(), events, self.data_parallel_rank)
        self._buffer.append((seq, self.topic, payload))
        try:
            pub.send_multipart([self.topic, kvwire.encode_seq(seq), payload], zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    async def _serve_replays(self, router: zmq.Socket) -> None:
        fd = router.getsockopt(zmq.FD)
        try:
            while True:
                while router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    frames = router.recv_multipart(zmq.NOBLOCK)
                    self._answer_replay(router, frames)
                await trio.lowlevel.wait_readable(fd)
        finally:
            trio.lowlevel.notify_closing(fd)

    def _answer_replay(self, router: zmq.Socket, frames: list[bytes]) -> None:
        # [identity, b"", start_seq]; anything else is ignored (a stray peer must not kill the engine).
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        identity = frames[0]
        start = kvwire.decode_seq(frames[2])
        for reply in self.replay_frames(start):
            try:
                router.send_multipart([identity, *reply], zmq.NOBLOCK)
            except zmq.Again:
                return  # peer not reading; it will see no end marker and ask again
