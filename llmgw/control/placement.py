"""Placement: which replicas to start and stop, as a pure function of desired and actual state.

Public API::

    actions = plan(desired, fleet, now=trio.current_time(), failures=book, new_id=random_shard_id)
    book = note_failures(book, fleet, now)     # update the per-model failure record before plan

``plan`` returns a list of :data:`Action`: :class:`StopReplica` entries first (sorted by
node and shard), then :class:`StartReplica` entries in placement order, then
:class:`Waiting` (a model held back by failure backoff) and :class:`Unplaceable` (a
replica no node can take, with a sentence saying why). It does no I/O, reads no clock and,
given the same inputs and id and secret factories that return the same values, returns the
same list.

Rules, in order:

* A replica is *alive* when its state is not terminal and its node is ONLINE, or not
  ONLINE (DISCONNECTED or LOST) for less than ``fleet.replace_grace`` seconds. Terminal
  shards (FAILED, STOPPED) on ONLINE nodes are stopped so the agent forgets them; shards
  of models no longer desired are stopped. Nothing is ever sent to a node that is not ONLINE.
* Models with more alive replicas than ``profile.replicas`` stop the surplus on ONLINE
  nodes: not-ready ones first, then the newest.
* Models with fewer get new replicas, largest models first, unless their failure backoff
  (:func:`note_failures`, :func:`backoff_delay`) has not run out. A node can take a replica
  when it is ONLINE, has the engine installed and has the free memory, cores and whole
  GPUs (free = capacity minus what the shards on it reserve, including those planned in
  this pass). Among those, nodes without a replica of the model come first, then the
  one with the most free resources (for CPU replicas, nodes without GPUs first).
* GPU replicas (``profile.gpus > 0``) reserve specific GPU indices, each with at least
  ``profile.memory_mb`` free; CPU replicas reserve ``memory_mb`` of host memory.
* Rollout: a replica whose fingerprint (:func:`~llmgw.catalog.fingerprint.shard_fingerprint`)
  is not its model's (:func:`~llmgw.catalog.fingerprint.model_fingerprint`) is *outdated*.
  A model with outdated replicas and no replica missing takes one step per pass, one replica
  at a time: while a current replica is not READY it waits; with one replica too many (the
  replacement is READY) it stops the outdated surplus (not-ready first, then the oldest);
  otherwise it starts one new replica beside the old ones (``rollout="surge"``), or, where
  no node has room for it, stops one outdated replica whose node can take the new definition
  once it is gone (``rollout="in-place"``: the next pass places its replacement as a missing
  replica). If the new definition fits nowhere even then, the old replicas keep serving and
  an :class:`Unplaceable` with ``rollout="blocked"`` says why. A failure backoff holds a
  rollout like any start. A model short of replicas places the missing ones (with the new
  definition) first.

Cost: O(nodes + shards + models) to index, plus O(log nodes) per started replica when
the best nodes fit (each candidate that does not fit costs one heap pop and push).
"""

from __future__ import annotations

import heapq
import itertools
import math
import secrets
from collections import Counter, defaultdict
from typing import Callable, Iterable, Mapping, Sequence, Union

import attrs

from llmgw.catalog.fingerprint import model_fingerprint, shard_fingerprint
from llmgw.control.registry import Fleet, NodeState, NodeView, ShardView
from llmgw.labels import describe as describe_labels, matches as labels_match
from llmgw.spec import GpuInfo, ModelSpec, ShardSpec, ShardState, is_mig, is_mig_class

# A model whose replicas keep failing is started again after BASE, 2*BASE, 4*BASE, ...
# seconds, capped at MAX: long enough not to spin on a broken model or weights, short
# enough that a fixed one comes back without an operator restarting anything.
FAILURE_BACKOFF_BASE_S = 5.0
FAILURE_BACKOFF_MAX_S = 300.0
# An Unplaceable reason names this many nodes and summarises the rest in counts: at
# thousands of nodes a full list would be unreadable.
REASON_MAX_NODES = 4
# Core counts are floats; this absorbs rounding when reservations add up exactly.
_EPSILON = 1e-9

#: ``rollout`` of an action that is a rollout step: a new replica started beside the old ones ...
ROLLOUT_SURGE = "surge"
#: ... an old replica stopped first because no node has room for a surge ...
ROLLOUT_IN_PLACE = "in-place"
#: ... or (on an :class:`Unplaceable`) a new definition that fits nowhere, old replicas kept.
ROLLOUT_BLOCKED = "blocked"


@attrs.frozen
class StartReplica:
    """Start ``shard_spec`` (a new replica of ``model``) on ``node_id``."""

    model: str
    node_id: str
    shard_spec: ShardSpec
    reason: str = ""
    rollout: str = ""  # ROLLOUT_SURGE when it replaces an outdated replica; "" otherwise


@attrs.frozen
class StopReplica:
    """Stop shard ``shard_id`` on ``node_id`` and forget it; ``reason`` says why."""

    node_id: str
    shard_id: str
    reason: str
    rollout: str = ""  # ROLLOUT_SURGE / ROLLOUT_IN_PLACE when it ends an outdated replica; "" otherwise


@attrs.frozen
class Unplaceable:
    """``missing`` replicas of ``model`` fit on no node; ``reason`` tells the operator why."""

    model: str
    reason: str
    missing: int = 1
    rollout: str = ""  # ROLLOUT_BLOCKED: the model's new definition fits nowhere; its old replicas keep serving


@attrs.frozen
class Waiting:
    """``model`` is short of replicas but its failure backoff runs until ``until``."""

    model: str
    until: float
    reason: str


Action = Union[StartReplica, StopReplica, Unplaceable, Waiting]


def backoff_delay(failures: int) -> float:
    """Return the wait before starting a model again after ``failures`` failure rounds."""
    if failures <= 0:
        return 0.0
    return min(FAILURE_BACKOFF_MAX_S, FAILURE_BACKOFF_BASE_S * 2.0 ** min(failures - 1, 62))


@attrs.frozen
class FailureRecord:
    """Consecutive failure rounds of one model.

    ``count`` rounds so far (reset when a replica started after the last failure becomes
    READY), ``last_at`` when the last round was noticed, ``seen`` the failed shard ids
    already counted (so a FAILED shard that lingers is not counted twice),
    ``last_message`` the last failure's message.
    """

    count: int = 0
    last_at: float = -math.inf
    seen: frozenset[str] = frozenset()
    last_message: str = ""

    @property
    def retry_at(self) -> float:
        """When the model may be started again (-inf if not backing off)."""
        return self.last_at + backoff_delay(self.count) if self.count else -math.inf


def note_failures(
    book: Mapping[str, FailureRecord], fleet: Fleet, now: float
) -> dict[str, FailureRecord]:
    """Return ``book`` updated with what ``fleet`` shows; ``book`` is not modified.

    Each pass that finds new FAILED shards of a model counts one failure round (several
    replicas failing together count once). A READY replica that appeared after the last
    failure resets the count. Records with nothing left to remember are dropped.
    """
    failed: dict[str, dict[str, str]] = defaultdict(dict)  # model -> shard id -> message
    newest_ready: dict[str, float] = {}
    for node in fleet.nodes.values():
        for shard in node.shards.values():
            state = shard.status.state
            if state is ShardState.FAILED:
                failed[shard.spec.model][shard.spec.id] = shard.status.message
            elif state is ShardState.READY:
                model = shard.spec.model
                if shard.since > newest_ready.get(model, -math.inf):
                    newest_ready[model] = shard.since
    out: dict[str, FailureRecord] = {}
    for model in set(book) | set(failed):
        rec = book.get(model, FailureRecord())
        present = failed.get(model, {})
        fresh = [sid for sid in sorted(present) if sid not in rec.seen]
        if fresh:
            rec = FailureRecord(
                count=rec.count + 1,
                last_at=now,
                seen=rec.seen | set(fresh),
                last_message=present[fresh[-1]],
            )
        elif rec.count and newest_ready.get(model, -math.inf) > rec.last_at:
            rec = attrs.evolve(rec, count=0)
        rec = attrs.evolve(rec, seen=rec.seen & present.keys())
        if rec.count or rec.seen:
            out[model] = rec
    return out


def random_shard_id(model: str) -> str:
    """Return a fresh shard id ``"<model>-<8 hex digits>"``."""
    return f"{model}-{secrets.token_hex(4)}"


#: Random bytes in an engine's secret (``ShardSpec.api_key``): 256 bits, as URL-safe text
#: (43 characters), so it can be neither guessed nor brute-forced over HTTP.
ENGINE_SECRET_BYTES = 32


def new_engine_secret() -> str:
    """Return a fresh secret for one shard's engine (the gateway sends it as a Bearer token)."""
    return secrets.token_urlsafe(ENGINE_SECRET_BYTES)


class SequentialIds:
    """A deterministic id factory: ``"<model>-1"``, ``"<model>-2"``, ... (tests, benchmarks)."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)

    def __call__(self, model: str) -> str:
        return f"{model}-{next(self._counter)}"


# -- internals ---------------------------------------------------------------------------


@attrs.frozen
class _Need:
    engine: str
    memory_mb: int  # host memory (CPU replica) or per-GPU free memory (GPU replica)
    cpu_cores: float
    gpus: int
    labels: tuple[tuple[str, str], ...] = ()  # node labels the profile asks for (every one)
    gpu_class: str = ""  # the GPU class each replica runs on ("" = any)

    @classmethod
    def of(cls, model: ModelSpec) -> "_Need":
        p = model.profile
        return cls(model.engine, max(0, p.memory_mb), max(0.0, p.cpu_cores), max(0, p.gpus),
                   tuple(sorted(p.node_labels.items())), p.gpu_class)

    def usable(self, gpu: GpuInfo) -> bool:
        """Whether ``gpu`` (free) may take one of this replica's GPUs: its class where one is asked
        for, its free memory, and never a MIG instance for a replica spread over several GPUs
        (an instance is a slice of a card: it runs one replica on itself alone)."""
        if self.gpu_class and gpu.gpu_class != self.gpu_class:
            return False
        if self.gpus > 1 and is_mig(gpu.index):
            return False
        return gpu.memory_free_mb >= self.memory_mb

    def describe(self) -> str:
        parts = []
        if self.gpus:
            each = f" with {self.memory_mb} MB free each" if self.memory_mb else ""
            kind = f" of class {self.gpu_class}" if self.gpu_class else ""
            parts.append(f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}{kind}{each}")
        elif self.memory_mb:
            parts.append(f"{self.memory_mb} MB memory")
        if self.cpu_cores:
            parts.append(f"{self.cpu_cores:g} cores")
        parts.append(f"engine {self.engine}")
        if self.labels:
            parts[-1] += f" on a node labelled {describe_labels(dict(self.labels))}"
        return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


class _Capacity:
    """What is still free on one ONLINE node during a planning pass."""

    __slots__ = ("node", "node_id", "mem_free", "cores_free", "free_gpus", "gpu_total", "version", "pools",
                 "_gpus_by_index")

    def __init__(self, node: NodeView) -> None:
        hw = node.hardware
        self.node = node
        self.node_id = node.id
        self.mem_free = hw.memory_total_mb
        self.cores_free = float(hw.cpu_count)
        self.free_gpus: list[GpuInfo] = sorted(hw.gpus, key=lambda g: g.index)
        self.gpu_total = len(hw.gpus)
        self._gpus_by_index = {g.index: g for g in hw.gpus}
        self.version = 0  # bumped on every reservation; stale heap entries are skipped
        self.pools: list[_Pool] = []

    def uuids(self, gpus: tuple[int, ...]) -> tuple[str, ...]:
        """Returns the UUID of each of ``gpus`` (as the node reported them)."""
        return tuple(self._gpus_by_index[i].uuid for i in gpus)

    def reserve(self, spec: ShardSpec) -> None:
        if spec.gpus:
            taken = set(spec.gpus)
            self.free_gpus = [g for g in self.free_gpus if g.index not in taken]
        else:
            self.mem_free -= spec.memory_mb
        self.cores_free -= spec.cpu_cores

    def fits_instead_of(self, spec: ShardSpec, need: _Need) -> bool:
        """Returns True if ``need`` would fit here once ``spec`` (a shard on this node) is gone.

        Leaves the capacity as it found it."""
        saved = (self.mem_free, self.cores_free, list(self.free_gpus))
        if spec.gpus:
            back = [self._gpus_by_index[i] for i in spec.gpus if i in self._gpus_by_index]
            self.free_gpus = sorted(self.free_gpus + back, key=lambda g: g.index)
        else:
            self.mem_free += spec.memory_mb
        self.cores_free += spec.cpu_cores
        try:
            return self.fit(need) is not None
        finally:
            self.mem_free, self.cores_free, self.free_gpus = saved

    def fit(self, need: _Need) -> tuple[int, ...] | None:
        """Return the GPU indices the replica would get (``()`` for CPU), or None."""
        if need.labels and not labels_match(self.node.labels, dict(need.labels)):
            return None
        if need.cpu_cores and self.cores_free + _EPSILON < need.cpu_cores:
            return None
        if need.gpus:
            if need.gpus > 1 and is_mig_class(need.gpu_class):  # the catalog refuses it too
                return None
            picked = [g.index for g in self.free_gpus if need.usable(g)]
            if len(picked) < need.gpus:
                return None
            return tuple(picked[: need.gpus])
        if need.memory_mb and self.mem_free < need.memory_mb:
            return None
        return ()

    def why_not(self, need: _Need) -> tuple[str, str]:
        """Return (category, sentence) saying why ``need`` does not fit here."""
        nid = self.node_id
        if need.labels and not labels_match(self.node.labels, dict(need.labels)):
            return "labels", f"node {nid} is labelled {describe_labels(self.node.labels)}"
        engine = self.node.engine(need.engine)
        if engine is None or not engine.installed:
            if engine is not None and engine.state:
                return "engine", f"node {nid} has {need.engine} not installed yet ({engine.state})"
            if engine is not None and engine.installable:
                return "engine", f"node {nid} has {need.engine} installable but not installed"
            return "engine", f"node {nid} has no {need.engine} installed"
        short: list[tuple[str, str]] = []
        if need.gpus:
            if self.gpu_total == 0:
                note = self.node.hardware.gpu_note
                short.append(("gpus", f"no GPUs{f' ({note})' if note else ''}"))
            elif need.gpus > 1 and is_mig_class(need.gpu_class):
                short.append(("gpus", f"MIG instances, which take one replica each, not {need.gpus}"))
            else:
                fitting = [g for g in self.free_gpus if need.usable(g)]
                if len(fitting) < need.gpus:
                    with_mem = f" with {need.memory_mb} MB free" if need.memory_mb else ""
                    kind = f" of class {need.gpu_class}" if need.gpu_class else ""
                    whole = " whole" if need.gpus > 1 and any(is_mig(g.index) for g in self.free_gpus) else ""
                    short.append(("gpus", f"{len(fitting)} of {self.gpu_total}{whole} GPUs{kind} free{with_mem}"))
        elif need.memory_mb and self.mem_free < need.memory_mb:
            short.append(("memory", f"{max(0, self.mem_free)} MB free"))
        if need.cpu_cores and self.cores_free + _EPSILON < need.cpu_cores:
            short.append(("cores", f"{max(0.0, self.cores_free):g} cores free"))
        if not short:  # cannot happen when fit() said no; keep the message honest anyway
            return "other", f"node {nid} cannot take it"
        return short[0][0], f"node {nid} has " + " and ".join(text for _, text in short)


class _Pool:
    """Candidate nodes for one (engine, CPU-or-GPU) kind, best first, in a lazy heap."""

    def __init__(self, caps: Iterable[_Capacity], gpu: bool) -> None:
        self._key = self._gpu_key if gpu else self._cpu_key
        self._heap = [(self._key(c), c.version, c) for c in caps]
        heapq.heapify(self._heap)
        for _, _, c in self._heap:
            c.pools.append(self)

    @staticmethod
    def _gpu_key(c: _Capacity) -> tuple:
        return (-len(c.free_gpus), -c.mem_free, -c.cores_free, c.node_id)

    @staticmethod
    def _cpu_key(c: _Capacity) -> tuple:
        # Keep GPU nodes for GPU work: CPU replicas go to nodes without GPUs first.
        return (c.gpu_total, -c.mem_free, -c.cores_free, c.node_id)

    def push(self, cap: _Capacity) -> None:
        heapq.heappush(self._heap, (self._key(cap), cap.version, cap))

    def pick(self, need: _Need, crowded: Mapping[str, int]) -> tuple[_Capacity, tuple[int, ...]] | None:
        """Return the best node for ``need`` and its GPU indices, or None if none fits.

        Nodes already holding replicas of the model (``crowded``) are taken only when
        no other node fits, the least crowded first.
        """
        heap = self._heap
        kept = []
        chosen = None
        fallback = None
        while heap:
            entry = heapq.heappop(heap)
            key, version, cap = entry
            if version != cap.version:
                continue  # superseded by a fresher entry
            kept.append(entry)
            gpus = cap.fit(need)
            if gpus is None:
                continue
            n = crowded.get(cap.node_id, 0)
            if n == 0:
                chosen = (cap, gpus)
                break
            if fallback is None or (n, key) < fallback[0]:
                fallback = ((n, key), (cap, gpus))
        for entry in kept:
            heapq.heappush(heap, entry)
        if chosen is None and fallback is not None:
            chosen = fallback[1]
        return chosen


@attrs.frozen
class _Alive:
    node_id: str
    shard: ShardView
    online: bool


def _terminal_reason(shard: ShardView) -> str:
    if shard.status.state is ShardState.FAILED:
        msg = shard.status.message or "no message"
        return f"replica {shard.spec.id} of {shard.spec.model} failed ({msg}); removing it"
    return f"replica {shard.spec.id} of {shard.spec.model} is stopped; removing it"


def _explain(model: ModelSpec, need: _Need, caps: Mapping[str, _Capacity], fleet: Fleet, placed: int) -> str:
    """Return the operator-facing sentence for a replica of ``model`` that fits nowhere."""
    head = f"model {model.name} needs {need.describe()}"
    tail = ""
    if placed:
        tail = f" ({placed} of the missing replicas placed in this pass)"
    if not caps:
        lost = sorted(n.id for n in fleet.nodes.values() if n.state is not NodeState.ONLINE)
        if not lost:
            return f"{head}; no node has joined the cluster{tail}"
        shown = ", ".join(lost[:REASON_MAX_NODES]) + (", ..." if len(lost) > REASON_MAX_NODES else "")
        return f"{head}; no node is ONLINE ({len(lost)} LOST: {shown}){tail}"

    def has_engine(c: _Capacity) -> bool:
        e = c.node.engine(need.engine)
        return e is not None and e.installed

    # Nodes that have the engine are the closest to fitting: name them first.
    ordered = sorted(caps.values(), key=lambda c: (not has_engine(c), c.node_id))
    shown_parts = []
    rest: Counter[str] = Counter()
    for c in ordered:
        category, text = c.why_not(need)
        if len(shown_parts) < REASON_MAX_NODES:
            shown_parts.append(text)
        else:
            rest[category] += 1
    text = f"{head}; " + "; ".join(shown_parts)
    if rest:
        labels = {
            "engine": f"without {need.engine} installed",
            "labels": "without those labels",
            "memory": "short of memory",
            "cores": "short of cores",
            "gpus": "short of GPUs",
            "other": "otherwise unfit",
        }
        summary = ", ".join(f"{n} {labels[k]}" for k, n in sorted(rest.items()))
        text += f"; and {sum(rest.values())} more nodes ({summary})"
    return text + tail


def _fresh_id(new_id: Callable[[str], str], model: str, taken: set[str]) -> str:
    for _ in range(100):
        sid = new_id(model)
        if sid not in taken:
            taken.add(sid)
            return sid
    raise RuntimeError(f"shard id factory keeps returning ids already in use (last: {sid!r})")


def node_counts_alive(node: NodeView, now: float, grace: float) -> bool:
    """Returns True if ``node``'s not-terminal replicas count as alive (module docstring): it is
    ONLINE, or not ONLINE for less than ``grace`` seconds (``fleet.replace_grace``)."""
    if node.state is NodeState.ONLINE:
        return True
    lost_since = node.lost_since if node.lost_since is not None else now
    return now - lost_since < grace


def _rollout_step(
    model: ModelSpec,
    want: int,
    reps: list[_Alive],
    outdated: list[_Alive],
    need: _Need,
    pool: _Pool | None,
    caps: Mapping[str, _Capacity],
    crowded: Mapping[str, int],
    fleet: Fleet,
    stops: list[StopReplica],
    unplaceable: list[Unplaceable],
    place: Callable[[_Capacity, tuple[int, ...], str, str], None],
    backing_off: Callable[[int], bool],
) -> None:
    """Appends the next step of replacing ``model``'s ``outdated`` replicas (module docstring,
    "Rollout"); ``reps`` (all alive replicas, at least ``want``) include them."""
    name = model.name
    old_ids = {a.shard.spec.id for a in outdated}
    current = [a for a in reps if a.shard.spec.id not in old_ids]
    if any(a.shard.status.state is not ShardState.READY for a in current):
        return  # one at a time: the replacement started last is not READY yet
    # Not-ready outdated replicas go first (they serve nothing), then the oldest.
    order = sorted(
        (a for a in outdated if a.online),
        key=lambda a: (a.shard.status.state is ShardState.READY, a.shard.since, a.shard.spec.id),
    )
    if len(reps) > want:
        for a in order[: len(reps) - want]:
            sid = a.shard.spec.id
            if current:
                reason = (f"rollout: replica {sid} of {name} runs an older definition and a replacement "
                          f"is ready ({len(outdated) - 1} outdated left)")
            else:
                reason = f"scale down: model {name} has {len(reps)} replicas, wants {want} (outdated ones first)"
            stops.append(StopReplica(a.node_id, sid, reason, ROLLOUT_SURGE if current else ""))
        return
    if backing_off(0):
        return
    picked = pool.pick(need, crowded) if pool is not None else None
    if picked is not None:
        cap, gpus = picked
        place(cap, gpus, f"rollout: model {name} changed; a new replica starts beside the {len(outdated)} "
                         f"outdated one(s), one of which stops once it is ready", ROLLOUT_SURGE)
        return
    for a in order:
        cap = caps.get(a.node_id)
        if cap is not None and cap.fits_instead_of(a.shard.spec, need):
            stops.append(StopReplica(
                a.node_id, a.shard.spec.id,
                f"rollout in place: model {name} changed and no node has room for a new replica beside the old "
                f"ones; replica {a.shard.spec.id} stops first and is replaced ({len(outdated) - 1} outdated left)",
                ROLLOUT_IN_PLACE,
            ))
            return
    unplaceable.append(Unplaceable(
        name,
        f"{_explain(model, need, caps, fleet, 0)}; the changed definition fits on no node, not even in place of "
        f"an old replica, so its {len(outdated)} outdated replica(s) keep serving",
        len(outdated),
        ROLLOUT_BLOCKED,
    ))


def plan(
    desired: Sequence[ModelSpec],
    fleet: Fleet,
    *,
    now: float,
    failures: Mapping[str, FailureRecord] | None = None,
    new_id: Callable[[str], str] = random_shard_id,
    new_secret: Callable[[], str] = new_engine_secret,
) -> list[Action]:
    """Return the actions that bring ``fleet`` towards ``desired`` (see the module docstring).

    ``now`` is on the same clock as the fleet's times (trio's). ``failures`` is the
    per-model failure book from :func:`note_failures`. ``new_id(model)`` names new shards;
    ``new_secret()`` gives each new shard its engine's secret.
    Raises nothing for unfit input: what cannot be placed is reported as :class:`Unplaceable`.
    """
    failures = failures or {}
    wanted = {m.name: m for m in desired}
    grace = fleet.replace_grace

    caps: dict[str, _Capacity] = {}
    alive: dict[str, list[_Alive]] = defaultdict(list)
    crowded: dict[str, Counter[str]] = defaultdict(Counter)  # model -> ONLINE node -> replicas
    stops: list[StopReplica] = []
    taken_ids: set[str] = set()

    for node in fleet.nodes.values():
        online = node.state is NodeState.ONLINE
        counted = node_counts_alive(node, now, grace)
        cap = _Capacity(node) if online else None
        for shard in node.shards.values():
            spec = shard.spec
            taken_ids.add(spec.id)
            if shard.status.state.is_terminal:
                if online:
                    stops.append(StopReplica(node.id, spec.id, _terminal_reason(shard)))
                continue
            if cap is not None:
                cap.reserve(spec)  # a shard holds its reservation until it is gone
            if spec.model not in wanted:
                if online:
                    stops.append(
                        StopReplica(node.id, spec.id, f"model {spec.model} is no longer in the catalog")
                    )
                continue
            if counted:
                alive[spec.model].append(_Alive(node.id, shard, online))
            if online:
                crowded[spec.model][node.id] += 1
        if cap is not None:
            caps[node.id] = cap

    by_engine: dict[str, list[_Capacity]] = defaultdict(list)
    for cap in caps.values():
        for e in cap.node.engines:
            if e.installed:
                by_engine[e.name].append(cap)
    pools: dict[tuple[str, bool], _Pool] = {}

    def pool_for(need: _Need) -> _Pool | None:
        key = (need.engine, need.gpus > 0)
        pool = pools.get(key)
        if pool is None and need.engine in by_engine:
            pool = pools[key] = _Pool(by_engine[need.engine], key[1])
        return pool

    starts: list[StartReplica] = []
    waiting: list[Waiting] = []
    unplaceable: list[Unplaceable] = []

    # Largest first: big replicas are the hard ones to fit once capacity is fragmented.
    def size(m: ModelSpec) -> tuple:
        p = m.profile
        return (-p.gpus, -p.memory_mb, -p.cpu_cores, m.name)

    for model in sorted(wanted.values(), key=size):
        name = model.name
        reps = alive.get(name, [])
        want = max(0, model.profile.replicas)
        fingerprint = model_fingerprint(model)
        outdated = [a for a in reps if shard_fingerprint(a.shard.spec) != fingerprint]
        need = _Need.of(model)

        def place(cap: _Capacity, gpus: tuple[int, ...], reason: str, rollout: str = "") -> None:
            spec = ShardSpec(
                id=_fresh_id(new_id, name, taken_ids),
                model=name,
                engine=model.engine,
                source=model.source,
                args=model.profile.engine_args,
                env=model.profile.engine_env,
                memory_mb=need.memory_mb,
                cpu_cores=need.cpu_cores,
                gpus=gpus,
                adapters=model.adapters,
                max_loaded_adapters=model.max_loaded_adapters,
                fingerprint=fingerprint,
                api_key=new_secret(),
                gpu_uuids=cap.uuids(gpus),
            )
            cap.reserve(spec)
            cap.version += 1
            for p in cap.pools:
                p.push(cap)
            crowded[name][cap.node_id] += 1
            starts.append(StartReplica(name, cap.node_id, spec, reason, rollout))

        def backing_off(missing: int) -> bool:
            rec = failures.get(name)
            if rec is None or not rec.count or now >= rec.retry_at:
                return False
            last = f" (last: {rec.last_message})" if rec.last_message else ""
            short = f"is missing {missing} replica(s)" if missing else f"has {len(outdated)} replica(s) to roll out"
            waiting.append(
                Waiting(
                    name,
                    rec.retry_at,
                    f"model {name} {short} but failed {rec.count} time(s) in a row{last}; "
                    f"next start in {rec.retry_at - now:.0f} s",
                )
            )
            return True

        if outdated and len(reps) >= want:
            _rollout_step(model, want, reps, outdated, need, pool_for(need), caps, crowded[name], fleet,
                          stops, unplaceable, place, backing_off)
            continue
        if len(reps) > want:
            stoppable = sorted(
                (a for a in reps if a.online),
                key=lambda a: (a.shard.status.state is ShardState.READY, -a.shard.since, a.shard.spec.id),
            )
            for a in stoppable[: len(reps) - want]:
                stops.append(
                    StopReplica(a.node_id, a.shard.spec.id, f"scale down: model {name} has {len(reps)} replicas, wants {want}")
                )
            continue
        missing = want - len(reps)
        if missing <= 0:
            continue
        if backing_off(missing):
            continue
        pool = pool_for(need)
        for i in range(missing):
            picked = pool.pick(need, crowded[name]) if pool is not None else None
            if picked is None:
                unplaceable.append(Unplaceable(name, _explain(model, need, caps, fleet, i), missing - i))
                break
            cap, gpus = picked
            place(cap, gpus, f"model {name} has {len(reps) + i} of {want} replicas")

    stops.sort(key=lambda s: (s.node_id, s.shard_id))
    return [*stops, *starts, *waiting, *unplaceable]
