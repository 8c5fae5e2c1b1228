"""Rollouts: the model fingerprint, and placement replacing outdated replicas one at a time."""

from __future__ import annotations

import attrs
import pytest

from llmgw.catalog.fingerprint import model_fingerprint, shard_fingerprint
from llmgw.control.placement import (
    ROLLOUT_BLOCKED,
    ROLLOUT_IN_PLACE,
    ROLLOUT_SURGE,
    FailureRecord,
    SequentialIds,
    StartReplica,
    StopReplica,
    Unplaceable,
    Waiting,
    plan,
)
from llmgw.control.registry import NodeState, NodeView, ShardView
from llmgw.spec import Adapter, GpuInfo, ModelSpec, Profile, ShardSpec, ShardState, ShardStatus
from tests.unit.test_placement import NOW, fleet
from tests.unit.test_placement import node as placement_node

SIM = "sim"

OLD = ModelSpec("m", SIM, "sim-src", Profile(replicas=2, memory_mb=1000, engine_args=("--decode-us-per-token=10",)))
NEW = attrs.evolve(OLD, profile=attrs.evolve(OLD.profile, engine_args=("--decode-us-per-token=20",)))


def running(sid: str, model: ModelSpec, state: ShardState = ShardState.READY, *, since: float = 0.0,
            gpus: tuple[int, ...] = ()) -> ShardView:
    p = model.profile
    spec = ShardSpec(id=sid, model=model.name, engine=model.engine, source=model.source, args=p.engine_args,
                     env=p.engine_env, memory_mb=p.memory_mb, cpu_cores=p.cpu_cores, gpus=gpus,
                     adapters=model.adapters, max_loaded_adapters=model.max_loaded_adapters,
                     fingerprint=model_fingerprint(model))
    return ShardView(spec, ShardStatus(id=sid, state=state), since)


def node(nid: str, *shards: ShardView, mem: int = 16384, gpus: tuple[GpuInfo, ...] = (),
         state: NodeState = NodeState.ONLINE) -> NodeView:
    return placement_node(nid, mem=mem, gpus=gpus, engines=(SIM,), state=state, shards=shards,
                          lost_since=None if state is NodeState.ONLINE else NOW)


def run(desired, f, failures=None):
    return plan(desired, f, now=NOW, failures=failures, new_id=SequentialIds())


# -- the fingerprint -----------------------------------------------------------------------


def test_fingerprint_is_stable_and_short() -> None:
    assert model_fingerprint(OLD) == model_fingerprint(attrs.evolve(OLD))
    assert len(model_fingerprint(OLD)) == 16 and int(model_fingerprint(OLD), 16) >= 0


@pytest.mark.parametrize("change", [
    lambda m: attrs.evolve(m, engine="vllm"),
    lambda m: attrs.evolve(m, source="other"),
    lambda m: attrs.evolve(m, profile=attrs.evolve(m.profile, engine_args=("--decode-us-per-token=20",))),
    lambda m: attrs.evolve(m, profile=attrs.evolve(m.profile, engine_env={"A": "1"})),
    lambda m: attrs.evolve(m, profile=attrs.evolve(m.profile, memory_mb=2000)),
    lambda m: attrs.evolve(m, profile=attrs.evolve(m.profile, cpu_cores=2)),
    lambda m: attrs.evolve(m, profile=attrs.evolve(m.profile, gpus=1)),
    lambda m: attrs.evolve(m, adapters=(Adapter("a", "x"),)),
    lambda m: attrs.evolve(m, max_loaded_adapters=1),
], ids=["engine", "source", "args", "env", "memory", "cores", "gpus", "adapters", "max_loaded_adapters"])
def test_fingerprint_changes_with_every_shard_deciding_field(change) -> None:
    assert model_fingerprint(change(OLD)) != model_fingerprint(OLD)


def test_fingerprint_ignores_replicas_name_and_env_order() -> None:
    a = attrs.evolve(OLD, profile=attrs.evolve(OLD.profile, engine_env={"A": "1", "B": "2"}))
    b = attrs.evolve(a, name="other", profile=attrs.evolve(a.profile, replicas=7, engine_env={"B": "2", "A": "1"}))
    assert model_fingerprint(a) == model_fingerprint(b)


def test_a_shard_without_a_fingerprint_gets_the_one_its_fields_give() -> None:
    gpu_model = attrs.evolve(OLD, profile=attrs.evolve(OLD.profile, gpus=2))
    spec = attrs.evolve(running("m-1", gpu_model, gpus=(3, 5)).spec, fingerprint="")
    assert shard_fingerprint(spec) == model_fingerprint(gpu_model)  # GPU indices are placement's, not the model's
    assert shard_fingerprint(attrs.evolve(spec, fingerprint="abc")) == "abc"


def test_placed_shards_carry_their_models_fingerprint() -> None:
    (start, _) = run([NEW], fleet(node("a")))
    assert start.shard_spec.fingerprint == model_fingerprint(NEW) == shard_fingerprint(
        attrs.evolve(start.shard_spec, fingerprint=""))


# -- the rollout ---------------------------------------------------------------------------


def steps(actions) -> list[tuple]:
    out = []
    for a in actions:
        if isinstance(a, StartReplica):
            out.append(("start", a.node_id, a.rollout))
        elif isinstance(a, StopReplica):
            out.append(("stop", a.shard_id, a.rollout))
        elif isinstance(a, Unplaceable):
            out.append(("unplaceable", a.rollout))
        elif isinstance(a, Waiting):
            out.append(("waiting",))
    return out


def test_unchanged_model_does_nothing() -> None:
    assert run([OLD], fleet(node("a", running("m-1", OLD), running("m-2", OLD)))) == []


def test_changed_model_surges_one_new_replica_first() -> None:
    actions = run([NEW], fleet(node("a", running("m-1", OLD), running("m-2", OLD))))
    assert steps(actions) == [("start", "a", ROLLOUT_SURGE)]
    assert actions[0].shard_spec.fingerprint == model_fingerprint(NEW)


def test_nothing_stops_while_the_replacement_is_not_ready() -> None:
    f = fleet(node("a", running("m-1", OLD), running("m-2", OLD), running("m-3", NEW, ShardState.STARTING)))
    assert run([NEW], f) == []


def test_a_ready_replacement_stops_the_oldest_outdated_replica() -> None:
    f = fleet(node("a", running("m-1", OLD, since=5), running("m-2", OLD, since=1), running("m-3", NEW, since=9)))
    assert steps(run([NEW], f)) == [("stop", "m-2", ROLLOUT_SURGE)]


def test_a_not_ready_outdated_replica_goes_first() -> None:
    f = fleet(node("a", running("m-1", OLD, ShardState.UNHEALTHY, since=5), running("m-2", OLD, since=1),
                   running("m-3", NEW, since=9)))
    assert steps(run([NEW], f)) == [("stop", "m-1", ROLLOUT_SURGE)]


def test_the_next_replica_surges_once_the_first_is_replaced() -> None:
    f = fleet(node("a", running("m-1", OLD), running("m-3", NEW)))
    assert steps(run([NEW], f)) == [("start", "a", ROLLOUT_SURGE)]


def test_done_when_every_replica_is_current() -> None:
    assert run([NEW], fleet(node("a", running("m-3", NEW), running("m-4", NEW)))) == []


def test_no_room_for_a_surge_replaces_in_place() -> None:
    f = fleet(node("a", running("m-1", OLD, since=1), running("m-2", OLD, since=2), mem=2000))
    actions = run([NEW], f)
    assert steps(actions) == [("stop", "m-1", ROLLOUT_IN_PLACE)]
    assert "no node has room" in actions[0].reason


def test_in_place_then_the_missing_replica_is_placed_with_the_new_definition() -> None:
    f = fleet(node("a", running("m-2", OLD), mem=2000))
    (start,) = run([NEW], f)
    assert start.rollout == "" and start.shard_spec.fingerprint == model_fingerprint(NEW)


def test_in_place_needs_a_node_the_new_definition_fits_once_the_old_replica_is_gone() -> None:
    bigger = attrs.evolve(NEW, profile=attrs.evolve(NEW.profile, memory_mb=1500))
    f = fleet(node("a", running("m-1", OLD), mem=1200), node("b", running("m-2", OLD), mem=1600))
    assert steps(run([attrs.evolve(bigger, profile=attrs.evolve(bigger.profile, replicas=2))], f)) == [
        ("stop", "m-2", ROLLOUT_IN_PLACE)]


def test_gpu_replica_in_place_gets_the_old_replicas_gpus_back() -> None:
    old = attrs.evolve(OLD, profile=attrs.evolve(OLD.profile, replicas=1, gpus=1, memory_mb=1000))
    new = attrs.evolve(old, profile=attrs.evolve(old.profile, engine_args=("--x=1",)))
    f = fleet(node("a", running("m-1", old, gpus=(0,)), gpus=(GpuInfo(0, "g", "H100", 8000, 8000),)))
    assert steps(run([new], f)) == [("stop", "m-1", ROLLOUT_IN_PLACE)]


def test_a_definition_that_fits_nowhere_keeps_the_old_replicas() -> None:
    huge = attrs.evolve(NEW, profile=attrs.evolve(NEW.profile, memory_mb=50000))
    (u,) = run([huge], fleet(node("a", running("m-1", OLD), running("m-2", OLD))))
    assert u.rollout == ROLLOUT_BLOCKED and "2 outdated replica(s) keep serving" in u.reason


def test_failure_backoff_holds_the_rollout() -> None:
    f = fleet(node("a", running("m-1", OLD), running("m-2", OLD)))
    assert steps(run([NEW], f, failures={"m": FailureRecord(count=1, last_at=NOW)})) == [("waiting",)]


def test_missing_replicas_come_before_the_rollout() -> None:
    (start,) = run([NEW], fleet(node("a", running("m-1", OLD))))
    assert start.rollout == "" and start.shard_spec.fingerprint == model_fingerprint(NEW)


def test_scale_down_with_a_changed_definition_stops_outdated_replicas_first() -> None:
    one = attrs.evolve(NEW, profile=attrs.evolve(NEW.profile, replicas=1))
    f = fleet(node("a", running("m-1", OLD), running("m-2", OLD)))
    assert steps(run([one], f)) == [("stop", "m-1", "")]


def test_outdated_replicas_on_a_disconnected_node_are_not_stopped() -> None:
    f = fleet(node("a", running("m-1", OLD), state=NodeState.DISCONNECTED), node("b", running("m-2", NEW)))
    one = attrs.evolve(NEW, profile=attrs.evolve(NEW.profile, replicas=1))
    assert run([one], f) == []


def test_rollout_of_one_model_leaves_others_alone() -> None:
    other = ModelSpec("o", SIM, "o", Profile(replicas=1))
    f = fleet(node("a", running("m-1", OLD), running("m-2", OLD), running("o-1", other)))
    assert steps(run([NEW, other], f)) == [("start", "a", ROLLOUT_SURGE)]


# -- the fingerprint travels: over the wire, and in the agent's shard state -------------------


def test_fingerprint_crosses_the_wire() -> None:
    from llmgw.rpc import convert, schema

    s = schema.load()
    spec = running("m-1", NEW).spec
    msg = s.ShardSpec.new_message(**convert.shard_spec_dict(spec))
    with s.ShardSpec.from_bytes(msg.to_bytes()) as r:
        assert convert.shard_spec_from(r).fingerprint == model_fingerprint(NEW)


def test_agent_state_keeps_the_fingerprint(tmp_path) -> None:
    from llmgw.node import shard_state

    spec = running("m-1", NEW).spec
    shard_state.save(tmp_path, shard_state.ShardRecord(spec=spec, port=1))
    [loaded] = shard_state.load_all(tmp_path)
    assert loaded.spec.fingerprint == model_fingerprint(NEW)
    data = loaded.to_json()
    del data["spec"]["fingerprint"]  # a record written before fingerprints existed
    assert shard_state.ShardRecord.from_json(data).spec.fingerprint == ""


# -- what `ctl models add --replace` says -------------------------------------------------------


def test_preview_of_a_new_model() -> None:
    from llmgw.control import rollout

    p = rollout.preview(NEW, fleet(node("a")), now=NOW, existed=False)
    assert (p.kind, p.outdated, p.message) == ("new", 0, "m: new model: 2 replica(s) will be placed")


def test_preview_unchanged_and_scaled() -> None:
    from llmgw.control import rollout

    f = fleet(node("a", running("m-1", OLD), running("m-2", OLD)))
    assert rollout.preview(OLD, f, now=NOW).message == "m: unchanged: nothing to roll out"
    three = attrs.evolve(OLD, profile=attrs.evolve(OLD.profile, replicas=3))
    p = rollout.preview(three, f, now=NOW)
    assert (p.kind, p.message) == ("unchanged", "m: unchanged: nothing to roll out; replicas 2 -> 3")


def test_preview_surge_in_place_and_blocked() -> None:
    from llmgw.control import rollout

    roomy = fleet(node("a", running("m-1", OLD), running("m-2", OLD)))
    p = rollout.preview(NEW, roomy, now=NOW)
    assert (p.kind, p.outdated) == ("surge", 2)
    assert p.message == "m: definition changed: 2 replica(s) will be replaced one at a time (new ready before old stops)"
    tight = fleet(node("a", running("m-1", OLD), running("m-2", OLD), mem=2000))
    p = rollout.preview(NEW, tight, now=NOW)
    assert (p.kind, p.outdated) == ("in-place", 2) and "in place: no room for a surge" in p.message
    huge = attrs.evolve(NEW, profile=attrs.evolve(NEW.profile, memory_mb=50000))
    p = rollout.preview(huge, roomy, now=NOW)
    assert p.kind == "blocked" and "keep serving" in p.message


def test_preview_ignores_other_models_and_failed_replicas() -> None:
    from llmgw.control import rollout

    other = ModelSpec("o", SIM, "o", Profile(replicas=1))
    f = fleet(node("a", running("m-1", NEW), running("m-2", OLD, ShardState.FAILED), running("o-1", other)))
    assert rollout.preview(NEW, f, now=NOW).kind == "unchanged"


def test_preview_looks_past_a_surge_under_way() -> None:
    from llmgw.control import rollout

    # A third replica (a surge of an earlier change) runs; the newest definition fits nowhere:
    # the surplus is stopped first, then nothing can be replaced.
    f = fleet(node("a", running("m-1", OLD), running("m-2", OLD), running("m-3", NEW, ShardState.STARTING)))
    huge = attrs.evolve(NEW, profile=attrs.evolve(NEW.profile, memory_mb=50000))
    p = rollout.preview(huge, f, now=NOW)
    assert (p.kind, p.outdated) == ("blocked", 2)
    newest = attrs.evolve(NEW, source="v3")
    p = rollout.preview(newest, f, now=NOW)
    assert (p.kind, p.outdated) == ("surge", 2)


def test_preview_places_missing_replicas_before_judging() -> None:
    from llmgw.control import rollout

    f = fleet(node("a", running("m-1", OLD), mem=2500))  # room for 2 replicas of 1000 MB, not 3
    p = rollout.preview(NEW, f, now=NOW)
    assert (p.kind, p.outdated) == ("in-place", 1)
