"""What saving a model definition will do to its running replicas, said before it happens.

Public API::

    preview(model, fleet, now=trio.current_time(), existed=True) -> Rollout

``preview`` is pure: it counts the model's alive replicas whose fingerprint is not the new
definition's and runs :func:`~llmgw.control.placement.plan` (the rules the reconciler
follows) over a copy of the fleet, pass after pass as if every start became READY, until
the first rollout step says how the rollout goes. ``ctl models add --replace`` prints it.
"""

from __future__ import annotations

from typing import Callable

import attrs

from llmgw.catalog.fingerprint import model_fingerprint, shard_fingerprint
from llmgw.control.placement import (
    ROLLOUT_BLOCKED,
    ROLLOUT_IN_PLACE,
    ROLLOUT_SURGE,
    StartReplica,
    StopReplica,
    Unplaceable,
    Waiting,
    node_counts_alive,
    plan,
)
from llmgw.control.registry import Fleet, ShardView
from llmgw.spec import ModelSpec, ShardState, ShardStatus

#: Rollout.kind: the model was not in the catalog before.
NEW = "new"
#: Rollout.kind: no running replica has an older definition.
UNCHANGED = "unchanged"
#: Rollout.kind: replicas are replaced one at a time, each new one READY before an old one stops.
SURGE = ROLLOUT_SURGE
#: Rollout.kind: no node has room for an extra replica: each old one stops before its replacement starts.
IN_PLACE = ROLLOUT_IN_PLACE
#: Rollout.kind: the new definition fits on no node; the old replicas keep serving.
BLOCKED = ROLLOUT_BLOCKED
#: Rollout.kind: the model's failure backoff holds the rollout for now.
WAITING = "waiting"


@attrs.frozen
class Rollout:
    """What saving ``model`` does: ``kind`` (one of the constants above), ``outdated`` replicas
    to replace, and ``message``, one line for people."""

    model: str
    kind: str
    outdated: int = 0
    message: str = ""


def preview(model: ModelSpec, fleet: Fleet, *, now: float, existed: bool = True) -> Rollout:
    """Returns what saving ``model`` over the running ``fleet`` will do to its replicas.

    ``existed``: the catalog held the model before (a replace). ``now`` is on the fleet's
    clock. Only replicas placement counts as alive (not terminal, node ONLINE or within
    ``replace_grace``) count. Raises nothing.
    """
    name = model.name
    fingerprint = model_fingerprint(model)
    alive = [
        shard
        for node in fleet.nodes.values()
        if node_counts_alive(node, now, fleet.replace_grace)
        for shard in node.shards.values()
        if shard.spec.model == name and not shard.status.state.is_terminal
    ]
    # Outdated replicas beyond the replica count are stopped, not replaced.
    outdated = min(model.profile.replicas, sum(1 for shard in alive if shard_fingerprint(shard.spec) != fingerprint))
    if not outdated:
        if not existed:
            return Rollout(name, NEW, 0, f"{name}: new model: {model.profile.replicas} replica(s) will be placed")
        scale = ""
        if len(alive) != model.profile.replicas:
            scale = f"; replicas {len(alive)} -> {model.profile.replicas}"
        return Rollout(name, UNCHANGED, 0, f"{name}: unchanged: nothing to roll out{scale}")

    step, reason = _first_step(model, fleet, now)
    head = f"{name}: definition changed: {outdated} replica(s) will be replaced one at a time"
    if step == BLOCKED:
        return Rollout(name, BLOCKED, outdated,
                       f"{name}: definition changed, but nothing can be replaced: {reason}")
    if step == WAITING:
        return Rollout(name, WAITING, outdated, f"{head}, once the failure backoff ends ({reason})")
    if step == IN_PLACE:
        return Rollout(name, IN_PLACE, outdated,
                       f"{head} in place: no room for a surge (each old replica stops before its replacement starts)")
    return Rollout(name, SURGE, outdated, f"{head} (new ready before old stops)")


def _first_step(model: ModelSpec, fleet: Fleet, now: float) -> tuple[str, str]:
    """Returns (kind, reason) of the first rollout step placement will take for ``model``.

    Runs :func:`plan` over a copy of ``fleet`` as the reconciler would, pass after pass, as if
    every replica started became READY and every stop succeeded, until a pass takes a rollout
    step, is blocked or waits (at most :data:`SIMULATED_PASSES` passes; the model's own
    replicas already starting count as READY)."""
    name = model.name
    fleet = _ready(fleet, name)
    for _ in range(SIMULATED_PASSES):
        mine = {sid for node in fleet.nodes.values() for sid, sh in node.shards.items() if sh.spec.model == name}
        moves: list[StartReplica | StopReplica] = []
        stuck = ""
        for action in plan([model], fleet, now=now, new_id=_preview_id(fleet)):
            if isinstance(action, StopReplica) and action.shard_id not in mine:
                continue  # another model's shard: not this preview's business
            if isinstance(action, (StartReplica, StopReplica)):
                if action.rollout:
                    return action.rollout, ""
                moves.append(action)
            elif isinstance(action, Unplaceable) and action.model == name:
                if action.rollout:
                    return BLOCKED, action.reason
                stuck = action.reason
            elif isinstance(action, Waiting) and action.model == name:
                return WAITING, action.reason
        if not moves:
            return (BLOCKED, stuck) if stuck else (SURGE, "")
        fleet = _applied(fleet, moves, now)
    return SURGE, ""


#: Passes :func:`_first_step` simulates: enough to place missing replicas and stop surplus ones
#: of any model before its first rollout step (each pass does all of those it can).
SIMULATED_PASSES = 8


def _preview_id(fleet: Fleet) -> Callable[[str], str]:
    """Returns a shard id factory for simulated passes that never repeats an id of ``fleet``."""
    taken = {sid for node in fleet.nodes.values() for sid in node.shards}
    counter = iter(range(1, 1 << 30))

    def new_id(model: str) -> str:
        while True:
            sid = f"{model}-preview-{next(counter)}"
            if sid not in taken:
                return sid

    return new_id


def _ready(fleet: Fleet, model: str) -> Fleet:
    """Returns ``fleet`` with the not-terminal shards of ``model`` READY."""
    nodes = {}
    for nid, node in fleet.nodes.items():
        shards = {
            sid: (attrs.evolve(sh, status=attrs.evolve(sh.status, state=ShardState.READY))
                  if sh.spec.model == model and not sh.status.state.is_terminal else sh)
            for sid, sh in node.shards.items()
        }
        nodes[nid] = attrs.evolve(node, shards=shards)
    return attrs.evolve(fleet, nodes=nodes)


def _applied(fleet: Fleet, moves: list[StartReplica | StopReplica], now: float) -> Fleet:
    """Returns ``fleet`` after ``moves``: stopped shards gone, started ones READY (the newest)."""
    nodes = {nid: dict(node.shards) for nid, node in fleet.nodes.items()}
    for n, move in enumerate(moves):
        if isinstance(move, StopReplica):
            nodes[move.node_id].pop(move.shard_id, None)
        else:
            spec = move.shard_spec
            nodes[move.node_id][spec.id] = ShardView(spec, ShardStatus(id=spec.id, state=ShardState.READY), now + n)
    return attrs.evolve(fleet, nodes={nid: attrs.evolve(node, shards=nodes[nid]) for nid, node in fleet.nodes.items()})
