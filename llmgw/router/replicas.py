"""What the gateway routes to: the replica table, per-replica load, and the routing policy.

* :class:`ReplicaTable` is the control plane's view pushed into the gateway: which models
  are in the catalog and which READY replicas each has. The control plane (or a standby's
  mirror of the leader) calls :meth:`ReplicaTable.set_model_replicas` /
  :meth:`ReplicaTable.replace_all`; the gateway only reads it.
* :class:`LoadTracker` counts requests in flight per replica. The gateway takes a
  :class:`Lease` for every request it sends to a replica and releases it when the
  response is finished, failed or cancelled (streams count until their last byte).
* :class:`RoutingPolicy` is the base of every policy: ``choose`` picks a replica, and
  optional hooks (KV updates, the upstream client, an observer, alarms) do nothing
  unless a policy overrides them. :class:`LeastOutstanding` is the first policy;
  KV-aware policies subclass the same base and receive the parsed request in
  :class:`RequestInfo`.

Everything here is synchronous and runs on the trio thread; nothing does I/O.
"""

from __future__ import annotations

import abc
import itertools
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Mapping, Sequence

import attrs
import trio

from llmgw.spec import KvDelta

from .kvindex import KvIndex
from .prefillcost import PrefillLedger

if TYPE_CHECKING:
    from .usage import Usage


@attrs.frozen
class Replica:
    """One READY replica of a catalog model.

    ``endpoint`` is the base URL of the engine's OpenAI API (``http://host:port``, no
    ``/v1``); ``id`` is the shard id; ``node_id`` the node it runs on; ``engine`` the
    catalog engine name ("vllm", "llama.cpp", "sim", ...; "" = unknown); ``adapters`` the
    LoRA adapters it can serve, as (name, path on its node) pairs; ``api_key`` the engine's
    secret, sent as its Bearer token on every request ("" = none; never in reprs or logs).
    """

    id: str
    model: str
    endpoint: str
    node_id: str = ""
    engine: str = ""
    adapters: tuple[tuple[str, str], ...] = ()
    api_key: str = attrs.field(default="", repr=False)

    def adapter_path(self, adapter: str) -> str | None:
        """Return the path this replica loads ``adapter`` from, or None if it does not list it."""
        for name, path in self.adapters:
            if name == adapter:
                return path
        return None


@attrs.frozen
class ModelInfo:
    """What the gateway knows about a catalog model beyond its replicas.

    ``engine`` is the catalog engine name ("" = unknown); ``adapters`` the names of its
    LoRA adapters (they share the model namespace: a request's ``model`` may name one);
    ``max_loaded_adapters`` is 0 when every adapter is loaded at start, else at most that
    many are loaded per replica at a time, on demand (vLLM, sim).
    """

    engine: str = ""
    adapters: tuple[str, ...] = ()
    max_loaded_adapters: int = 0


@attrs.frozen
class CatalogModel:
    """A catalog model as the gateway lists it; ``created`` is a Unix time in seconds."""

    name: str
    created: int


class ReplicaTable:
    """Catalog models and their READY replicas, as the gateway sees them.

    A model may be in the catalog with no ready replica (the gateway answers 503), which
    is different from a model that is not in the catalog (404). Updates replace whole
    entries, so a reader never sees a half-applied change.
    """

    def __init__(self) -> None:
        self._replicas: dict[str, tuple[Replica, ...]] = {}
        self._created: dict[str, int] = {}
        self._info: dict[str, ModelInfo] = {}
        self._parents: dict[str, str] = {}  # adapter name -> its model (from _info)

    def set_model_replicas(self, model: str, replicas: Sequence[Replica]) -> None:
        """Set the ready replicas of ``model``, adding ``model`` to the catalog if new.

        An empty ``replicas`` keeps the model in the catalog with nothing to route to.
        Raises ``ValueError`` if a replica belongs to another model or ids repeat.
        """
        self._replicas[model] = _checked(model, replicas)
        self._created.setdefault(model, int(time.time()))

    def replace_all(
        self, mapping: Mapping[str, Sequence[Replica]], infos: Mapping[str, ModelInfo] | None = None
    ) -> None:
        """Make the catalog exactly ``mapping``'s keys, each with its ready replicas, and,
        when ``infos`` is given, the models' info exactly ``infos`` (else each model keeps
        what it had).

        Models absent from ``mapping`` leave the catalog. Validates everything before
        changing anything (``ValueError`` as in :meth:`set_model_replicas`).
        """
        checked = {model: _checked(model, replicas) for model, replicas in mapping.items()}
        now = int(time.time())
        self._created = {model: self._created.get(model, now) for model in checked}
        self._replicas = checked
        source = self._info if infos is None else infos
        self._info = {model: info for model, info in source.items() if model in checked}
        self._reindex_adapters()

    def remove_model(self, model: str) -> None:
        """Take ``model`` out of the catalog (requests for it then get 404); no-op if absent."""
        self._replicas.pop(model, None)
        self._created.pop(model, None)
        if self._info.pop(model, None) is not None:
            self._reindex_adapters()

    def set_model_info(self, model: str, info: ModelInfo) -> None:
        """Set what is known about ``model`` (engine, adapters); kept until the model leaves.

        Info for a model not (yet) in the catalog is kept, but its adapters resolve only
        while the model is in the catalog (:meth:`parent_of`).
        """
        self._info[model] = info
        self._reindex_adapters()

    def model_info(self, model: str) -> ModelInfo:
        """Return ``model``'s info, or an empty :class:`ModelInfo` if none was set."""
        return self._info.get(model, _NO_INFO)

    def knows(self, name: str) -> bool:
        """Return whether ``name`` is a catalog model or an adapter of one (a metric's model label)."""
        return name in self._replicas or self.parent_of(name) is not None

    def parent_of(self, name: str) -> str | None:
        """Return the catalog model whose adapter is called ``name``, or None if no model has one."""
        parent = self._parents.get(name)
        return parent if parent is not None and parent in self._replicas else None

    def _reindex_adapters(self) -> None:
        # Sorted by model so that a name claimed twice (the catalog refuses that) resolves
        # the same way every time.
        self._parents = {
            adapter: model for model in sorted(self._info, reverse=True) for adapter in self._info[model].adapters
        }

    def models(self) -> list[CatalogModel]:
        """Return the catalog models, sorted by name."""
        return [CatalogModel(name, self._created[name]) for name in sorted(self._replicas)]

    def has_model(self, model: str) -> bool:
        """Return whether ``model`` is in the catalog (ready replicas or not)."""
        return model in self._replicas

    def replicas(self, model: str) -> tuple[Replica, ...] | None:
        """Return the ready replicas of ``model``, or None if it is not in the catalog."""
        return self._replicas.get(model)


_NO_INFO = ModelInfo()


def _checked(model: str, replicas: Sequence[Replica]) -> tuple[Replica, ...]:
    """Return ``replicas`` as a tuple after checking they all belong to ``model``, once each."""
    result = tuple(replicas)
    seen: set[str] = set()
    for replica in result:
        if replica.model != model:
            raise ValueError(f"replica {replica.id!r} serves {replica.model!r}, not {model!r}")
        if replica.id in seen:
            raise ValueError(f"replica id {replica.id!r} appears twice for model {model!r}")
        seen.add(replica.id)
    return result


class Lease:
    """One request in flight on one replica; :meth:`release` ends it (idempotent).

    ``prefill_tokens`` is the router's estimate of the request's uncached prompt tokens on
    the replica; the lease counts them as queued prefill there until :meth:`first_token`
    (which also records the request's time to first token) or :meth:`release`.
    ``on_first_token`` (optional) is called once with the seconds to first token.
    """

    __slots__ = ("_tracker", "replica_id", "_released", "prefill_tokens", "_work", "_started_at", "_started",
                 "on_first_token")

    def __init__(self, tracker: LoadTracker, replica_id: str, prefill_tokens: int = 0,
                 on_first_token: Callable[[float], None] | None = None) -> None:
        self._tracker = tracker
        self.replica_id = replica_id
        self._released = False
        self.prefill_tokens = prefill_tokens
        self._work = tracker.prefill.routed(replica_id, prefill_tokens)
        self._started_at = tracker.prefill.clock()
        self._started = False
        self.on_first_token = on_first_token

    def first_token(self) -> None:
        """The replica sent the request's first token: its prefill leaves the replica's
        queue and its time to first token is recorded. Later calls do nothing."""
        if self._started or self._released:
            return
        self._started = True
        seconds = self._tracker.prefill.clock() - self._started_at
        self._tracker.prefill.first_token(self.replica_id, self.prefill_tokens, self._work, seconds)
        callback = self.on_first_token
        if callback is not None:
            self.on_first_token = None
            callback(seconds)

    def release(self) -> None:
        """Stop counting this request; calling it again does nothing."""
        if not self._released:
            self._released = True
            self._tracker.prefill.finished(self.replica_id, self.prefill_tokens, self._started)
            self._tracker._release(self.replica_id)


class LoadTracker:
    """Counts requests in flight per replica id, and (:attr:`prefill`) the prefill work
    queued on each and what it costs there (:class:`~llmgw.router.prefillcost.PrefillLedger`).

    Counts live here rather than on :class:`Replica` so that they survive table updates
    (a replica that stays in the table keeps its count).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._outstanding: dict[str, int] = {}
        # Set at the next count change; made only while someone waits (two requests' worth of
        # Event objects per request otherwise).
        self._changed: trio.Event | None = None
        self.prefill = PrefillLedger(clock)

    def acquire(self, replica_id: str, prefill_tokens: int = 0,
                on_first_token: Callable[[float], None] | None = None) -> Lease:
        """Count one more request on ``replica_id`` (with ``prefill_tokens`` uncached prompt
        tokens queued there until its first token); return the lease that un-counts it."""
        self._outstanding[replica_id] = self._outstanding.get(replica_id, 0) + 1
        self._notify()
        return Lease(self, replica_id, prefill_tokens, on_first_token)

    def outstanding(self, replica_id: str) -> int:
        """Return the number of requests in flight on ``replica_id`` (0 if unknown)."""
        return self._outstanding.get(replica_id, 0)

    @property
    def counts(self) -> Mapping[str, int]:
        """The non-zero in-flight counts by replica id, live (read-only: for a policy that
        reads many at once; :meth:`snapshot` for a copy)."""
        return self._outstanding

    def snapshot(self) -> dict[str, int]:
        """Return a copy of the non-zero in-flight counts by replica id."""
        return dict(self._outstanding)

    def total(self) -> int:
        """Return the number of requests in flight on all replicas together."""
        return sum(self._outstanding.values())

    async def wait_until(self, predicate: Callable[[LoadTracker], bool]) -> None:
        """Return once ``predicate(self)`` is true, re-checking after every count change.

        Has no deadline of its own: wrap it in ``trio.fail_after``/``move_on_after``.
        Cancellation simply abandons the wait.
        """
        while not predicate(self):
            if self._changed is None:
                self._changed = trio.Event()
            await self._changed.wait()

    def _release(self, replica_id: str) -> None:
        count = self._outstanding.get(replica_id, 0) - 1
        if count > 0:
            self._outstanding[replica_id] = count
        else:
            self._outstanding.pop(replica_id, None)
        self._notify()

    def _notify(self) -> None:
        changed = self._changed
        if changed is not None:
            self._changed = None
            changed.set()


@attrs.frozen
class Route:
    """A policy's answer: the replica, and its estimate of the request's uncached prompt
    tokens there (0: no estimate), with optional callbacks for the first token's arrival
    (``on_first_token``, with the seconds to it) and for the engine's usage of the request
    (``on_usage``, once the answer is done; not called when it reported none)."""

    replica: Replica
    prefill_tokens: int = 0
    on_first_token: Callable[[float], None] | None = None
    on_usage: Callable[[Usage], None] | None = None


@attrs.frozen
class RequestInfo:
    """What a routing policy may look at: the endpoint path, the model, and the parsed body.

    ``model`` is the name as requested; ``adapter`` is the LoRA adapter it names (None: a
    base model), set by the gateway once it has resolved the name (llmgw/router/adapters.py).
    """

    path: str
    model: str
    stream: bool = False
    body: Mapping[str, Any] = attrs.field(factory=dict)
    adapter: str | None = None


class RoutingObserver:
    """Receives routing events (the gateway's metrics implement it); the default ignores them."""

    def decision(self, model: str, kind: str, matched: int, total: int) -> None:
        """One request routed among several candidates."""

    def mismatch(self, model: str, replica_id: str) -> None:
        """One routed request whose blocks the replica never reported."""

    def alarm(self, model: str, replica_id: str, raised: bool) -> None:
        """The hash-agreement alarm of ``replica_id`` was raised or cleared."""

    def tokenizer_alarm(self, model: str, replica_id: str, raised: bool) -> None:
        """The gateway's tokenizer for ``replica_id`` disagreed with its engine's (raised) or agrees again."""

    def tokenized(self, model: str, by: str) -> None:
        """One prompt of ``model`` tokenized ``by`` "gateway" (its own tokenizer) or "engine" (``/tokenize``)."""

    def tokenizer_check(self, model: str, agreed: bool) -> None:
        """One sampled comparison of the gateway's ids with the engine's ``/tokenize``."""


class RoutingPolicy(abc.ABC):
    """Picks the replica for one request; the base of every routing policy.

    :meth:`choose` is the one method a policy must implement (abstract). The other hooks are how
    the gateway tells a policy about its surroundings; each does nothing here, so a
    policy overrides only those it needs (the KV-aware policy, llmgw/router/kvrouting.py,
    overrides them all). All are synchronous and called on the trio thread.

    ``index`` is the KV index a policy brings to be fed by the gateway (None: the
    gateway keeps its own). ``name`` is the ``routing.policy`` value that selects it.
    """

    index: KvIndex | None = None
    name: str = ""

    @abc.abstractmethod
    def choose(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | Awaitable[Replica]:
        """Return one of ``candidates`` (never empty) for ``request``, or an awaitable of it.

        An awaitable lets a policy ask a replica first (a KV-aware policy may tokenize:
        llmgw/router/kvrouting.py); the gateway awaits it then.
        """

    def route(self, candidates: Sequence[Replica], request: RequestInfo) -> Route | Awaitable[Route]:
        """Return the :class:`Route` for ``request`` (or an awaitable of it): :meth:`choose`'s
        replica with no prefill estimate here; a cost-aware policy overrides it."""
        choice = self.choose(candidates, request)
        if isinstance(choice, Replica):
            return Route(choice)
        return _route_of(choice)

    def attach_observer(self, observer: RoutingObserver) -> None:
        """Send routing decisions, mismatches and alarms to ``observer`` (the gateway's metrics)."""

    def bind_upstream(self, client: Any, nursery: Any = None) -> None:
        """Use the gateway's upstream client for calls to engines (None: the gateway stopped),
        and ``nursery`` (the gateway's) for background work such as fetching tokenizers."""

    def kv_applied(self, replica_id: str, delta: KvDelta) -> None:
        """A KV-cache delta from ``replica_id`` was applied to the gateway's KV index."""

    def kv_forgotten(self, replica_id: str) -> None:
        """Everything known about ``replica_id``'s KV cache is gone (shard stopped, session ended)."""

    def alarms(self) -> list[str]:
        """Return the policy's standing alarms in words (for ``ctl status``); none here."""
        return []

    def retune(self, settings: Any) -> None:
        """Take the parameters of ``settings`` (a :class:`~llmgw.config.RoutingConfig` naming
        this policy) from now on, keeping what the policy has learnt; none here."""

    def close(self) -> None:
        """The gateway replaced this policy: clear what it told the observer (raised alarms)."""


async def _route_of(choice: Awaitable[Replica]) -> Route:
    return Route(await choice)


class LeastOutstanding(RoutingPolicy):
    """Picks the replica with the fewest requests in flight; ties go round-robin per model.

    Round-robin on ties matters when the fleet is idle: sequential requests would
    otherwise all land on the first replica.
    """

    name = "least-load"

    def __init__(self, load: LoadTracker) -> None:
        self._load = load
        self._turns: dict[str, itertools.count[int]] = {}

    def choose(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica:
        """Return the least-loaded candidate, rotating among equally loaded ones."""
        if not candidates:
            raise ValueError("choose() needs at least one candidate replica")
        counts = self._load.counts
        loads = [counts.get(r.id, 0) for r in candidates]
        fewest = min(loads)
        tied = [r for r, load in zip(candidates, loads) if load == fewest]
        turn = next(self._turns.setdefault(request.model, itertools.count()))
        return tied[turn % len(tied)]


def replicas_by_model(replicas: Iterable[Replica]) -> dict[str, list[Replica]]:
    """Return ``replicas`` grouped by model, for :meth:`ReplicaTable.replace_all`."""
    grouped: dict[str, list[Replica]] = {}
    for replica in replicas:
        grouped.setdefault(replica.model, []).append(replica)
    return grouped
