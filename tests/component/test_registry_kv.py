"""Registry.on_shard_gone: when a shard's KV-cache state must be dropped by the gateway."""

from __future__ import annotations

import trio
import trio.testing

from llmgw.control.registry import Registry
from llmgw.spec import EngineInfo, Hardware, ShardSpec, ShardState, ShardStatus

HW = Hardware(cpu_count=8, memory_total_mb=16384, memory_available_mb=12000)
ENGINES = (EngineInfo("sim", installed=True, version="1"),)


def spec(sid: str) -> ShardSpec:
    return ShardSpec(id=sid, model="m", engine="sim", source="/w")


def status(sid: str, state: ShardState) -> ShardStatus:
    return ShardStatus(id=sid, state=state, endpoint=f"http://127.0.0.1/{sid}")


def registry() -> tuple[Registry, list[str]]:
    reg = Registry(lost_after=5, replace_grace=5)
    gone: list[str] = []
    reg.on_shard_gone = gone.append
    return reg, gone


async def test_stopping_failing_and_removed_shards_are_gone_once() -> None:
    reg, gone = registry()
    epoch = reg.node_joined("a", "h", HW, ENGINES, [(spec(s), status(s, ShardState.READY)) for s in ("s1", "s2", "s3")])
    reg.shard_status("a", status("s1", ShardState.UNHEALTHY), epoch=epoch)
    reg.shard_status("a", status("s1", ShardState.RESTARTING), epoch=epoch)
    assert gone == [], "an unhealthy or restarting engine reports its own reset"
    reg.shard_status("a", status("s1", ShardState.STOPPING), epoch=epoch)
    reg.shard_status("a", status("s1", ShardState.STOPPED), epoch=epoch)
    reg.shard_status("a", status("s2", ShardState.FAILED), epoch=epoch)
    reg.shard_removed("a", "s3")
    assert gone == ["s1", "s2", "s3"]


async def test_lost_forgotten_and_unreported_shards_are_gone(autojump_clock: trio.testing.MockClock) -> None:
    reg, gone = registry()
    epoch = reg.node_joined("a", "h", HW, ENGINES, [(spec(s), status(s, ShardState.READY)) for s in ("s1", "s2")])
    reg.node_disconnected("a", epoch)
    assert gone == [], "a DISCONNECTED node's engines still serve, with their cache"
    async with trio.open_nursery() as nursery:
        await nursery.start(reg.watchdog)
        with trio.fail_after(60):
            while not gone:
                await reg.wait_changed(reg.version)
        nursery.cancel_scope.cancel()
    assert sorted(gone) == ["s1", "s2"], "LOST: no longer counted"
    gone.clear()
    reg.node_joined("a", "h", HW, ENGINES, [(spec("s1"), status("s1", ShardState.READY))])
    assert gone == ["s2"], "the new registration no longer has it"
    gone.clear()
    reg.forget_node("a")
    assert gone == ["s1"]


async def test_silent_node_marked_lost_by_the_watchdog(autojump_clock: trio.testing.MockClock) -> None:
    reg, gone = registry()
    reg.node_joined("b", "h", HW, ENGINES, [(spec("s9"), status("s9", ShardState.READY))])
    async with trio.open_nursery() as nursery:
        await nursery.start(reg.watchdog)
        with trio.fail_after(60):
            while not gone:
                await reg.wait_changed(reg.version)
        nursery.cancel_scope.cancel()
    assert gone == ["s9"]


async def test_a_failing_callback_does_not_break_the_registry() -> None:
    reg = Registry()

    def boom(_: str) -> None:
        raise RuntimeError("gateway bug")

    reg.on_shard_gone = boom
    reg.node_joined("a", "h", HW, ENGINES, [(spec("s1"), status("s1", ShardState.READY))])
    reg.shard_removed("a", "s1")
    assert "s1" not in reg.snapshot().nodes["a"].shards
