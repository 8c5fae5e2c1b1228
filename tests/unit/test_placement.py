"""Placement is a pure function: each case is (desired, fleet, now, failures) -> expected actions."""

from __future__ import annotations

import random

import attrs
import pytest

from llmgw.control.placement import (
    FAILURE_BACKOFF_BASE_S,
    FAILURE_BACKOFF_MAX_S,
    FailureRecord,
    SequentialIds,
    StartReplica,
    StopReplica,
    Unplaceable,
    Waiting,
    backoff_delay,
    note_failures,
    plan,
)
from llmgw.catalog.fingerprint import model_fingerprint
from llmgw.control.registry import Fleet, NodeState, NodeView, ShardView
from llmgw.spec import Adapter, EngineInfo, GpuInfo, Hardware, ModelSpec, Profile, ShardSpec, ShardState, ShardStatus

LLAMA = "llama.cpp"
GRACE = 60.0
NOW = 1000.0


def gpu(index: int, total: int = 81920, free: int | None = None) -> GpuInfo:
    return GpuInfo(index, f"GPU-{index}", "H100", total, total if free is None else free)


def shard(
    sid: str,
    model: str,
    state: ShardState = ShardState.READY,
    *,
    mem: int = 0,
    cores: float = 0.0,
    gpus: tuple[int, ...] = (),
    since: float = 0.0,
    message: str = "",
    fingerprint: str = "",
) -> ShardView:
    # Without a fingerprint the shard's fields give it: those of model(name) with the same resources.
    spec = ShardSpec(id=sid, model=model, engine=LLAMA, source=f"/models/{model}", memory_mb=mem, cpu_cores=cores,
                     gpus=gpus, fingerprint=fingerprint)
    return ShardView(spec, ShardStatus(id=sid, state=state, message=message), since)


def node(
    nid: str,
    *,
    mem: int = 16384,
    cores: int = 8,
    gpus: tuple[GpuInfo, ...] = (),
    engines: tuple[str, ...] = (LLAMA,),
    state: NodeState = NodeState.ONLINE,
    lost_since: float | None = None,
    shards: tuple[ShardView, ...] = (),
    installable: tuple[str, ...] = (),
) -> NodeView:
    infos = tuple(EngineInfo(e, installed=True) for e in engines) + tuple(
        EngineInfo(e, installed=False, installable=True) for e in installable
    )
    return NodeView(
        id=nid,
        address=f"{nid}.example:7000",
        hardware=Hardware(cpu_count=cores, memory_total_mb=mem, memory_available_mb=mem, gpus=gpus),
        engines=infos,
        state=state,
        last_heartbeat=0.0,
        epoch=1,
        shards={s.spec.id: s for s in shards},
        lost_since=lost_since,
    )


def fleet(*nodes: NodeView) -> Fleet:
    return Fleet(nodes={n.id: n for n in nodes}, replace_grace=GRACE)


def model(name: str, replicas: int = 1, *, mem: int = 0, cores: float = 0.0, gpus: int = 0, engine: str = LLAMA) -> ModelSpec:
    return ModelSpec(name, engine, f"/models/{name}", Profile(replicas=replicas, memory_mb=mem, cpu_cores=cores, gpus=gpus))


def summary(actions) -> list[tuple]:
    """Actions as short tuples, so expectations read like a table."""
    out = []
    for a in actions:
        if isinstance(a, StartReplica):
            out.append(("start", a.model, a.node_id, a.shard_spec.gpus) if a.shard_spec.gpus else ("start", a.model, a.node_id))
        elif isinstance(a, StopReplica):
            out.append(("stop", a.node_id, a.shard_id))
        elif isinstance(a, Unplaceable):
            out.append(("unplaceable", a.model, a.missing))
        elif isinstance(a, Waiting):
            out.append(("waiting", a.model))
    return out


def run(desired, f, *, now=NOW, failures=None):
    return plan(desired, f, now=now, failures=failures, new_id=SequentialIds(), new_secret=lambda: "secret")


@attrs.frozen
class Case:
    name: str
    desired: list
    fleet: Fleet
    expected: list
    now: float = NOW
    failures: dict = attrs.field(factory=dict)


CASES = [
    Case("nothing desired, nothing running", [], fleet(node("a")), []),
    Case("no nodes at all", [model("m")], fleet(), [("unplaceable", "m", 1)]),
    Case("two replicas spread over two nodes", [model("m", 2)], fleet(node("a"), node("b")),
         [("start", "m", "a"), ("start", "m", "b")]),
    Case("spread beats free resources: the node without a replica wins",
         [model("m", 2)], fleet(node("a", mem=65536, shards=(shard("m-0", "m"),)), node("b", mem=8192)),
         [("start", "m", "b")]),
    Case("one node: both replicas land on it", [model("m", 2, mem=4096)], fleet(node("a")),
         [("start", "m", "a"), ("start", "m", "a")]),
    Case("most free memory wins", [model("m")], fleet(node("a", mem=8192), node("b", mem=32768), node("c", mem=16384)),
         [("start", "m", "b")]),
    Case("memory fit", [model("m", mem=8192)], fleet(node("a", mem=4096), node("b", mem=8192)),
         [("start", "m", "b")]),
    Case("memory held by other shards is not free",
         [model("m", mem=8192), model("x", mem=30000)],
         fleet(node("a", mem=32768, shards=(shard("x-1", "x", mem=30000),)), node("b", mem=8192)),
         [("start", "m", "b")]),
    Case("reservations planned in the same pass count",
         [model("m", 3, mem=8192)], fleet(node("a", mem=16384)),
         [("start", "m", "a"), ("start", "m", "a"), ("unplaceable", "m", 1)]),
    Case("cores fit", [model("m", cores=4)], fleet(node("a", cores=2, mem=65536), node("b", cores=4)),
         [("start", "m", "b")]),
    Case("cores held by other shards are not free",
         [model("m", cores=4), model("x", cores=6)], fleet(node("a", cores=8, shards=(shard("x-1", "x", cores=6),))),
         [("unplaceable", "m", 1)]),
    Case("GPU replica gets a GPU not held by another shard",
         [model("m", gpus=1, mem=40000), model("x", gpus=1, mem=40000)],
         fleet(node("a", gpus=(gpu(0), gpu(1)), shards=(shard("x-1", "x", gpus=(0,), mem=40000),))),
         [("start", "m", "a", (1,))]),
    Case("GPU without enough free memory is skipped",
         [model("m", gpus=1, mem=40000)], fleet(node("a", gpus=(gpu(0, free=1000), gpu(1), gpu(2)))),
         [("start", "m", "a", (1,))]),
    Case("two-GPU replicas on a four-GPU node",
         [model("m", 3, gpus=2)], fleet(node("a", gpus=tuple(gpu(i) for i in range(4)))),
         [("start", "m", "a", (0, 1)), ("start", "m", "a", (2, 3)), ("unplaceable", "m", 1)]),
    Case("GPU replica prefers the node with most free GPUs",
         [model("m", gpus=1)], fleet(node("a", gpus=(gpu(0),)), node("b", gpus=(gpu(0), gpu(1)))),
         [("start", "m", "b", (0,))]),
    Case("GPU memory of a GPU replica is not host memory",
         [model("m", gpus=1, mem=70000)], fleet(node("a", mem=8192, gpus=(gpu(0),))),
         [("start", "m", "a", (0,))]),
    Case("CPU replica prefers a node without GPUs",
         [model("m")], fleet(node("a", mem=65536, gpus=(gpu(0),)), node("b", mem=8192)),
         [("start", "m", "b")]),
    Case("engine missing", [model("m", engine="vllm")], fleet(node("a")), [("unplaceable", "m", 1)]),
    Case("engine on one node only", [model("m", engine="vllm")], fleet(node("a", mem=65536), node("b", engines=("vllm",))),
         [("start", "m", "b")]),
    Case("lost node within grace: its replica still counts, nothing sent to it",
         [model("m")],
         fleet(node("a", state=NodeState.LOST, lost_since=NOW - GRACE + 1, shards=(shard("m-0", "m"),)), node("b")),
         []),
    Case("lost node beyond grace: replaced elsewhere, nothing sent to it",
         [model("m")],
         fleet(node("a", state=NodeState.LOST, lost_since=NOW - GRACE, shards=(shard("m-0", "m"),)), node("b")),
         [("start", "m", "b")]),
    Case("lost nodes take no new replicas", [model("m")],
         fleet(node("a", state=NodeState.LOST, lost_since=NOW)), [("unplaceable", "m", 1)]),
    Case("scale down: not-ready first, then the newest",
         [model("m", 1)],
         fleet(node("a", shards=(shard("m-old", "m", since=1), shard("m-new", "m", since=5),
                                 shard("m-starting", "m", ShardState.STARTING, since=2)))),
         [("stop", "a", "m-new"), ("stop", "a", "m-starting")]),
    Case("scale down never touches a lost node",
         [model("m", 1)],
         fleet(node("a", state=NodeState.LOST, lost_since=NOW, shards=(shard("m-1", "m", since=9),)),
               node("b", shards=(shard("m-2", "m", since=1),))),
         [("stop", "b", "m-2")]),
    Case("non-terminal states count as alive",
         [model("m", 3)],
         fleet(node("a", shards=(shard("m-1", "m", ShardState.STARTING), shard("m-2", "m", ShardState.RESTARTING),
                                 shard("m-3", "m", ShardState.UNHEALTHY)))),
         []),
    Case("model removed from the catalog: replicas stopped, lost nodes untouched",
         [],
         fleet(node("a", shards=(shard("m-1", "m"),)),
               node("b", state=NodeState.LOST, lost_since=NOW, shards=(shard("m-2", "m"),))),
         [("stop", "a", "m-1")]),
    Case("failed replica: removed and replaced",
         [model("m")], fleet(node("a", shards=(shard("m-1", "m", ShardState.FAILED),))),
         [("stop", "a", "m-1"), ("start", "m", "a")]),
    Case("failed replica within backoff: removed, start waits",
         [model("m")], fleet(node("a", shards=(shard("m-1", "m", ShardState.FAILED),))),
         [("stop", "a", "m-1"), ("waiting", "m")],
         failures={"m": FailureRecord(count=2, last_at=NOW - 1, seen=frozenset({"m-1"}))}),
    Case("backoff over: started again",
         [model("m")], fleet(node("a")),
         [("start", "m", "a")],
         failures={"m": FailureRecord(count=2, last_at=NOW - backoff_delay(2))}),
    Case("backoff does not stop healthy replicas or hold back other models",
         [model("m", 2), model("n")], fleet(node("a", shards=(shard("m-1", "m"),))),
         [("start", "n", "a"), ("waiting", "m")],
         failures={"m": FailureRecord(count=1, last_at=NOW)}),
    Case("stopped shard is cleaned up",
         [model("m")], fleet(node("a", shards=(shard("m-1", "m", ShardState.STOPPED), shard("m-2", "m")))),
         [("stop", "a", "m-1")]),
    Case("largest replicas are placed first",
         [model("small", mem=4000), model("big", mem=8000)], fleet(node("a", mem=8000), node("b", mem=4000)),
         [("start", "big", "a"), ("start", "small", "b")]),
    Case("zero replicas wanted", [model("m", 0)], fleet(node("a", shards=(shard("m-1", "m"),))),
         [("stop", "a", "m-1")]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan(case: Case) -> None:
    actions = run(case.desired, case.fleet, now=case.now, failures=case.failures)
    assert summary(actions) == case.expected


def test_start_spec_carries_profile_and_fresh_ids() -> None:
    m = ModelSpec("m", LLAMA, "/w/m.gguf", Profile(replicas=2, memory_mb=2048, cpu_cores=2, engine_args=("-c", "4096"),
                                                   engine_env={"OMP_NUM_THREADS": "2"}))
    f = fleet(node("a", shards=(shard("m-1", "m", fingerprint=model_fingerprint(m)),)), node("b"))
    ids = iter(["m-1", "m-1", "m-7"])  # the first two collide with the running shard
    (start,) = plan([m], f, now=NOW, new_id=lambda _: next(ids), new_secret=lambda: "s3cret")
    assert start.shard_spec == ShardSpec(
        id="m-7", model="m", engine=LLAMA, source="/w/m.gguf", args=("-c", "4096"),
        env={"OMP_NUM_THREADS": "2"}, memory_mb=2048, cpu_cores=2.0, gpus=(), api_key="s3cret",
        fingerprint=model_fingerprint(m),
    )


def test_each_new_shard_gets_its_own_engine_secret_kept_out_of_its_repr() -> None:
    m = ModelSpec("m", LLAMA, "/w/m.gguf", Profile(replicas=3, memory_mb=1024))
    starts = plan([m], fleet(node("a"), node("b"), node("c")), now=NOW)
    keys = [s.shard_spec.api_key for s in starts]
    assert len(starts) == 3 and len(set(keys)) == 3 and all(len(k) >= 43 for k in keys)
    assert all(k not in repr(s) for k, s in zip(keys, starts))


def test_start_spec_carries_the_models_adapters() -> None:
    adapters = (Adapter("sql", "hf://org/sql"), Adapter("chat", "/w/chat"))
    m = ModelSpec("m", "vllm", "/w/m", Profile(replicas=1), adapters=adapters, max_loaded_adapters=1)
    (start,) = plan([m], fleet(node("a", engines=("vllm",))), now=NOW, new_id=lambda _: "m-1")
    assert start.shard_spec.adapters == adapters and start.shard_spec.max_loaded_adapters == 1


def test_unplaceable_reason_names_each_node() -> None:
    f = fleet(node("a", mem=4096, engines=("vllm",)), node("b", mem=65536))
    (u,) = run([model("m1", mem=8192, engine="vllm")], f)
    assert u.reason == "model m1 needs 8192 MB memory and engine vllm; node a has 4096 MB free; node b has no vllm installed"


def test_unplaceable_reason_gpus_cores_and_installable() -> None:
    f = fleet(
        node("a", cores=2, gpus=(gpu(0), gpu(1, free=100)), engines=("vllm",)),
        node("b", engines=(), installable=("vllm",)),
    )
    (u,) = run([model("m", gpus=2, mem=40000, cores=4, engine="vllm")], f)
    assert u.reason == (
        "model m needs 2 GPUs with 40000 MB free each, 4 cores and engine vllm; "
        "node a has 1 of 2 GPUs free with 40000 MB free and 2 cores free; "
        "node b has vllm installable but not installed"
    )


def test_unplaceable_reason_summarises_large_fleets() -> None:
    nodes = [node(f"n{i:03}", mem=1024) for i in range(10)] + [node(f"x{i:03}", engines=()) for i in range(5)]
    (u,) = run([model("m", mem=2048)], fleet(*nodes))
    assert u.reason.startswith("model m needs 2048 MB memory and engine llama.cpp; node n000 has 1024 MB free;")
    assert u.reason.endswith("and 11 more nodes (5 without llama.cpp installed, 6 short of memory)")


def test_unplaceable_reason_when_all_nodes_are_lost() -> None:
    f = fleet(node("a", state=NodeState.LOST, lost_since=NOW))
    (u,) = run([model("m")], f)
    assert u.reason == "model m needs engine llama.cpp; no node is ONLINE (1 LOST: a)"


def test_deterministic_regardless_of_node_order() -> None:
    rng = random.Random(7)
    nodes = [node(f"n{i}", mem=rng.choice([8192, 16384]), cores=rng.choice([4, 8]),
                  gpus=tuple(gpu(j) for j in range(rng.choice([0, 2])))) for i in range(40)]
    desired = [model(f"m{i}", rng.randint(1, 4), mem=rng.choice([0, 2048, 4096]), gpus=rng.choice([0, 0, 1]))
               for i in range(15)]
    first = run(desired, fleet(*nodes))
    rng.shuffle(nodes)
    again = run(list(reversed(desired)), fleet(*nodes))
    assert first == again
    assert sum(isinstance(a, StartReplica) for a in first) > 20


def test_no_node_is_overcommitted_and_no_gpu_is_shared() -> None:
    rng = random.Random(3)
    nodes = [node(f"n{i}", mem=16384, cores=8, gpus=tuple(gpu(j) for j in range(rng.choice([0, 4]))))
             for i in range(30)]
    desired = [model(f"m{i}", rng.randint(1, 6), mem=rng.choice([1024, 4096]), cores=rng.choice([0, 1, 2]),
                     gpus=rng.choice([0, 1, 2])) for i in range(25)]
    actions = run(desired, fleet(*nodes))
    mem: dict[str, int] = {}
    cores: dict[str, float] = {}
    gpus: dict[str, list[int]] = {}
    for a in actions:
        if isinstance(a, StartReplica):
            s = a.shard_spec
            if s.gpus:
                gpus.setdefault(a.node_id, []).extend(s.gpus)
            else:
                mem[a.node_id] = mem.get(a.node_id, 0) + s.memory_mb
            cores[a.node_id] = cores.get(a.node_id, 0) + s.cpu_cores
    assert mem and gpus
    assert all(v <= 16384 for v in mem.values())
    assert all(v <= 8 for v in cores.values())
    assert all(len(v) == len(set(v)) for v in gpus.values())


def test_plan_does_not_modify_its_inputs() -> None:
    f = fleet(node("a", shards=(shard("m-1", "m", ShardState.FAILED),)))
    before = attrs.asdict(f, recurse=True)
    run([model("m", 2)], f)
    assert attrs.asdict(f, recurse=True) == before


# -- failure book ------------------------------------------------------------------------


def test_backoff_delay_doubles_up_to_the_cap() -> None:
    assert backoff_delay(0) == 0
    assert [backoff_delay(n) for n in (1, 2, 3)] == [FAILURE_BACKOFF_BASE_S * k for k in (1, 2, 4)]
    assert backoff_delay(100) == FAILURE_BACKOFF_MAX_S


def test_note_failures_counts_rounds_once_per_shard() -> None:
    f1 = fleet(node("a", shards=(shard("m-1", "m", ShardState.FAILED, message="exit 1"),
                                 shard("m-2", "m", ShardState.FAILED))))
    book = note_failures({}, f1, now=10)
    assert book["m"].count == 1 and book["m"].last_at == 10  # two shards failing together: one round
    assert note_failures(book, f1, now=20) == book  # the same FAILED shards are not counted again
    f2 = fleet(node("a", shards=(shard("m-3", "m", ShardState.FAILED),)))
    book = note_failures(book, f2, now=30)
    assert (book["m"].count, book["m"].last_at, book["m"].seen) == (2, 30, frozenset({"m-3"}))
    assert book["m"].retry_at == 30 + backoff_delay(2)


def test_note_failures_resets_only_on_a_replica_ready_after_the_failure() -> None:
    book = {"m": FailureRecord(count=3, last_at=50)}
    older_ready = fleet(node("a", shards=(shard("m-1", "m", since=40),)))
    assert note_failures(book, older_ready, now=60)["m"].count == 3
    newer_ready = fleet(node("a", shards=(shard("m-2", "m", since=55),)))
    assert "m" not in note_failures(book, newer_ready, now=60)


def labelled(nid: str, node_labels: dict[str, str], **kwargs) -> NodeView:
    return attrs.evolve(node(nid, **kwargs), labels=node_labels)


def test_node_labels_place_replicas_only_on_nodes_carrying_every_label() -> None:
    m = attrs.evolve(model("m", replicas=2), profile=Profile(replicas=2, node_labels={"rack": "r1"}))
    f = fleet(labelled("a", {"rack": "r1"}), labelled("b", {"rack": "r2"}), node("c"),
              labelled("d", {"rack": "r1", "gpu": "a100"}))
    assert sorted(summary(run([m], f))) == [("start", "m", "a"), ("start", "m", "d")]
    # Crowding never overrides labels: a third replica doubles up on a matching node, never b or c.
    three = attrs.evolve(m, profile=attrs.evolve(m.profile, replicas=3))
    assert sorted(summary(run([three], f))) == [("start", "m", "a"), ("start", "m", "a"), ("start", "m", "d")]


def test_unplaceable_reason_names_the_labels_wanted_and_each_nodes_own() -> None:
    m = attrs.evolve(model("m"), profile=Profile(node_labels={"rack": "r9"}))
    (u,) = run([m], fleet(labelled("a", {"rack": "r1"}), node("b")))
    assert u.reason == ("model m needs engine llama.cpp on a node labelled rack=r9; node a is labelled rack=r1; "
                        "node b is labelled -")


def test_node_labels_change_the_fingerprint_only_when_set() -> None:
    plain = model("m")
    assert model_fingerprint(attrs.evolve(plain, profile=Profile(node_labels={}))) == model_fingerprint(plain)
    r1 = attrs.evolve(plain, profile=Profile(node_labels={"rack": "r1"}))
    r2 = attrs.evolve(plain, profile=Profile(node_labels={"rack": "r2"}))
    assert len({model_fingerprint(plain), model_fingerprint(r1), model_fingerprint(r2)}) == 3


def test_a_rollout_for_new_labels_surges_onto_a_matching_node() -> None:
    old = model("m")
    new = attrs.evolve(old, profile=Profile(node_labels={"rack": "r2"}))
    f = fleet(labelled("a", {"rack": "r1"}, shards=(shard("m-1", "m", fingerprint=model_fingerprint(old)),)),
              labelled("b", {"rack": "r2"}))
    (start,) = run([new], f)
    assert isinstance(start, StartReplica) and start.node_id == "b"


def mig(card: int, n: int, free: int = 20000, cls: str = "a100-80g-mig-1g.20gb") -> GpuInfo:
    return GpuInfo(1000 + 100 * card + n, f"MIG-{card}-{n}", "A100 MIG 1g.20gb", 20096, free, cls)


def whole(index: int) -> GpuInfo:
    return GpuInfo(index, f"GPU-{index}", "A100", 81920, 81920, "a100-80g")


def test_a_mig_class_replica_takes_one_instance_and_carries_its_uuid() -> None:
    m = ModelSpec("m", LLAMA, "/w/m", Profile(replicas=2, gpus=1, gpu_class="a100-80g-mig-1g.20gb"))
    starts = run([m], fleet(node("a", gpus=(mig(0, 0), mig(0, 1), whole(1)))))
    assert sorted((s.shard_spec.gpus, s.shard_spec.gpu_uuids) for s in starts) == [
        ((1000,), ("MIG-0-0",)), ((1001,), ("MIG-0-1",))]


def test_a_multi_gpu_replica_never_takes_mig_instances_and_says_why() -> None:
    pair = ModelSpec("m", LLAMA, "/w/m", Profile(gpus=2))
    (u,) = run([pair], fleet(node("a", gpus=(mig(0, 0), mig(0, 1), whole(1)))))
    assert isinstance(u, Unplaceable) and "node a has 1 of 3 whole GPUs free" in u.reason
    (start,) = run([pair], fleet(node("a", gpus=(mig(0, 0), whole(1), whole(2)))))
    assert start.shard_spec.gpus == (1, 2) and start.shard_spec.gpu_uuids == ("GPU-1", "GPU-2")


def test_a_gpu_class_places_only_on_that_class() -> None:
    m = ModelSpec("m", LLAMA, "/w/m", Profile(gpus=1, gpu_class="h100-80g"))
    (u,) = run([m], fleet(node("a", gpus=(whole(0),))))
    assert u.reason == ("model m needs 1 GPU of class h100-80g and engine llama.cpp; "
                        "node a has 0 of 1 GPUs of class h100-80g free")
