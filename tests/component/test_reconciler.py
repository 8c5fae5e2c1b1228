"""The reconcile loop against a registry and a fake executor that plays the agents.

Time is trio's MockClock with autojump: waiting out a 60 s grace or a backoff takes no
real time, and nothing here sleeps to synchronise (waits are on registry changes).
"""

from __future__ import annotations

from typing import AsyncIterator, Callable

import attrs
import pytest
import trio
import trio.testing

from llmgw.control import placement
from llmgw.control.reconciler import Reconciler
from llmgw.control.registry import NodeState, Registry
from llmgw.spec import EngineInfo, Hardware, ModelSpec, Profile, ShardSpec, ShardState, ShardStatus, UnknownShard

ENGINES = (EngineInfo("llama.cpp", installed=True),)
LOST_AFTER = 15.0
GRACE = 60.0
HEARTBEAT = 5.0


def hw(mem: int = 16384) -> Hardware:
    return Hardware(cpu_count=8, memory_total_mb=mem, memory_available_mb=mem)


def model(name: str, replicas: int = 1, mem: int = 1024) -> ModelSpec:
    return ModelSpec(name, "llama.cpp", f"/w/{name}", Profile(replicas=replicas, memory_mb=mem))


@attrs.define
class Call:
    at: float
    op: str  # "start" | "stop"
    node_id: str
    shard_id: str
    model: str = ""


class FakeAgents:
    """The executor: records every call and reports shard status back like agents would.

    ``crashing`` models report FAILED right after start; calls to ``refusing`` nodes raise;
    ``gates`` hold a node's calls until the event is set; ``refused_starts`` is how many
    next starts fail without reaching the node; ``forgetful`` nodes answer "unknown shard"
    for a stop of a shard they never started (as a real agent does).
    """

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.calls: list[Call] = []
        self.crashing: set[str] = set()
        self.refusing: set[str] = set()
        self.gates: dict[str, trio.Event] = {}
        self.refused_starts = 0
        self.forgetful: set[str] = set()
        self.started: set[str] = set()
        self.busy: set[str] = set()  # shards whose drain runs out of time (still in flight)
        self.no_drain: set[str] = set()  # nodes whose drain call fails (an older agent)

    async def start_replica(self, node_id: str, spec: ShardSpec) -> None:
        self.calls.append(Call(trio.current_time(), "start", node_id, spec.id, spec.model))
        if node_id in self.gates:
            await self.gates[node_id].wait()
        if node_id in self.refusing:
            raise ConnectionError(f"node {node_id} is unreachable")
        if self.refused_starts:
            self.refused_starts -= 1
            raise OSError(f"node {node_id}: cannot write the shard's state: No space left on device")
        await trio.lowlevel.checkpoint()
        self.started.add(spec.id)
        if spec.model in self.crashing:
            status = ShardStatus(id=spec.id, state=ShardState.FAILED, message="engine exited with status 1")
        else:
            status = ShardStatus(id=spec.id, state=ShardState.READY, endpoint=f"http://{node_id}/{spec.id}")
        self.registry.shard_status(node_id, status)

    async def stop_replica(self, node_id: str, shard_id: str) -> None:
        self.calls.append(Call(trio.current_time(), "stop", node_id, shard_id))
        if node_id in self.refusing:
            raise ConnectionError(f"node {node_id} is unreachable")
        await trio.lowlevel.checkpoint()
        if node_id in self.forgetful and shard_id not in self.started:
            raise UnknownShard(shard_id)
        self.started.discard(shard_id)

    async def drain_replica(self, node_id: str, shard_id: str, timeout: float) -> bool:
        self.calls.append(Call(trio.current_time(), "drain", node_id, shard_id))
        if node_id in self.refusing or node_id in self.no_drain:
            raise ConnectionError(f"node {node_id} has no drain call")
        await trio.lowlevel.checkpoint()
        return shard_id not in self.busy

    def ops(self, op: str) -> list[Call]:
        return [c for c in self.calls if c.op == op]


class Cluster:
    """A registry, its watchdog, heartbeating nodes, fake agents and a running reconciler."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.registry = Registry(lost_after=LOST_AFTER, replace_grace=GRACE)
        self.agents = FakeAgents(self.registry)
        self.catalog: list[ModelSpec] = []
        self.silent: set[str] = set()
        self.epochs: dict[str, int] = {}
        self.catalog_error: Exception | None = None

        async def read_catalog() -> list[ModelSpec]:
            await trio.lowlevel.checkpoint()
            if self.catalog_error is not None:
                raise self.catalog_error
            return list(self.catalog)

        self.reconciler = Reconciler(self.registry, read_catalog, self.agents, new_id=placement.SequentialIds())

    def join(self, node_id: str, mem: int = 16384, shards=()) -> None:
        self.epochs[node_id] = self.registry.node_joined(node_id, f"{node_id}:7000", hw(mem), ENGINES, shards)
        self.silent.discard(node_id)

    async def start(self) -> None:
        await self.nursery.start(self.registry.watchdog)
        self.nursery.start_soon(self._heartbeats)
        await self.nursery.start(self.reconciler.run)

    async def _heartbeats(self) -> None:
        while True:
            await trio.sleep(HEARTBEAT)
            for node_id, epoch in self.epochs.items():
                if node_id not in self.silent:
                    self.registry.heartbeat(node_id, self.registry.snapshot().nodes[node_id].hardware, epoch=epoch)

    async def until(self, pred: Callable[[], bool], timeout: float = 3600) -> None:
        """Wait in trio time until ``pred`` holds; checks on registry changes and each second."""
        with trio.fail_after(timeout):
            while not pred():
                with trio.move_on_after(1):
                    await self.registry.wait_changed(self.registry.version)

    def ready_nodes(self, name: str) -> list[str]:
        return sorted(r.node_id for r in self.registry.replicas_of(name))


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    """A cluster in a nursery; tests also request ``autojump_clock`` (pytest-trio takes the
    clock from the test's own arguments only)."""
    async with trio.open_nursery() as nursery:
        yield Cluster(nursery)
        nursery.cancel_scope.cancel()


async def test_two_replicas_on_two_nodes(cluster: Cluster, autojump_clock: trio.testing.MockClock) -> None:
    cluster.join("a")
    cluster.join("b")
    cluster.catalog = [model("m", replicas=2)]
    await cluster.start()
    await cluster.until(lambda: len(cluster.ready_nodes("m")) == 2)
    assert cluster.ready_nodes("m") == ["a", "b"]
    # Several safety-net passes later nothing else has been asked of the agents.
    passes = cluster.reconciler.passes
    await cluster.until(lambda: cluster.reconciler.passes >= passes + 3)
    assert sorted((c.op, c.node_id) for c in cluster.agents.calls) == [("start", "a"), ("start", "b")]
    assert cluster.reconciler.last_unplaceable == ()


async def test_lost_node_replaced_after_grace_without_touching_it(cluster: Cluster, autojump_clock: trio.testing.MockClock) -> None:
    cluster.join("a", mem=32768)  # most free memory: the replica goes here first
    cluster.join("b")
    cluster.catalog = [model("m")]
    await cluster.start()
    await cluster.until(lambda: cluster.ready_nodes("m") == ["a"])
    (first,) = cluster.agents.calls

    cluster.silent.add("a")
    silenced_at = trio.current_time()
    await cluster.until(lambda: cluster.registry.snapshot().nodes["a"].state is NodeState.LOST)
    lost_since = cluster.registry.snapshot().nodes["a"].lost_since
    assert lost_since is not None and lost_since >= silenced_at
    assert len(cluster.agents.calls) == 1  # within grace: no replacement yet

    await cluster.until(lambda: cluster.ready_nodes("m") == ["b"])
    replacement = cluster.agents.calls[1]
    assert (replacement.op, replacement.node_id) == ("start", "b")
    assert replacement.at >= lost_since + GRACE
    assert [c for c in cluster.agents.calls if c.node_id == "a"] == [first]  # nothing sent to the lost node

    # The node comes back with its replica: one of the two is surplus; the newer one goes.
    cluster.join("a", mem=32768, shards=[(ShardSpec(id=first.shard_id, model="m", engine="llama.cpp", source="/w/m",
                                                    memory_mb=1024),
                                          ShardStatus(id=first.shard_id, state=ShardState.READY, endpoint="http://a/x"))])
    await cluster.until(lambda: cluster.ready_nodes("m") == ["a"])
    assert [(c.op, c.node_id, c.shard_id) for c in cluster.agents.calls[2:]] == [("stop", "b", replacement.shard_id)]


async def test_failed_replica_replaced_with_backoff(cluster: Cluster, autojump_clock: trio.testing.MockClock) -> None:
    cluster.join("a")
    cluster.catalog = [model("m")]
    cluster.agents.crashing.add("m")
    await cluster.start()
    await cluster.until(lambda: len(cluster.agents.ops("start")) >= 5)

    starts = cluster.agents.ops("start")[:5]
    gaps = [b.at - a.at for a, b in zip(starts, starts[1:])]
    for n, gap in enumerate(gaps, start=1):
        # Waits at least the backoff of n failure rounds, and is woken by its end (not the 30 s tick).
        assert placement.backoff_delay(n) <= gap < placement.backoff_delay(n) + 1
    # Every failed shard was asked to stop and is forgotten once stopped.
    stopped = {c.shard_id for c in cluster.agents.ops("stop")}
    assert {s.shard_id for s in starts[:4]} <= stopped
    await cluster.until(lambda: bool(cluster.reconciler.last_waiting))
    assert cluster.reconciler.last_waiting[0].model == "m"
    assert "engine exited with status 1" in cluster.reconciler.last_waiting[0].reason

    # Fixed: the next start succeeds and the failure count is reset.
    cluster.agents.crashing.clear()
    await cluster.until(lambda: cluster.ready_nodes("m") == ["a"])
    await cluster.until(lambda: "m" not in cluster.reconciler.failures)
    live = cluster.registry.snapshot().nodes["a"].shards
    assert [s.status.state for s in live.values()] == [ShardState.READY]


async def test_removed_model_is_stopped(cluster: Cluster, autojump_clock: trio.testing.MockClock) -> None:
    cluster.join("a")
    cluster.join("b")
    cluster.catalog = [model("m", replicas=2), model("keep")]
    await cluster.start()
    await cluster.until(lambda: len(cluster.ready_nodes("m")) == 2 and cluster.ready_nodes("keep"))
    started = {c.shard_id for c in cluster.agents.ops("start") if c.model == "m"}

    cluster.catalog = [model("keep")]
    cluster.reconciler.catalog_changed()
    await cluster.until(lambda: not any(s.model == "m" for n in cluster.registry.snapshot().nodes.values()
                                        for s in n.shards.values()))
    assert {c.shard_id for c in cluster.agents.ops("stop")} == started
    assert cluster.registry.replicas_of("m") == []
    assert len(cluster.ready_nodes("keep")) == 1


async def test_executor_failures_are_retried_not_fatal(cluster: Cluster, autojump_clock: trio.testing.MockClock) -> None:
    cluster.join("a")
    cluster.catalog = [model("m")]
    cluster.agents.refusing.add("a")
    await cluster.start()
    await cluster.until(lambda: len(cluster.agents.ops("start")) >= 2)
    first = cluster.reconciler.failures  # the refused start counts as a failure round
    assert first["m"].count >= 1
    assert "start request failed: ConnectionError: node a is unreachable" in first["m"].last_message

    cluster.agents.refusing.clear()  # the node answers again
    await cluster.until(lambda: cluster.ready_nodes("m") == ["a"])
    shards = cluster.registry.snapshot().nodes["a"].shards
    assert [s.status.state for s in shards.values()] == [ShardState.READY]  # refused ones were cleaned up


async def test_actions_on_different_nodes_run_concurrently(cluster: Cluster, autojump_clock: trio.testing.MockClock) -> None:
    cluster.join("a")
    cluster.join("b")
    cluster.catalog = [model("m", replicas=2)]
    gate = cluster.agents.gates["a"] = trio.Event()  # a's start returns only after b's started

    async def open_gate_when_b_starts() -> None:
        await cluster.until(lambda: any(c.node_id == "b" for c in cluster.agents.calls))
        gate.set()

    cluster.nursery.start_soon(open_gate_when_b_starts)
    await cluster.start()
    # The fake agents report READY during the pass; the pass is recorded when it ends.
    await cluster.until(lambda: len(cluster.ready_nodes("m")) == 2 and cluster.reconciler.last_pass is not None)
    assert cluster.reconciler.last_pass is not None
    assert not cluster.reconciler.last_pass.errors
    assert len(cluster.agents.ops("start")) == 2  # a's start was not timed out and retried


async def test_unplaceable_is_kept_for_display_and_cleared(cluster: Cluster, autojump_clock: trio.testing.MockClock) -> None:
    cluster.join("a", mem=4096)
    cluster.catalog = [model("big", mem=8192)]
    await cluster.start()
    await cluster.until(lambda: bool(cluster.reconciler.last_unplaceable))
    (u,) = cluster.reconciler.last_unplaceable
    assert u.reason == "model big needs 8192 MB memory and engine llama.cpp; node a has 4096 MB free"
    cluster.join("b", mem=65536)  # a registry change: a pass follows
    await cluster.until(lambda: cluster.ready_nodes("big") == ["b"])
    assert cluster.reconciler.last_unplaceable == ()


async def test_unreadable_catalog_stops_nothing(cluster: Cluster, autojump_clock: trio.testing.MockClock) -> None:
    cluster.join("a")
    cluster.catalog = [model("m")]
    await cluster.start()
    await cluster.until(lambda: cluster.ready_nodes("m") == ["a"])

    cluster.catalog_error = OSError("database is locked")  # the store failing under the loop
    cluster.reconciler.catalog_changed()
    await cluster.until(lambda: cluster.reconciler.last_pass is not None and bool(cluster.reconciler.last_pass.skipped))
    assert "database is locked" in cluster.reconciler.last_pass.skipped
    assert cluster.agents.ops("stop") == []
    assert cluster.ready_nodes("m") == ["a"]


async def test_unknown_shard_on_stop_counts_as_stopped(cluster: Cluster, autojump_clock: trio.testing.MockClock) -> None:
    """A start the node refused leaves a FAILED row for a shard the node never had; its stop
    answers "unknown shard": the row goes on that one call (no retries) and the model is placed anew."""
    cluster.join("a")
    cluster.agents.forgetful.add("a")
    cluster.agents.refused_starts = 1
    cluster.catalog = [model("m")]
    await cluster.start()
    await cluster.until(lambda: cluster.ready_nodes("m") == ["a"])
    first, second = cluster.agents.ops("start")
    assert [c.shard_id for c in cluster.agents.ops("stop")] == [first.shard_id]
    passes = cluster.reconciler.passes
    await cluster.until(lambda: cluster.reconciler.passes >= passes + 3)
    assert len(cluster.agents.ops("stop")) == 1 and len(cluster.agents.ops("start")) == 2
    assert cluster.reconciler.last_pass is not None and cluster.reconciler.last_pass.errors == ()
    shards = cluster.registry.snapshot().nodes["a"].shards
    assert list(shards) == [second.shard_id] and shards[second.shard_id].status.state is ShardState.READY


async def test_rollout_drains_each_old_replica_after_its_replacement_is_ready(
        cluster: Cluster, autojump_clock: trio.testing.MockClock) -> None:
    cluster.join("a")
    cluster.catalog = [model("m", replicas=2)]
    await cluster.start()
    await cluster.until(lambda: len(cluster.ready_nodes("m")) == 2)
    old = {r.id for r in cluster.registry.replicas_of("m")}
    routed: list[set[str]] = []  # what the gateway could route to at each stop

    stop_replica = cluster.agents.stop_replica

    async def stop_and_record(node_id: str, shard_id: str) -> None:
        routed.append({r.id for r in cluster.registry.replicas_of("m")})
        await stop_replica(node_id, shard_id)

    cluster.agents.stop_replica = stop_and_record  # type: ignore[method-assign]
    cluster.catalog = [attrs.evolve(model("m", replicas=2), source="/w/m-v2")]
    cluster.reconciler.catalog_changed()
    await cluster.until(lambda: len(cluster.agents.ops("stop")) == 2 and len(cluster.ready_nodes("m")) == 2)
    stops = cluster.agents.ops("stop")
    starts = cluster.agents.ops("start")[2:]
    assert {c.shard_id for c in stops} == old and len(starts) == 2
    # One at a time: each old replica stops only after a new one started before it, and was
    # out of routing (drained) by then while a ready replacement served.
    assert starts[0].at < stops[0].at < starts[1].at < stops[1].at
    for stop, seen in zip(stops, routed):
        assert stop.shard_id not in seen and len(seen) >= 1
    assert not {r.id for r in cluster.registry.replicas_of("m")} & old
    # Each was drained at its engine (out of routing first) right before its stop.
    drains = cluster.agents.ops("drain")
    assert [d.shard_id for d in drains] == [c.shard_id for c in stops]
    assert all(d.at <= c.at for d, c in zip(drains, stops))


@pytest.mark.parametrize("trouble", ["busy", "no_drain"])
async def test_rollout_stops_an_old_replica_its_drain_did_not_empty(
        cluster: Cluster, autojump_clock: trio.testing.MockClock, trouble: str) -> None:
    cluster.join("a")
    cluster.catalog = [model("m")]
    await cluster.start()
    await cluster.until(lambda: len(cluster.ready_nodes("m")) == 1)
    (old,) = {r.id for r in cluster.registry.replicas_of("m")}
    if trouble == "busy":
        cluster.agents.busy.add(old)
    else:
        cluster.agents.no_drain.add("a")
    cluster.catalog = [attrs.evolve(model("m"), source="/w/m-v2")]
    cluster.reconciler.catalog_changed()
    await cluster.until(lambda: [c.shard_id for c in cluster.agents.ops("stop")] == [old])
    assert [d.shard_id for d in cluster.agents.ops("drain")] == [old]
    await cluster.until(lambda: len(cluster.ready_nodes("m")) == 1 and old not in cluster.registry.snapshot().nodes["a"].shards)
