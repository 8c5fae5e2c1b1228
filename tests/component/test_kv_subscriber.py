"""KvSubscriber over real ZMQ sockets: a real ``python -m llmgw.sim`` process, and the sim's
publisher in-process for lost messages (gap filled by replay, resync when replay cannot)
and for a PUB path that delivers nothing (replay-only delivery)."""

from __future__ import annotations

import collections
import os
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx
import pytest
import trio
import zmq

from llmgw import kvhash
from llmgw.node.kvevents import KvSubscriber
from llmgw import kvwire as wire
from llmgw.sim.launch import free_tcp_port, start_sim
from llmgw.sim.publisher import KvEventPublisher
from llmgw.spec import KvDelta

DEADLINE = 20.0
BS = 16
SEED = kvhash.KV_HASH_SEED


class RouterView:
    """What a router would hold after applying every delta sent, in order."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.deltas: list[KvDelta] = []
        self._changed = trio.Condition()

    async def send(self, delta: KvDelta) -> None:
        if delta.reset:
            self.blocks = set(delta.stored)
        else:
            self.blocks |= set(delta.stored)
            self.blocks -= set(delta.removed)
        self.deltas.append(delta)
        async with self._changed:
            self._changed.notify_all()

    async def until(self, predicate, what: str) -> None:
        with trio.fail_after(DEADLINE):
            async with self._changed:
                while not predicate():
                    await self._changed.wait()


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}"


async def test_real_sim_process_blocks_reach_the_view():
    endpoint, replay = endpoints()
    view = RouterView()
    sub = KvSubscriber(endpoint, replay, block_size=BS)
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.run, view.send)
        args = ["--port", "0", "--model", "m", "--block-size", str(BS), "--num-blocks", "8",
                "--kv-events-endpoint", endpoint, "--kv-replay-endpoint", replay]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": SEED}
        sim = await trio.to_thread.run_sync(lambda: start_sim(args, env=env))
        try:
            async with httpx.AsyncClient(base_url=sim.url, timeout=DEADLINE) as http:
                prompt = list(range(100, 100 + 3 * BS + 1))
                expected = set(kvhash.event_hashes(kvhash.block_hashes(prompt, BS, seed=SEED)))
                await http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
                await view.until(lambda: expected <= view.blocks, "the prompt's blocks")
                assert view.deltas[0].reset, "the first send is a full copy"
                assert view.deltas[-1].block_size == BS
                # Evictions: 4 more prompts of 3 blocks overflow an 8-block cache.
                for i in range(4):
                    p = list(range(1000 * (i + 1), 1000 * (i + 1) + 3 * BS + 1))
                    await http.post("/v1/completions", json={"model": "m", "prompt": p, "max_tokens": 1})
                await view.until(lambda: not expected & view.blocks and len(view.blocks) <= 8, "evictions")
                # AllBlocksCleared: the view is reset to nothing.
                assert (await http.post("/reset_prefix_cache")).status_code == 200
                await view.until(lambda: not view.blocks, "the cleared cache")
                assert view.deltas[-1].reset
        finally:
            await trio.to_thread.run_sync(sim.stop)
        assert sub.mirror.blocks == view.blocks
        nursery.cancel_scope.cancel()


class DroppingPub:
    """Wraps a PUB socket; ``drop`` > 0 makes the next sends fail as if past the high-water mark."""

    def __init__(self, pub: zmq.Socket) -> None:
        self.pub = pub
        self.drop = 0

    def send_multipart(self, frames, flags=0):
        if self.drop > 0:
            self.drop -= 1
            raise zmq.Again()
        return self.pub.send_multipart(frames, flags)


async def publisher(endpoint: str, replay: str, *, buffer: int | None = None) -> tuple[KvEventPublisher, DroppingPub]:
    pub = KvEventPublisher(endpoint, replay)
    pub.open()
    if buffer is not None:
        pub._buffer = collections.deque(maxlen=buffer)
    dropping = DroppingPub(pub._pub)
    return pub, dropping


def emit(pub: KvEventPublisher, dropping: DroppingPub, *events) -> None:
    pub._publish(dropping, list(events))


async def wait_connected(pub, dropping, view: RouterView, marker: int) -> None:
    """Publishes ``marker`` blocks until the PUB->SUB connection delivers (slow joiner), by readiness."""
    emit(pub, dropping, wire.block_stored([marker], None, [0] * BS, BS))
    await view.until(lambda: marker in view.blocks, "the connection")


@asynccontextmanager
async def running(*, buffer: int | None = None, publish_to: str | None = None) -> AsyncIterator[
        tuple[RouterView, KvSubscriber, KvEventPublisher, DroppingPub]]:
    """A subscriber on fresh endpoints sending to a RouterView, and the sim's publisher (to
    ``publish_to``, default the subscriber's endpoint; ``buffer``: replay kept), both running.
    Both are stopped and the publisher closed on exit."""
    endpoint, replay = endpoints()
    view = RouterView()
    sub = KvSubscriber(endpoint, replay)
    pub, dropping = await publisher(publish_to or endpoint, replay, buffer=buffer)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sub.run, view.send)
            nursery.start_soon(pub.run)
            yield view, sub, pub, dropping
            nursery.cancel_scope.cancel()
    finally:
        pub.close()


async def test_gap_is_filled_from_replay():
    async with running() as (view, sub, pub, dropping):
        await wait_connected(pub, dropping, view, 1)
        dropping.drop = 2
        emit(pub, dropping, wire.block_stored([2], None, [0] * BS, BS))
        emit(pub, dropping, wire.block_removed([1]))
        assert pub.dropped == 2
        emit(pub, dropping, wire.block_stored([3], None, [0] * BS, BS))  # delivered: reveals the gap
        await view.until(lambda: view.blocks == {2, 3}, "the replayed batches")
        assert sub.gaps == 1 and sub.resyncs == 0
        assert view.deltas[-1].gaps == 1


async def test_gap_replay_cannot_fill_is_a_resync():
    async with running(buffer=1) as (view, sub, pub, dropping):
        await wait_connected(pub, dropping, view, 1)
        dropping.drop = 3
        for h in (2, 3, 4):  # lost, and only the last kept for replay
            emit(pub, dropping, wire.block_stored([h], None, [0] * BS, BS))
        emit(pub, dropping, wire.block_stored([5], None, [0] * BS, BS))
        await view.until(lambda: sub.resyncs == 1 and 5 in view.blocks, "the resync")
        assert view.blocks == sub.mirror.blocks and 1 not in view.blocks, "the mirror was purged"
        assert any(d.reset for d in view.deltas[1:]), "a resync is sent as a reset"
        assert sub.gaps == 1


async def test_silent_pub_path_events_arrive_by_replay():
    # The engine publishes to an endpoint nobody binds: the PUB path delivers nothing at all.
    async with running(publish_to=f"tcp://127.0.0.1:{free_tcp_port()}") as (view, sub, pub, dropping):
        emit(pub, dropping, wire.block_stored([10, 11], None, [0] * 2 * BS, BS))
        emit(pub, dropping, wire.block_removed([10]))
        await view.until(lambda: view.blocks == {11}, "the replayed blocks")
        assert sub.replayed_batches == 2 and sub.gaps == 0 and sub.resyncs == 0


async def test_engine_restart_and_new_session_send_resets():
    async with running() as (view, sub, pub, dropping):
        await wait_connected(pub, dropping, view, 1)
        count = len(view.deltas)
        sub.resend_full()  # a new session: the full copy again
        await view.until(lambda: len(view.deltas) > count, "the full copy")
        assert view.deltas[-1].reset and view.deltas[-1].stored == (1,)
        assert sub.full_copy() == view.deltas[-1]
        sub.engine_restarted()
        await view.until(lambda: not view.blocks, "the reset to nothing")
        assert view.deltas[-1].reset and sub.next_seq == 0


async def test_bind_failure_raises_before_started():
    with zmq.Context() as ctx:
        taken = ctx.socket(zmq.SUB)
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        try:
            sub = KvSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_tcp_port()}")
            with pytest.raises(zmq.ZMQError):
                await sub.run(RouterView().send)
        finally:
            taken.close(linger=0)
