"""What saving a model definition will do to its running replicas, said before it happens.

Public API::

    preview(model, fleet, now=trio.current_time(), existed=True) -> Rollout

``preview`` is pure: it counts the model's alive replicas whose fingerprint is not the new
definition's and asks :func:`~llmgw.control.placement.plan` (the same rules the reconciler
follows) what its first step would be. ``ctl models add --replace`` prints the result.
"""

from __future__ import annotations

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
    plan,
)
from llmgw.control.registry import Fleet, NodeState
from llmgw.spec import ModelSpec

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
        if node.state is NodeState.ONLINE or now - (node.lost_since if node.lost_since is not None else now) < fleet.replace_grace
        for shard in node.shards.values()
        if shard.spec.model == name and not shard.status.state.is_terminal
    ]
    outdated = sum(1 for shard in alive if shard_fingerprint(shard.spec) != fingerprint)
    if not outdated:
        if not existed:
            return Rollout(name, NEW, 0, f"{name}: new model: {model.profile.replicas} replica(s) will be placed")
        scale = ""
        if len(alive) != model.profile.replicas:
            scale = f"; replicas {len(alive)} -> {model.profile.replicas}"
        return Rollout(name, UNCHANGED, 0, f"{name}: unchanged: nothing to roll out{scale}")

    step = ""
    blocked = ""
    waiting = ""
    for action in plan([model], fleet, now=now, new_id=lambda m: f"{m}-preview"):
        if isinstance(action, (StartReplica, Unplaceable)) and action.model != name:
            continue
        if isinstance(action, (StartReplica, StopReplica)) and action.rollout and not step:
            step = action.rollout
        elif isinstance(action, Unplaceable) and action.rollout == ROLLOUT_BLOCKED:
            blocked = action.reason
        elif isinstance(action, Waiting) and action.model == name:
            waiting = action.reason
    head = f"{name}: definition changed: {outdated} replica(s) will be replaced one at a time"
    if blocked:
        return Rollout(name, BLOCKED, outdated,
                       f"{name}: definition changed, but nothing can be replaced: {blocked}")
    if waiting:
        return Rollout(name, WAITING, outdated, f"{head}, once the failure backoff ends ({waiting})")
    if step == IN_PLACE:
        return Rollout(name, IN_PLACE, outdated,
                       f"{head} in place: no room for a surge (each old replica stops before its replacement starts)")
    return Rollout(name, SURGE, outdated, f"{head} (new ready before old stops)")
