"""The leader's live view of the fleet: nodes, their hardware and their shards.

Everything here is rebuilt from what agents report (registrations, heartbeats, shard
status reports); nothing is read from the store. The RPC layer feeds a
:class:`Registry`; placement reads immutable :class:`Fleet` snapshots of it; the
gateway reads :meth:`Registry.replicas_of`; the reconciler and the gateway wait on
:meth:`Registry.wait_changed`.

Public API (all methods are synchronous and must be called from the trio thread,
except the two ``async`` ones)::

    reg = Registry(lost_after=15.0, replace_grace=60.0)
    epoch = reg.node_joined(node_id, address, hardware, engines, [(spec, status), ...])
    reg.heartbeat(node_id, hardware, telemetry=t, epoch=epoch)  # telemetry, epoch optional
    reg.shard_status(node_id, status, epoch=epoch)          # -> bool (False: shard unknown)
    reg.shard_started(node_id, spec)                        # placement reserved it: STARTING
    reg.shard_removed(node_id, shard_id)                    # idempotent
    reg.shard_owner(shard_id) -> str | None                 # the node holding that shard id
    reg.node_disconnected(node_id, epoch)                   # -> bool; DISCONNECTED (False: stale session)
    reg.forget_node(node_id)                                # -> bool; operator removed the node
    reg.shard_draining(node_id, shard_id)                   # -> bool; out of routing before a rollout stops it
    reg.snapshot() -> Fleet                                 # immutable, for placement/display
    reg.replicas_of(model) -> list[ReadyReplica]            # READY shards on ONLINE/DISCONNECTED nodes
    reg.ready_replicas() -> dict[str, list[ReadyReplica]]   # the whole table, for the gateway
    reg.version -> int;  await reg.wait_changed(since) -> int
    await nursery.start(reg.watchdog)                       # marks silent or long-gone nodes LOST
    reg.on_shard_gone = callback                            # (shard id) when its reports stop counting

Errors: calls about a node that never joined (or was forgotten) raise
:class:`UnknownNode`; calls carrying an ``epoch`` of a session that was superseded by a
newer join raise :class:`StaleSession`. Both tell the caller the agent must join again.

A node whose session ends is DISCONNECTED, not LOST: an agent restart, crash or upgrade
leaves its engines serving, so its READY shards stay in the gateway's table (the
gateway's own upstream failures take a dead one out of a request's choice) until
``lost_after`` passes without a new session; then it is LOST and its shards are no
longer routed to. A LOST node keeps its shards in the view (its engines may well still
be serving): nothing here stops anything, and placement only replaces them
``replace_grace`` seconds after the node stopped being ONLINE. A node that joins again
with the same id becomes ONLINE with exactly the shards it reports; a shard that was
READY and comes back STARTING on the same engine process (the new agent adopted it and
is re-checking its health) stays routable until the agent reports another state.
"""

from __future__ import annotations

import enum
import logging
import math
from typing import Callable, Iterable, Mapping, Sequence

import attrs
import trio

from llmgw.config.defaults import DEFAULT_NODE_LOST_AFTER, DEFAULT_REPLACE_GRACE
from llmgw.spec import EngineInfo, Hardware, ShardSpec, ShardState, ShardStatus
from llmgw.telemetry import NodeTelemetry

log = logging.getLogger(__name__)

# How long a silent node stays ONLINE and how long a LOST node's replicas wait before
# being replaced are server.yaml settings (node_lost_after, replace_grace); their defaults
# and reasons are in llmgw.config.defaults.
# The watchdog checks at most this often. Heartbeats of thousands of nodes arrive at
# spread-out times; waking for every single deadline would rescan the fleet constantly.
# A node is therefore marked LOST at most this much later than ``lost_after``.
WATCHDOG_RESOLUTION_S = 0.5


class NodeState(str, enum.Enum):
    ONLINE = "online"  # in session and heartbeating
    LOST = "lost"  # silent for longer than lost_after, or disconnected for longer than that
    DISCONNECTED = "disconnected"  # its session ended less than lost_after ago: replicas still routed


class RegistryError(Exception):
    """A report the registry cannot accept; the agent should join again."""


class UnknownNode(RegistryError):
    def __init__(self, node_id: str) -> None:
        super().__init__(
            f"node {node_id!r} has not joined this control plane (or was forgotten); "
            "its agent must join again"
        )
        self.node_id = node_id


class StaleSession(RegistryError):
    def __init__(self, node_id: str, epoch: int, current: int) -> None:
        super().__init__(
            f"node {node_id!r}: session {epoch} was replaced by session {current}; "
            "reports from the old session are ignored"
        )
        self.node_id = node_id
        self.epoch = epoch
        self.current = current


@attrs.frozen
class ShardView:
    """One shard as the registry knows it. ``since`` is when it first appeared here
    (trio clock): placement stops the newest surplus replicas first."""

    spec: ShardSpec
    status: ShardStatus
    since: float

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def state(self) -> ShardState:
        return self.status.state


@attrs.frozen
class NodeView:
    """One node at snapshot time. ``lost_since`` is set while the node is not ONLINE
    (DISCONNECTED or LOST): when it stopped being ONLINE.
    ``shards`` maps shard id to :class:`ShardView`; do not mutate it."""

    id: str
    address: str
    hardware: Hardware
    engines: tuple[EngineInfo, ...]
    state: NodeState
    last_heartbeat: float
    epoch: int
    shards: Mapping[str, ShardView] = attrs.field(factory=dict)
    lost_since: float | None = None
    #: The node's labels (agent.yaml ``labels``): profiles' ``node_labels`` select nodes by them.
    labels: Mapping[str, str] = attrs.field(factory=dict)
    #: The last telemetry the node sent (None: none yet, or an agent from before issue 16),
    #: with its ages as received, and when it was received (the registry's clock).
    telemetry: NodeTelemetry | None = None
    telemetry_received: float = 0.0

    def live_telemetry(self, now: float) -> NodeTelemetry | None:
        """Returns the node's telemetry as it stands at ``now`` (the registry's clock), its ages
        grown and every reading older than READING_MAX_AGE_S left out; None if it sent none."""
        if self.telemetry is None:
            return None
        return self.telemetry.fresh(max(0.0, now - self.telemetry_received))

    def engine(self, name: str) -> EngineInfo | None:
        """Return this node's report for engine ``name``, or None if it has none."""
        for e in self.engines:
            if e.name == name:
                return e
        return None


@attrs.frozen
class Fleet:
    """An immutable snapshot of the registry, the input of placement.

    ``replace_grace`` is the registry's setting: a DISCONNECTED or LOST node's replicas
    count as alive until ``lost_since + replace_grace``. ``version`` is the registry version it was
    taken at. ``nodes`` maps node id to :class:`NodeView`; do not mutate it.
    """

    nodes: Mapping[str, NodeView] = attrs.field(factory=dict)
    replace_grace: float = DEFAULT_REPLACE_GRACE
    version: int = 0


@attrs.frozen
class ReadyReplica:
    """A READY shard on an ONLINE or DISCONNECTED node: something the gateway may route to.
    Field names match ``llmgw.router.replicas.Replica``."""

    id: str
    model: str
    endpoint: str
    node_id: str
    engine: str = ""  # the shard's engine name ("vllm", "llama.cpp", "sim", ...)
    adapters: tuple[tuple[str, str], ...] = ()  # (adapter name, path on the node), in the engine's order
    api_key: str = attrs.field(default="", repr=False)  # the engine's secret (ShardSpec.api_key)


@attrs.define
class _Shard:
    spec: ShardSpec
    status: ShardStatus
    since: float
    #: The READY status kept while a new agent re-checks the same adopted engine (see
    #: :func:`_held_ready`); None once the agent reports anything else.
    held: ShardStatus | None = None


@attrs.define
class _Node:
    id: str
    address: str
    hardware: Hardware
    engines: tuple[EngineInfo, ...]
    epoch: int
    last_heartbeat: float
    state: NodeState = NodeState.ONLINE
    lost_since: float | None = None
    grace_announced: bool = False
    shards: dict[str, _Shard] = attrs.field(factory=dict)
    labels: Mapping[str, str] = attrs.field(factory=dict)
    telemetry: NodeTelemetry | None = None
    telemetry_received: float = 0.0


def _held_ready(prev: _Shard | None, spec: ShardSpec, status: ShardStatus) -> ShardStatus | None:
    """Returns the READY status to keep for a shard reported as ``status``, or None.

    A new agent adopts a running engine as STARTING and re-checks its health before it
    says READY again; the engine served all along. When ``prev`` (what the registry
    knew) was READY with an endpoint, has the same spec, and ``status`` is STARTING on
    the same engine process (same non-zero pid), the READY status is kept, so an agent
    restart does not take the replica out of the gateway's table.
    """
    if prev is None or prev.spec != spec:
        return None
    before = prev.held or prev.status
    if (before.state is ShardState.READY and before.endpoint and status.state is ShardState.STARTING
            and status.pid and status.pid == before.pid):
        return before
    return None


def _placement_facts(hw: Hardware) -> tuple:
    """The parts of a node's hardware whose change should trigger a new placement pass
    (free memory figures change every heartbeat and are picked up by periodic passes)."""
    return (hw.cpu_count, hw.memory_total_mb, tuple((g.index, g.memory_total_mb) for g in hw.gpus))


class Registry:
    """The live fleet view. See the module docstring for the API.

    ``clock`` returns the current time (default: ``trio.current_time``, so the
    registry follows trio's clock, MockClock included).
    """

    def __init__(
        self,
        *,
        lost_after: float = DEFAULT_NODE_LOST_AFTER,
        replace_grace: float = DEFAULT_REPLACE_GRACE,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        if lost_after <= 0 or replace_grace < 0:
            raise ValueError(
                f"lost_after must be > 0 and replace_grace >= 0 (got {lost_after}, {replace_grace})"
            )
        self.lost_after = lost_after
        self.replace_grace = replace_grace
        self._clock = clock
        self._nodes: dict[str, _Node] = {}
        self._epochs = 0
        self._version = 0
        self._changed = trio.Event()
        self._views: dict[str, NodeView] = {}  # cache; a node's entry is dropped on change
        self._by_model: dict[str, set[tuple[str, str]]] = {}  # model -> {(node_id, shard_id)}
        self._owners: dict[str, str] = {}  # shard id -> node id
        self._draining: set[str] = set()  # shard ids taken out of routing before their stop
        #: Called with a shard id when what its agent reported about it stops holding: the shard
        #: stopped, failed or was removed, its node was lost or forgotten, or it is missing from
        #: the node's new registration (the gateway then drops the shard's KV-cache state).
        self.on_shard_gone: Callable[[str], None] | None = None

    # -- change notification -------------------------------------------------------

    @property
    def version(self) -> int:
        """A counter bumped on every change that may alter placement or routing."""
        return self._version

    async def wait_changed(self, since: int) -> int:
        """Wait until :attr:`version` is greater than ``since``; return the new version.

        Returns at once if it already is. Cancellation just stops the wait.
        """
        while self._version <= since:
            await self._changed.wait()
        return self._version

    def _bump(self) -> None:
        self._version += 1
        self._changed.set()
        self._changed = trio.Event()

    def _touch(self, node_id: str) -> None:
        self._views.pop(node_id, None)

    # -- reports from agents ---------------------------------------------------------

    def node_joined(
        self,
        node_id: str,
        address: str,
        hardware: Hardware,
        engines: Sequence[EngineInfo],
        shards: Iterable[tuple[ShardSpec, ShardStatus]] = (),
        labels: Mapping[str, str] | None = None,
    ) -> int:
        """Record a (re)join of ``node_id`` (carrying ``labels``) and return its new session epoch.

        The node becomes ONLINE with exactly the ``shards`` it reports (shards known
        from an earlier session keep their ``since``; one that was READY and is reported
        STARTING on the same engine process stays READY, see :func:`_held_ready`).
        Epochs increase across all nodes, so a report tagged with an older epoch can be
        told apart and refused.
        """
        now = self._clock()
        self._epochs += 1
        old = self._nodes.get(node_id)
        if old is not None:
            self._unindex(old)
        node = _Node(
            id=node_id,
            address=address,
            hardware=hardware,
            engines=tuple(engines),
            epoch=self._epochs,
            last_heartbeat=now,
            labels=dict(labels or {}),
        )
        for spec, status in shards:
            if status.id != spec.id:
                raise ValueError(f"node {node_id!r} reported status for {status.id!r} with spec {spec.id!r}")
            prev = old.shards.get(spec.id) if old is not None else None
            held = _held_ready(prev, spec, status)
            node.shards[spec.id] = _Shard(spec, held or status, prev.since if prev is not None else now, held)
        if old is not None:
            self._gone(k for k in old.shards if k not in node.shards)
        self._nodes[node_id] = node
        self._index(node)
        self._touch(node_id)
        if old is not None and old.state is not NodeState.ONLINE:
            log.info("node %s is back (session %d, was %s) with %d shard(s)",
                     node_id, node.epoch, old.state.value, len(node.shards))
        else:
            log.info("node %s joined (session %d) with %d shard(s)", node_id, node.epoch, len(node.shards))
        self._bump()
        return node.epoch

    def heartbeat(
        self, node_id: str, hardware: Hardware, *, telemetry: NodeTelemetry | None = None, epoch: int | None = None
    ) -> None:
        """Record a heartbeat with the node's current hardware figures and telemetry (None:
        the agent sent none; the last one is kept and ages out).

        A LOST node that heartbeats on its current session becomes ONLINE again.
        Raises :class:`UnknownNode` or :class:`StaleSession`.
        """
        node = self._live(node_id, epoch)
        node.last_heartbeat = self._clock()
        changed = _placement_facts(node.hardware) != _placement_facts(hardware)
        if changed:
            old = node.hardware
            log.info("node %s now has %d CPUs, %d MB memory and %d GPU(s) (was %d, %d MB and %d): placing with that",
                     node_id, hardware.cpu_count, hardware.memory_total_mb, len(hardware.gpus), old.cpu_count,
                     old.memory_total_mb, len(old.gpus))
        node.hardware = hardware
        if telemetry is not None:
            node.telemetry, node.telemetry_received = telemetry, node.last_heartbeat
        if node.state is not NodeState.ONLINE:
            log.info("node %s is heartbeating again", node_id)
            node.state = NodeState.ONLINE
            node.lost_since = None
            node.grace_announced = False
            changed = True
        self._touch(node_id)
        if changed:
            self._bump()

    def engines_changed(self, node_id: str, engines: Sequence[EngineInfo], *, epoch: int | None = None) -> None:
        """Record a node's new engine list (install progress included).

        Wakes waiters when the list changed: placement sees the new engines, and its
        refusal text the install progress. Raises :class:`UnknownNode` or
        :class:`StaleSession`.
        """
        node = self._live(node_id, epoch)
        engines = tuple(engines)
        if node.engines == engines:
            return
        before = {e.name: e for e in node.engines if e.installed}
        after = {e.name: e for e in engines if e.installed}
        for name in sorted(before.keys() ^ after.keys()):
            if name in after:
                log.info("node %s now has engine %s %s: placing with it", node_id, name, after[name].version)
            else:
                log.info("node %s no longer has engine %s: %s", node_id, name,
                         next((e.detail for e in engines if e.name == name), "") or "not reported")
        node.engines = engines
        self._touch(node_id)
        self._bump()

    def shard_status(self, node_id: str, status: ShardStatus, *, epoch: int | None = None) -> bool:
        """Record the latest status of one shard; return False if the shard is unknown
        (e.g. already removed after a stop), in which case the report is dropped.

        Notifies waiters only when the state or the endpoint changed.
        Raises :class:`UnknownNode` or :class:`StaleSession`.
        """
        node = self._live(node_id, epoch)
        shard = node.shards.get(status.id)
        if shard is None:
            return False
        if shard.held is not None:
            if _held_ready(shard, shard.spec, status) is not None:
                return True  # the new agent is still re-checking the engine that was serving
            shard.held = None
        before = shard.status
        shard.status = status
        self._touch(node_id)
        ending = (ShardState.FAILED, ShardState.STOPPED, ShardState.STOPPING)
        if status.state in ending and before.state not in ending:
            self._gone([status.id])
        if before.state is not status.state or before.endpoint != status.endpoint:
            if status.state is ShardState.FAILED:
                log.warning("shard %s on node %s failed: %s", status.id, node_id, status.message)
            self._bump()
        return True

    def shard_started(self, node_id: str, spec: ShardSpec) -> None:
        """Record that placement reserved ``spec`` on ``node_id`` (state STARTING until
        the agent reports). Raises :class:`UnknownNode`."""
        node = self._node(node_id)
        status = ShardStatus(id=spec.id, state=ShardState.STARTING, message="placed; start requested")
        prev = node.shards.get(spec.id)
        if prev is not None:
            self._unindex_one(node_id, prev.spec)
        node.shards[spec.id] = _Shard(spec, status, prev.since if prev else self._clock())
        self._by_model.setdefault(spec.model, set()).add((node_id, spec.id))
        self._owners[spec.id] = node_id
        self._touch(node_id)
        self._bump()

    def shard_draining(self, node_id: str, shard_id: str) -> bool:
        """Take one shard out of routing ahead of its stop (a rollout replaces it): from now on
        :meth:`replicas_of` leaves it out, whatever its agent reports, until it is removed.
        Returns False (and changes nothing) if the node or the shard is unknown."""
        node = self._nodes.get(node_id)
        if node is None or shard_id not in node.shards:
            return False
        if shard_id not in self._draining:
            self._draining.add(shard_id)
            self._bump()
        return True

    def shard_removed(self, node_id: str, shard_id: str) -> None:
        """Forget one shard (it was stopped). Does nothing if node or shard is unknown."""
        node = self._nodes.get(node_id)
        if node is None:
            return
        shard = node.shards.pop(shard_id, None)
        self._draining.discard(shard_id)
        if shard is None:
            return
        self._gone([shard_id])
        self._unindex_one(node_id, shard.spec)
        self._touch(node_id)
        self._bump()

    def node_disconnected(self, node_id: str, epoch: int, *, expected: bool = False) -> bool:
        """The session ``epoch`` of ``node_id`` ended: mark the node DISCONNECTED now.

        Its READY shards stay routable; the watchdog marks it LOST once ``lost_after``
        passes without a new session. Returns False (and changes nothing) if the node is
        unknown or has joined again since (a newer epoch). No shard is stopped. ``expected``:
        this control plane ended the session (it stops, or closed it): logged at INFO, not as a warning.
        """
        node = self._nodes.get(node_id)
        if node is None or node.epoch != epoch:
            return False
        if node.state is NodeState.ONLINE:
            log.log(logging.INFO if expected else logging.WARNING,
                    "node %s disconnected (session %d); its replicas stay routed for up to %.1f s",
                    node_id, epoch, self.lost_after)
            node.state = NodeState.DISCONNECTED
            node.lost_since = self._clock()
            node.grace_announced = False
            self._touch(node_id)
            self._bump()
        return True

    def forget_node(self, node_id: str) -> bool:
        """Drop a node and its shards from the view (an operator removed it); return
        whether it was known. Its engines are not contacted."""
        node = self._nodes.pop(node_id, None)
        if node is None:
            return False
        self._gone(node.shards)
        self._draining.difference_update(node.shards)
        self._unindex(node)
        self._touch(node_id)
        self._bump()
        return True

    # -- reads -----------------------------------------------------------------------

    def shard_owner(self, shard_id: str) -> str | None:
        """Returns the id of the node that holds shard ``shard_id`` in the view, or None."""
        return self._owners.get(shard_id)

    def snapshot(self) -> Fleet:
        """Return an immutable :class:`Fleet` of the current view (O(changed nodes))."""
        views = self._views
        nodes: dict[str, NodeView] = {}
        for node_id, node in self._nodes.items():
            view = views.get(node_id)
            if view is None:
                view = views[node_id] = NodeView(
                    id=node.id,
                    address=node.address,
                    hardware=node.hardware,
                    engines=node.engines,
                    state=node.state,
                    last_heartbeat=node.last_heartbeat,
                    epoch=node.epoch,
                    shards={k: ShardView(s.spec, s.status, s.since) for k, s in node.shards.items()},
                    lost_since=node.lost_since,
                    labels=node.labels,
                    telemetry=node.telemetry,
                    telemetry_received=node.telemetry_received,
                )
            nodes[node_id] = view
        return Fleet(nodes=nodes, replace_grace=self.replace_grace, version=self._version)

    def replicas_of(self, model: str) -> list[ReadyReplica]:
        """Return the READY shards of ``model`` on ONLINE or DISCONNECTED nodes that have an
        endpoint, sorted by (node id, shard id). Cost is proportional to the model's shards."""
        out = []
        for node_id, shard_id in self._by_model.get(model, ()):
            node = self._nodes[node_id]
            if node.state is NodeState.LOST:
                continue
            shard = node.shards[shard_id]
            st = shard.status
            if st.state is ShardState.READY and st.endpoint and shard_id not in self._draining:
                out.append(ReadyReplica(id=shard_id, model=model, endpoint=st.endpoint, node_id=node_id,
                                        engine=shard.spec.engine, adapters=st.adapters,
                                        api_key=shard.spec.api_key))
        out.sort(key=lambda r: (r.node_id, r.id))
        return out

    def ready_replicas(self) -> dict[str, list[ReadyReplica]]:
        """Return :meth:`replicas_of` for every model that has shards (possibly empty lists)."""
        return {model: self.replicas_of(model) for model in sorted(self._by_model)}

    # -- watchdog --------------------------------------------------------------------

    async def watchdog(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Mark nodes LOST when silent, or disconnected, for longer than ``lost_after``;
        runs until cancelled.

        Also notifies waiters when a LOST node's ``replace_grace`` runs out, so the
        reconciler plans its replacement promptly. Never contacts a node.
        """
        task_status.started()
        while True:
            seen = self._version
            now = self._clock()
            deadline = max(self._check(now), now + WATCHDOG_RESOLUTION_S)
            # Wake at the next deadline, or on a change (a join or a disconnect may bring
            # a nearer one), but rescan at most once per resolution.
            with trio.move_on_at(deadline):
                await self.wait_changed(seen)
            await trio.sleep_until(now + WATCHDOG_RESOLUTION_S)

    def _check(self, now: float) -> float:
        """Apply expired deadlines; return the next time something expires (inf if none)."""
        next_at = math.inf
        changed = False
        for node in self._nodes.values():
            if node.state is NodeState.ONLINE:
                due = node.last_heartbeat + self.lost_after
                if now >= due:
                    log.warning(
                        "node %s silent for %.1f s (lost_after %.1f s); marked LOST",
                        node.id, now - node.last_heartbeat, self.lost_after,
                    )
                    self._mark_lost(node, now)
                    changed = True
                else:
                    next_at = min(next_at, due)
                    continue
            elif node.state is NodeState.DISCONNECTED:
                assert node.lost_since is not None
                due = node.lost_since + self.lost_after
                if now >= due:
                    log.warning("node %s has had no session for %.1f s (lost_after %.1f s); marked LOST",
                                node.id, now - node.lost_since, self.lost_after)
                    self._mark_lost(node, node.lost_since)
                    changed = True
                else:
                    next_at = min(next_at, due)
            if not node.grace_announced:
                assert node.lost_since is not None
                due = node.lost_since + self.replace_grace
                if now >= due:
                    node.grace_announced = True
                    log.warning("node %s %s for %.1f s: its replicas may now be replaced",
                                node.id, node.state.value.upper(), now - node.lost_since)
                    changed = True
                else:
                    next_at = min(next_at, due)
        if changed:
            self._bump()
        return next_at

    # -- internals -------------------------------------------------------------------

    def _mark_lost(self, node: _Node, since: float) -> None:
        """Marks ``node`` LOST, not ONLINE since ``since``; its shards' reports stop counting."""
        node.state = NodeState.LOST
        if node.lost_since is None:
            node.lost_since = since
            node.grace_announced = False
        self._touch(node.id)
        self._gone(node.shards)

    def _gone(self, shard_ids: Iterable[str]) -> None:
        """Tells :attr:`on_shard_gone` about each shard; its errors are logged, never raised."""
        callback = self.on_shard_gone
        if callback is None:
            return
        for shard_id in list(shard_ids):
            try:
                callback(shard_id)
            except Exception:  # noqa: BLE001 - the registry must stay consistent whatever the gateway does
                log.exception("on_shard_gone(%s) failed", shard_id)

    def _node(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            raise UnknownNode(node_id)
        return node

    def _live(self, node_id: str, epoch: int | None) -> _Node:
        node = self._node(node_id)
        if epoch is not None and epoch != node.epoch:
            raise StaleSession(node_id, epoch, node.epoch)
        return node

    def _index(self, node: _Node) -> None:
        for shard_id, shard in node.shards.items():
            self._by_model.setdefault(shard.spec.model, set()).add((node.id, shard_id))
            self._owners[shard_id] = node.id

    def _unindex(self, node: _Node) -> None:
        for shard in node.shards.values():
            self._unindex_one(node.id, shard.spec)

    def _unindex_one(self, node_id: str, spec: ShardSpec) -> None:
        if self._owners.get(spec.id) == node_id:
            del self._owners[spec.id]
        keys = self._by_model.get(spec.model)
        if keys is not None:
            keys.discard((node_id, spec.id))
            if not keys:
                del self._by_model[spec.model]
