"""The registry as the RPC layer drives it; time is trio's MockClock (autojump), never real sleeps."""

from __future__ import annotations

from typing import Callable

import attrs
import pytest
import trio
import trio.testing

from llmgw.control.registry import NodeState, ReadyReplica, Registry, StaleSession, UnknownNode
from llmgw.spec import EngineInfo, GpuInfo, Hardware, ShardSpec, ShardState, ShardStatus

HW = Hardware(cpu_count=8, memory_total_mb=16384, memory_available_mb=12000)
ENGINES = (EngineInfo("llama.cpp", installed=True, version="b1"),)


def spec(sid: str, model: str = "m") -> ShardSpec:
    return ShardSpec(id=sid, model=model, engine="llama.cpp", source="/w")


def ready(sid: str, endpoint: str = "") -> ShardStatus:
    return ShardStatus(id=sid, state=ShardState.READY, endpoint=endpoint or f"http://127.0.0.1/{sid}")


async def until(reg: Registry, pred: Callable[[], bool], timeout: float = 10_000) -> None:
    """Wait (in trio time) for ``pred`` to hold, re-checking on every registry change."""
    with trio.fail_after(timeout):
        while True:
            seen = reg.version
            if pred():
                return
            await reg.wait_changed(seen)


def state(reg: Registry, node_id: str) -> NodeState:
    return reg.snapshot().nodes[node_id].state


async def test_join_snapshot_and_reports() -> None:
    reg = Registry()
    e1 = reg.node_joined("a", "10.0.0.1", HW, ENGINES, [(spec("m-1"), ready("m-1"))])
    e2 = reg.node_joined("b", "10.0.0.2", HW, ENGINES)
    assert e2 > e1
    before = reg.snapshot()
    a = before.nodes["a"]
    assert (a.state, a.address, a.epoch, a.engine("llama.cpp")) == (NodeState.ONLINE, "10.0.0.1", e1, ENGINES[0])
    assert a.shards["m-1"].status.state is ShardState.READY

    reg.shard_started("b", spec("m-2"))
    assert reg.snapshot().nodes["b"].shards["m-2"].status.state is ShardState.STARTING
    assert reg.shard_status("b", ShardStatus(id="m-2", state=ShardState.READY, endpoint="http://b:1"), epoch=e2)
    assert not reg.shard_status("b", ready("nope"))  # unknown shard: dropped
    assert "m-2" not in before.nodes["b"].shards  # snapshots do not change afterwards

    new_hw = Hardware(cpu_count=8, memory_total_mb=16384, memory_available_mb=1000)
    reg.heartbeat("a", new_hw, epoch=e1)
    assert reg.snapshot().nodes["a"].hardware == new_hw

    reg.shard_removed("a", "m-1")
    reg.shard_removed("a", "m-1")  # idempotent
    reg.shard_removed("zz", "m-1")
    assert reg.snapshot().nodes["a"].shards == {}


async def test_errors_name_the_problem() -> None:
    reg = Registry()
    with pytest.raises(UnknownNode, match="'x' has not joined"):
        reg.heartbeat("x", HW)
    old = reg.node_joined("a", "h", HW, ENGINES)
    new = reg.node_joined("a", "h", HW, ENGINES)
    with pytest.raises(StaleSession, match=f"session {old} was replaced by session {new}"):
        reg.heartbeat("a", HW, epoch=old)
    with pytest.raises(StaleSession):
        reg.shard_status("a", ready("s"), epoch=old)
    assert not reg.node_disconnected("a", old)  # the old session's end does not touch the new one
    assert state(reg, "a") is NodeState.ONLINE
    assert reg.node_disconnected("a", new)
    assert state(reg, "a") is NodeState.DISCONNECTED


async def test_replicas_of_lists_ready_endpoints_on_online_nodes() -> None:
    reg = Registry()
    ea = reg.node_joined("a", "h", HW, ENGINES, [(spec("m-1"), ready("m-1", "http://a:1")),
                                                  (spec("m-2"), ShardStatus(id="m-2", state=ShardState.STARTING)),
                                                  (spec("n-1", "n"), ready("n-1", "http://a:2"))])
    reg.node_joined("b", "h", HW, ENGINES, [(spec("m-3"), ready("m-3", "http://b:1"))])
    assert reg.replicas_of("m") == [
        ReadyReplica(id="m-1", model="m", endpoint="http://a:1", node_id="a", engine="llama.cpp"),
        ReadyReplica(id="m-3", model="m", endpoint="http://b:1", node_id="b", engine="llama.cpp"),
    ]
    reg.node_disconnected("a", ea)
    assert [r.id for r in reg.replicas_of("m")] == ["m-1", "m-3"], "a DISCONNECTED node's replicas still serve"
    assert reg.ready_replicas() == {"m": reg.replicas_of("m"), "n": reg.replicas_of("n")}
    assert [r.id for r in reg.replicas_of("n")] == ["n-1"]
    reg.forget_node("b")
    assert [r.id for r in reg.replicas_of("m")] == ["m-1"]
    assert "b" not in reg.snapshot().nodes


async def test_changes_wake_waiters_and_chatter_does_not() -> None:
    reg = Registry()
    e = reg.node_joined("a", "h", HW, ENGINES, [(spec("m-1"), ShardStatus(id="m-1", state=ShardState.STARTING))])
    v = reg.version
    # A heartbeat with the same capacity and a status with the same state are not news.
    reg.heartbeat("a", Hardware(cpu_count=8, memory_total_mb=16384, memory_available_mb=5), epoch=e)
    reg.shard_status("a", ShardStatus(id="m-1", state=ShardState.STARTING, message="loading"))
    assert reg.version == v
    assert reg.snapshot().nodes["a"].shards["m-1"].status.message == "loading"  # but the view is current

    woke: list[int] = []

    async def waiter() -> None:
        woke.append(await reg.wait_changed(v))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == []
        reg.shard_status("a", ready("m-1"))
    assert woke == [v + 1]

    gpu_hw = Hardware(cpu_count=8, memory_total_mb=16384, memory_available_mb=5,
                      gpus=(GpuInfo(0, "u", "L4", 24000, 24000),))
    reg.heartbeat("a", gpu_hw)
    assert reg.version == v + 2  # capacity changed: placement should look again


async def test_watchdog_marks_silent_node_lost_then_announces_grace(autojump_clock: trio.testing.MockClock) -> None:
    reg = Registry(lost_after=15, replace_grace=60)
    reg.node_joined("a", "h", HW, ENGINES, [(spec("m-1"), ready("m-1"))])
    eb = reg.node_joined("b", "h", HW, ENGINES)
    t0 = trio.current_time()

    async def heartbeats_of_b() -> None:
        while True:
            await trio.sleep(5)
            reg.heartbeat("b", HW, epoch=eb)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeats_of_b)
        await nursery.start(reg.watchdog)
        await until(reg, lambda: state(reg, "a") is NodeState.LOST)
        lost = reg.snapshot().nodes["a"]
        assert lost.lost_since is not None and lost.lost_since - t0 >= 15
        assert lost.shards["m-1"].status.state is ShardState.READY  # shards are kept, not touched
        assert reg.replicas_of("m") == []  # but not routed to

        v = reg.version
        await reg.wait_changed(v)  # the next change is the grace running out
        assert trio.current_time() - lost.lost_since >= 60
        assert state(reg, "b") is NodeState.ONLINE

        # Rejoining with the same id: ONLINE again with exactly the shards it reports.
        reg.node_joined("a", "h2", HW, ENGINES, [(spec("m-9"), ready("m-9"))])
        back = reg.snapshot().nodes["a"]
        assert (back.state, back.address, sorted(back.shards)) == (NodeState.ONLINE, "h2", ["m-9"])
        nursery.cancel_scope.cancel()


async def test_heartbeat_revives_a_node_lost_on_the_same_session(autojump_clock: trio.testing.MockClock) -> None:
    reg = Registry(lost_after=10, replace_grace=30)
    e = reg.node_joined("a", "h", HW, ENGINES)
    async with trio.open_nursery() as nursery:
        await nursery.start(reg.watchdog)
        await until(reg, lambda: state(reg, "a") is NodeState.LOST)
        reg.heartbeat("a", HW, epoch=e)
        assert state(reg, "a") is NodeState.ONLINE
        assert reg.snapshot().nodes["a"].lost_since is None
        nursery.cancel_scope.cancel()


async def test_rejoin_keeps_age_of_known_shards(autojump_clock: trio.testing.MockClock) -> None:
    reg = Registry()
    reg.node_joined("a", "h", HW, ENGINES, [(spec("m-1"), ready("m-1"))])
    first = reg.snapshot().nodes["a"].shards["m-1"].since
    await trio.sleep(100)  # time passing, not synchronisation
    reg.node_joined("a", "h", HW, ENGINES, [(spec("m-1"), ready("m-1")), (spec("m-2"), ready("m-2"))])
    shards = reg.snapshot().nodes["a"].shards
    assert shards["m-1"].since == first
    assert shards["m-2"].since == first + 100


async def test_disconnected_node_serves_until_lost_after_then_grace(autojump_clock: trio.testing.MockClock) -> None:
    reg = Registry(lost_after=10, replace_grace=30)
    e = reg.node_joined("a", "h", HW, ENGINES, [(spec("m-1"), ready("m-1"))])
    async with trio.open_nursery() as nursery:
        await nursery.start(reg.watchdog)
        await trio.sleep(5)  # time passing, not synchronisation
        t0 = trio.current_time()
        reg.node_disconnected("a", e)
        view = reg.snapshot().nodes["a"]
        assert (view.state, view.lost_since) == (NodeState.DISCONNECTED, t0)
        assert [r.id for r in reg.replicas_of("m")] == ["m-1"]
        await until(reg, lambda: state(reg, "a") is NodeState.LOST)
        assert trio.current_time() - t0 >= 10
        assert reg.snapshot().nodes["a"].lost_since == t0, "the grace counts from the disconnect"
        assert reg.replicas_of("m") == []
        await reg.wait_changed(reg.version)  # the next change is the grace running out
        assert trio.current_time() - t0 >= 30
        nursery.cancel_scope.cancel()


def adopted(sid: str, pid: int) -> ShardStatus:
    return ShardStatus(id=sid, state=ShardState.STARTING, pid=pid, message="adopted; checking its health")


async def test_rejoin_keeps_an_adopted_ready_engine_routable() -> None:
    reg = Registry()
    serving = attrs.evolve(ready("m-1", "http://a:1"), pid=41)
    e = reg.node_joined("a", "h", HW, ENGINES, [(spec("m-1"), serving), (spec("m-2"), ready("m-2"))])
    reg.node_disconnected("a", e)
    v = reg.version
    # The new agent adopted the engine (same pid) and re-checks it: still routed, no change.
    e = reg.node_joined("a", "h", HW, ENGINES, [(spec("m-1"), adopted("m-1", 41)), (spec("m-2"), adopted("m-2", 7))])
    assert [r.id for r in reg.replicas_of("m")] == ["m-1"], "m-2 had no pid: a different process"
    assert reg.shard_status("a", adopted("m-1", 41), epoch=e)
    assert reg.replicas_of("m")[0].endpoint == "http://a:1"
    assert reg.version == v + 1
    # Its next report (READY again, or anything else) is taken as it is.
    reg.shard_status("a", ShardStatus(id="m-1", state=ShardState.UNHEALTHY, pid=41), epoch=e)
    assert reg.replicas_of("m") == []
    reg.shard_status("a", ShardStatus(id="m-1", state=ShardState.STARTING, pid=41), epoch=e)
    assert reg.snapshot().nodes["a"].shards["m-1"].state is ShardState.STARTING


async def test_rejoin_with_another_engine_process_is_not_held() -> None:
    reg = Registry()
    e = reg.node_joined("a", "h", HW, ENGINES, [(spec("m-1"), attrs.evolve(ready("m-1"), pid=41))])
    reg.node_disconnected("a", e)
    reg.node_joined("a", "h", HW, ENGINES, [(spec("m-1"), adopted("m-1", 42))])
    assert reg.replicas_of("m") == []


async def test_shard_owner_follows_joins_starts_and_removals() -> None:
    reg = Registry()
    reg.node_joined("a", "h", HW, ENGINES, [(spec("m-1"), ready("m-1"))])
    reg.shard_started("a", spec("m-2"))
    assert (reg.shard_owner("m-1"), reg.shard_owner("m-2"), reg.shard_owner("m-3")) == ("a", "a", None)
    reg.shard_removed("a", "m-2")
    assert reg.shard_owner("m-2") is None
    reg.node_joined("a", "h", HW, ENGINES)  # rejoined without it
    assert reg.shard_owner("m-1") is None
    reg.node_joined("b", "h", HW, ENGINES, [(spec("m-1"), ready("m-1"))])
    reg.forget_node("b")
    assert reg.shard_owner("m-1") is None
