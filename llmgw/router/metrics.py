"""Prometheus metrics of the gateway, in a registry of their own.

One :class:`GatewayMetrics` per gateway app. It owns a private
``prometheus_client.CollectorRegistry`` (never the process-global one: several gateways
run in one test process, and a library must not register into a host program's
registry). ``GET /metrics`` on the gateway renders it with :meth:`GatewayMetrics.render`.

API (all synchronous, cheap, never raise on odd label values; call from the trio thread):

Request path (admission, routing, upstream)::

    metrics.admitted(tenant, model)                  # a request passed admission
    metrics.queued(tenant, model, delta)             # +1 when it waits in a model's queue, -1 when it leaves
    metrics.shed(tenant, model, reason)              # refused by admission (e.g. "concurrency", "rpm",
                                                     #   "tpm", "queue_full", "queue_timeout")
    metrics.usage(tenant, model, prompt_tokens, completion_tokens)   # from the engine's usage fields
    metrics.upstream_error(replica, kind)            # kind: "connect", "timeout", "status_5xx",
                                                     #   "protocol", "first_byte_timeout", "chunk_timeout"
    metrics.retry(model)                             # a request was retried on another replica
    metrics.usage_journal_failed()                   # a finished request's usage was not journaled
    metrics.in_flight(replica, delta)                # +1 when sent to a replica, -1 when finished
                                                     #   (no-op when ``in_flight_source`` is given)
    metrics.forget_replica(replica)                  # drop a departed replica's series

LoRA adapters loaded on demand (:mod:`llmgw.router.adapters`)::

    metrics.adapter_loaded(adapter, seconds)         # a replica loaded ``adapter`` in ``seconds``
    metrics.adapter_load_failed(adapter)             # a load was refused, failed or timed out
    metrics.adapter_unloaded(adapter)                # unloaded to make room (least recently used)

ASGI middleware (:mod:`llmgw.router.instrument`)::

    metrics.request_done(model, tenant, status, seconds)   # one finished HTTP request
    metrics.first_chunk(model, seconds)                    # time to first body chunk of a stream
    gaps = metrics.chunk_gaps(model)                       # one stream's gaps between body chunks:
    gaps.add(seconds); gaps.flush()                        #   each counted, all recorded at its end

In-flight per replica is read at scrape time: pass ``in_flight_source`` (e.g. the
gateway's ``LoadTracker.snapshot``) and the gauge can never drift from the load the
router balances on, at no cost per request; ``replica_ids`` (replicas in the table) are
reported with 0 when idle, so a replica's series returns to 0 rather than vanishing.

Label cardinality is bounded: a ``model`` not in the catalog (``is_known_model``) is
recorded as ``"unknown"``, so clients cannot create series by inventing model names.
An empty tenant or model is recorded as ``""`` / ``"unknown"``. Tenants come from API keys
(operator-made) and replicas from the cluster, so both are bounded by configuration;
:meth:`forget_replica` removes the series of a replica that is gone.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llmgw.config.sections import ROUTING_POLICIES
from llmgw.router.prefixtree import CHUNK_CHARS
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString
from prometheus_client.registry import Collector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Whole-request latency, seconds. LLM requests range from a cached embedding (a few ms)
# to a long non-streamed generation on a CPU replica (minutes); the upper buckets
# follow the upstream read deadline (600 s).
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)

# Time to first token (first body chunk of a streamed response), seconds: prefill of a
# short prompt on a GPU is milliseconds, a long prompt behind a full batch tens of seconds.
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

# Gap between two chunks of a stream (inter-token latency), seconds: a decoding step is
# about 5-100 ms; gaps of seconds mean preemption or a stalled engine.
CHUNK_GAP_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

# Time for a replica to load a LoRA adapter, seconds: a small adapter from local disk
# loads in milliseconds, a large one on a busy engine in tens of seconds (the gateway
# gives up at adapters.LOAD_TIMEOUT_S).
ADAPTER_LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

UNKNOWN = "unknown"

# Prefix of every metric name.
PREFIX = "llmgw_gateway"
#: The hash-agreement alarm gauge (1 while raised, by model and replica).
KV_HASH_ALARM = f"{PREFIX}_kv_hash_alarm"
#: The prefix tree's learnt bound per replica: the same replica's in every worker (SHARED_FAMILIES).
PREFIX_TREE_BOUND = f"{PREFIX}_prefix_tree_bound_nodes"


class GatewayMetrics:
    """The gateway's metrics; see the module docstring for the API.

    ``is_known_model(name)`` says whether a model is in the catalog (e.g.
    ``ReplicaTable.has_model``); None records every non-empty name as is (tests only).
    ``in_flight_source()`` returns in-flight counts by replica id (e.g.
    ``LoadTracker.snapshot``) and ``replica_ids()`` the replicas to report even when idle;
    both are called only when ``/metrics`` is scraped.
    """

    def __init__(
        self,
        is_known_model: Callable[[str], bool] | None = None,
        *,
        in_flight_source: Callable[[], Mapping[str, int]] | None = None,
        replica_ids: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._is_known_model = is_known_model
        self._own_in_flight: dict[str, int] = {}
        self._in_flight_source = in_flight_source
        self._replica_ids = replica_ids
        self._error_labels: set[tuple[str, str]] = set()
        r = self.registry
        # The series every request adds to are _DictCounter and _BatchedHistogram: an update
        # is a dict entry's, not prometheus_client's lock and checks (see _DictCounter).
        self.requests = _DictCounter(
            f"{PREFIX}_requests", "HTTP requests finished, by model, tenant and status code.",
            ("model", "tenant", "status"), registry=r,
        )
        self.request_seconds = _BatchedHistogram(
            f"{PREFIX}_request_duration_seconds",
            "Time from request start to the last response byte, by model.",
            "model", LATENCY_BUCKETS, registry=r,
        )
        self.ttft_seconds = _BatchedHistogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from request start to the first body chunk of a streamed response, by model.",
            "model", TTFT_BUCKETS, registry=r,
        )
        # Observed per event of every stream: counted per stream, added here when it ends.
        self.chunk_gap_seconds = _BatchedHistogram(
            f"{PREFIX}_inter_chunk_seconds",
            "Gap between consecutive body chunks of a streamed response, by model.",
            "model", CHUNK_GAP_BUCKETS, registry=r,
        )
        r.register(_InFlightCollector(self._in_flight_counts))
        self.queued_gauge = Gauge(
            f"{PREFIX}_queued", "Requests waiting in admission queues, by tenant and model.",
            ("tenant", "model"), registry=r,
        )
        self.admitted_total = _DictCounter(
            f"{PREFIX}_admitted", "Requests that passed admission, by tenant and model.",
            ("tenant", "model"), registry=r,
        )
        self.shed_total = Counter(
            f"{PREFIX}_shed", "Requests refused by admission, by tenant, model and reason.",
            ("tenant", "model", "reason"), registry=r,
        )
        self.prompt_tokens = _DictCounter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens reported by engines, by tenant and model.",
            ("tenant", "model"), registry=r,
        )
        self.completion_tokens = _DictCounter(
            f"{PREFIX}_completion_tokens", "Completion tokens reported by engines, by tenant and model.",
            ("tenant", "model"), registry=r,
        )
        self.upstream_errors = Counter(
            f"{PREFIX}_upstream_errors", "Failed exchanges with replicas, by replica and kind.",
            ("replica", "kind"), registry=r,
        )
        self.retries = Counter(
            f"{PREFIX}_upstream_retries", "Requests retried on another replica, by model.",
            ("model",), registry=r,
        )
        self.usage_journal_failures = Counter(
            f"{PREFIX}_usage_journal_write_failures",
            "Finished requests whose usage could not be journaled (disk full?): a crash before the "
            "next usage flush would lose them.", registry=r,
        )
        self.routing_policy_gauge = Gauge(
            f"{PREFIX}_routing_policy", "1 for the routing policy this gateway process routes by (server.yaml "
            "routing.policy, or the cluster setting routing.policy over it), 0 for the others; a worker pool "
            "reports how many of its workers route by each.", ("policy",), registry=r,
        )
        # KV-aware routing (llmgw/router/kvrouting.py): decisions, hit share, hash agreement.
        self.routing_decisions = _DictCounter(
            f"{PREFIX}_routing_decisions", "Routing decisions among several replicas, by model and kind "
            "(precise: KV events; approximate: prefix tree; miss: no replica held a leading block).",
            ("model", "kind"), registry=r,
        )
        self.routing_matched_blocks = _DictCounter(
            f"{PREFIX}_routing_matched_blocks", "Leading prompt blocks the chosen replica had reported holding "
            "(KV events) when a request was routed to it, by model (divide by routing_prompt_blocks for the "
            "router's hit-share estimate; engine_cached_prompt_tokens is the engines' own count).",
            ("model",), registry=r,
        )
        self.routing_prompt_blocks = _DictCounter(
            f"{PREFIX}_routing_prompt_blocks", "Prompt blocks of the routed requests the router hashed, by model.",
            ("model",), registry=r,
        )
        self.engine_prompt_tokens = _DictCounter(
            f"{PREFIX}_engine_prompt_tokens", "Prompt tokens of answered requests, by model, as the engines "
            "counted them (divide engine_cached_prompt_tokens by it for the engines' own hit share).",
            ("model",), registry=r,
        )
        self.engine_cached_prompt_tokens = _DictCounter(
            f"{PREFIX}_engine_cached_prompt_tokens", "Prompt tokens the engines found in their prefix caches, "
            "by model (usage.prompt_tokens_details.cached_tokens: vLLM with --enable-prompt-tokens-details, "
            "which the agent sets, and the simulator).", ("model",), registry=r,
        )
        self.kv_mismatches = Counter(
            f"{PREFIX}_kv_hash_mismatches", "Routed requests whose block hashes the replica never reported "
            "while it reported others, by model and replica.", ("model", "replica"), registry=r,
        )
        self.kv_alarm = Gauge(
            KV_HASH_ALARM, "1 while router and engine block hashes disagree for a replica "
            "(seed, block size, tokenizer or template), by model and replica.", ("model", "replica"), registry=r,
        )
        self.tokenizer_alarm_gauge = Gauge(
            f"{PREFIX}_tokenizer_alarm", "1 while the gateway's own tokenization of a replica's prompts "
            "disagrees with the engine's /tokenize (the replica is then tokenized by the engine), by model "
            "and replica.", ("model", "replica"), registry=r,
        )
        self.prompts_tokenized = _DictCounter(
            f"{PREFIX}_prompts_tokenized", "Prompts the router tokenized to hash their KV blocks, by model and "
            "by whom: 'gateway' (the model's own tokenizer files, loaded in the gateway) or 'engine' (a /tokenize "
            "call).", ("model", "by"), registry=r,
        )
        self.tokenizer_checks = Counter(
            f"{PREFIX}_tokenizer_checks", "Sampled comparisons of the gateway's token ids with the engine's "
            "/tokenize, by model and result ('agreed', 'disagreed').", ("model", "result"), registry=r,
        )
        self._kv_index: Any = None
        r.register(_KvIndexCollector(lambda: self._kv_index))
        self._prefix_tree: Callable[[], Any] = lambda: None
        r.register(_PrefixTreeCollector(lambda: self._prefix_tree()))
        # LoRA adapters, labelled by adapter name (catalog-bounded, like models).
        self.adapter_loads = Counter(
            f"{PREFIX}_adapter_loads", "LoRA adapters loaded on replicas by the gateway, by adapter.",
            ("adapter",), registry=r,
        )
        self.adapter_load_failures = Counter(
            f"{PREFIX}_adapter_load_failures", "LoRA adapter loads that failed or timed out, by adapter.",
            ("adapter",), registry=r,
        )
        self.adapter_unloads = Counter(
            f"{PREFIX}_adapter_unloads", "LoRA adapters unloaded to make room, by adapter.",
            ("adapter",), registry=r,
        )
        self.adapter_load_seconds = Histogram(
            f"{PREFIX}_adapter_load_seconds", "Time a replica took to load a LoRA adapter.",
            buckets=ADAPTER_LOAD_BUCKETS, registry=r,
        )

    def bind_sources(
        self,
        is_known_model: Callable[[str], bool],
        in_flight_source: Callable[[], Mapping[str, int]],
        replica_ids: Callable[[], Iterable[str]],
    ) -> None:
        """Read the catalog, in-flight counts and replica ids from the gateway's own state
        (the :class:`~llmgw.router.app.Gateway` calls this with its table and load tracker).
        """
        self._is_known_model = is_known_model
        self._in_flight_source = in_flight_source
        self._replica_ids = replica_ids

    def bind_kv(self, index: Any) -> None:
        """Report the KV index's size and each replica's event counters (a
        :class:`~llmgw.router.kvindex.KvIndex`) at scrape time."""
        self._kv_index = index

    def bind_prefix_tree(self, tree: Callable[[], Any]) -> None:
        """Report, at scrape time, the prefix tree ``tree()`` returns (a
        :class:`~llmgw.router.prefixtree.PrefixTree`, or None when the policy has none): the
        nodes it holds per replica and the bound it learnt for each."""
        self._prefix_tree = tree

    def routing_policy(self, name: str) -> None:
        """Report that this process routes by the policy ``name`` now (one of ROUTING_POLICIES)."""
        for policy in ROUTING_POLICIES:
            self.routing_policy_gauge.labels(policy).set(1 if policy == name else 0)

    # -- routing (a llmgw.router.replicas.RoutingObserver) --------------------------------

    def decision(self, model: str, kind: str, matched: int, total: int) -> None:
        """Count one routing decision of ``kind`` with ``matched`` of ``total`` prompt blocks
        reported held (``total`` 0: a request the router did not hash)."""
        label = self.model_label(model)
        self.routing_decisions.inc((label, kind))
        if total > 0:
            by_model = (label,)
            self.routing_prompt_blocks.inc(by_model, total)
            if matched > 0:
                self.routing_matched_blocks.inc(by_model, matched)

    def mismatch(self, model: str, replica_id: str) -> None:
        """Count one routed request whose blocks ``replica_id`` never reported."""
        self.kv_mismatches.labels(self.model_label(model), replica_id or UNKNOWN).inc()

    def alarm(self, model: str, replica_id: str, raised: bool) -> None:
        """Set the hash-agreement alarm gauge of ``replica_id`` (1 raised, 0 cleared)."""
        self.kv_alarm.labels(self.model_label(model), replica_id or UNKNOWN).set(1 if raised else 0)

    def tokenizer_alarm(self, model: str, replica_id: str, raised: bool) -> None:
        """Set the tokenizer alarm gauge of ``replica_id`` (1 raised, 0 cleared)."""
        self.tokenizer_alarm_gauge.labels(self.model_label(model), replica_id or UNKNOWN).set(1 if raised else 0)

    def tokenized(self, model: str, by: str) -> None:
        """Count one prompt tokenized ``by`` "gateway" or "engine"."""
        self.prompts_tokenized.inc((self.model_label(model), by))

    def tokenizer_check(self, model: str, agreed: bool) -> None:
        """Count one sampled tokenizer comparison."""
        self.tokenizer_checks.labels(self.model_label(model), "agreed" if agreed else "disagreed").inc()

    # -- labels -------------------------------------------------------------------------

    def model_label(self, model: object) -> str:
        """Return the label value for ``model``: itself if in the catalog, else ``"unknown"``."""
        if not isinstance(model, str) or not model:
            return UNKNOWN
        known = self._is_known_model
        if known is None or known(model):
            return model
        return UNKNOWN

    # -- request path -------------------------------------------------------------------

    def admitted(self, tenant: str, model: str) -> None:
        """Count one request of ``tenant`` for ``model`` that passed admission."""
        self.admitted_total.inc((tenant or "", self.model_label(model)))

    def queued(self, tenant: str, model: str, delta: int) -> None:
        """Add ``delta`` (+1 on entering, -1 on leaving) to the queue gauge of ``tenant``/``model``."""
        self.queued_gauge.labels(tenant or "", self.model_label(model)).inc(delta)

    def shed(self, tenant: str, model: str, reason: str) -> None:
        """Count one request refused by admission, with a short fixed ``reason`` word."""
        self.shed_total.labels(tenant or "", self.model_label(model), reason or UNKNOWN).inc()

    def usage(self, tenant: str, model: str, prompt_tokens: int, completion_tokens: int,
              cached_tokens: int = 0) -> None:
        """Add an engine's reported token usage (``cached_tokens``: of the prompt, found in
        its prefix cache); negative or non-int values are ignored."""
        label = self.model_label(model)
        key = (tenant or "", label)
        by_model = (label,)
        if isinstance(prompt_tokens, int) and prompt_tokens > 0:
            self.prompt_tokens.inc(key, prompt_tokens)
            self.engine_prompt_tokens.inc(by_model, prompt_tokens)
            if isinstance(cached_tokens, int) and cached_tokens > 0:
                self.engine_cached_prompt_tokens.inc(by_model, min(cached_tokens, prompt_tokens))
        if isinstance(completion_tokens, int) and completion_tokens > 0:
            self.completion_tokens.inc(key, completion_tokens)

    def upstream_error(self, replica: str, kind: str) -> None:
        """Count one failed exchange with ``replica`` (a shard id) of the given ``kind``."""
        labels = (replica or UNKNOWN, kind or UNKNOWN)
        self._error_labels.add(labels)
        self.upstream_errors.labels(*labels).inc()

    def retry(self, model: str) -> None:
        """Count one retry of a request for ``model`` on another replica."""
        self.retries.labels(self.model_label(model)).inc()

    def usage_journal_failed(self) -> None:
        """Count one request whose usage the journal could not write (:mod:`llmgw.usage_journal`)."""
        self.usage_journal_failures.inc()

    def adapter_loaded(self, adapter: str, seconds: float) -> None:
        """Count one adapter load that succeeded, and how long it took."""
        self.adapter_loads.labels(adapter or UNKNOWN).inc()
        self.adapter_load_seconds.observe(max(seconds, 0.0))

    def adapter_load_failed(self, adapter: str) -> None:
        """Count one adapter load that was refused, failed or timed out."""
        self.adapter_load_failures.labels(adapter or UNKNOWN).inc()

    def adapter_unloaded(self, adapter: str) -> None:
        """Count one adapter unloaded to make room for another."""
        self.adapter_unloads.labels(adapter or UNKNOWN).inc()

    def in_flight(self, replica: str, delta: int) -> None:
        """Add ``delta`` (+1 when a request is sent, -1 when it ends) to ``replica``'s gauge."""
        if self._in_flight_source is not None:
            return
        replica = replica or UNKNOWN
        count = self._own_in_flight.get(replica, 0) + delta
        if count > 0:
            self._own_in_flight[replica] = count
        else:
            self._own_in_flight.pop(replica, None)

    def forget_replica(self, replica: str) -> None:
        """Remove every series labelled with ``replica`` (it left the cluster); no-op if none."""
        self._own_in_flight.pop(replica, None)
        for labels in [key for key in self._error_labels if key[0] == replica]:
            self._error_labels.discard(labels)
            self.upstream_errors.remove(*labels)

    # -- middleware ---------------------------------------------------------------------

    def request_done(self, model: str, tenant: str, status: int, seconds: float) -> None:
        """Record one finished HTTP request (``status`` is the response code sent, or 499
        when the client went away before a response started)."""
        label = self.model_label(model)
        self.requests.inc((label, tenant or "", status))
        self.request_seconds.observe(label, seconds)

    def first_chunk(self, model: str, seconds: float) -> None:
        """Record the time to the first body chunk of a streamed response."""
        self.ttft_seconds.observe(self.model_label(model), seconds)

    def chunk_gaps(self, model: str) -> ChunkGaps:
        """Return the tally of one stream's chunk gaps: :meth:`ChunkGaps.add` per gap,
        :meth:`ChunkGaps.flush` when the stream ends (before then, they are not exposed)."""
        return self.chunk_gap_seconds.tally(self.model_label(model))

    def _in_flight_counts(self) -> dict[str, int]:
        """Return in-flight counts by replica, idle known replicas included with 0."""
        source = self._in_flight_source
        counts = dict(source() if source is not None else self._own_in_flight)
        if self._replica_ids is not None:
            for replica in self._replica_ids():
                counts.setdefault(replica, 0)
        return counts

    # -- exposition ---------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """Return ``(body, content_type)`` of the Prometheus text exposition of this registry."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _PrefixTreeCollector(Collector):
    """Reports the approximate router's prefix tree per replica: nodes held, and the bound
    learnt from what the engine reports holding (llmgw/router/prefixtree.py)."""

    def __init__(self, tree: Callable[[], Any]) -> None:
        self._tree = tree

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        nodes, bound = self._families()
        tree = self._tree()
        if tree is not None:
            for rid in sorted(tree.replica_ids()):
                nodes.add_metric([rid], tree.size(rid))
                bound.add_metric([rid], tree.bound(rid))
        yield from (nodes, bound)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(f"{PREFIX}_prefix_tree_nodes", f"Nodes ({CHUNK_CHARS} characters of prompt text) "
                              "the approximate router believes each replica holds.", labels=["replica"]),
            GaugeMetricFamily(PREFIX_TREE_BOUND, "The most nodes the approximate router keeps "
                              "for each replica, learnt from the cached tokens its engine reports.", labels=["replica"]),
        )


class _KvIndexCollector(Collector):
    """Reports the KV index's size and per-replica event counters from the bound index."""

    def __init__(self, index: Callable[[], Any]) -> None:
        self._index = index

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        size, events, gaps, resyncs, evicted = self._families()
        index = self._index()
        if index is not None:
            size.add_metric([], len(index))
            evicted.add_metric([], index.evicted)
            for rid in sorted(index.replica_ids()):
                entry = index.replica(rid)
                if entry is not None:
                    events.add_metric([rid], entry.events_applied)
                    gaps.add_metric([rid], entry.gaps)
                    resyncs.add_metric([rid], entry.resyncs)
        yield from (size, events, gaps, resyncs, evicted)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily(f"{PREFIX}_kv_index_blocks", "Entries (block, replica) in the router's KV index."),
            CounterMetricFamily(f"{PREFIX}_kv_events_applied", "KV events applied by each replica's agent "
                                "subscriber (cumulative, as last reported).", labels=["replica"]),
            CounterMetricFamily(f"{PREFIX}_kv_event_gaps", "KV event sequence gaps seen by each replica's "
                                "agent subscriber.", labels=["replica"]),
            CounterMetricFamily(f"{PREFIX}_kv_resyncs", "Full resyncs of each replica's KV mirror.",
                                labels=["replica"]),
            CounterMetricFamily(f"{PREFIX}_kv_index_evicted", "Index entries dropped by the index's memory bound."),
        )


#: Families about state every gateway worker holds a copy of (the KV index the control
#: plane feeds them all), that any worker may raise (the hash alarm) or that each learns
#: for the same replica (the prefix tree's bound): merged across workers by the largest
#: value, not the sum (llmgw/router/workers/protocol.py).
SHARED_FAMILIES = frozenset({family.name for family in _KvIndexCollector._families()}
                            | {KV_HASH_ALARM, PREFIX_TREE_BOUND})


class ChunkGaps:
    """One stream's observations of a :class:`_BatchedHistogram`, counted here (a bisect and
    two additions each) and added to the histogram at :meth:`flush`.

    A histogram's ``observe`` takes two locks and walks the buckets: at one observation per
    relayed event, a measurable part of the gateway's CPU per event.
    """

    __slots__ = ("_owner", "_label", "_bounds", "_counts", "_sum")

    def __init__(self, owner: _BatchedHistogram, label: str, bounds: Sequence[float]) -> None:
        self._owner = owner
        self._label = label
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def add(self, seconds: float) -> None:
        """Count one observation."""
        self._counts[bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def flush(self) -> None:
        """Add what was counted since the last flush to the histogram."""
        if any(self._counts):
            self._owner.add(self._label, self._counts, self._sum)
            self._counts = [0] * len(self._counts)
            self._sum = 0.0


class _BatchedHistogram(Collector):
    """A histogram with one label, observed one value at a time (:meth:`observe`) or in
    batches (:meth:`tally`, :class:`ChunkGaps`), exposed as a ``prometheus_client.Histogram``
    is (buckets, count, sum, created). Like :class:`_DictCounter`: no locks, trio thread only."""

    def __init__(self, name: str, documentation: str, label: str, buckets: Sequence[float], *,
                 registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._label = label
        self._bounds = tuple(sorted(b for b in buckets if b != float("inf")))
        self._counts: dict[str, list[int]] = {}  # label value -> count per bucket, the last for +Inf
        self._sums: dict[str, float] = {}
        self._created: dict[str, float] = {}
        registry.register(self)

    def tally(self, label: str) -> ChunkGaps:
        """Return a new :class:`ChunkGaps` for ``label``'s series."""
        return ChunkGaps(self, label, self._bounds)

    def observe(self, label: str, value: float) -> None:
        """Add one observation ``value`` to ``label``'s series."""
        counts = self._counts.get(label)
        if counts is None:
            counts = self._series(label)
        counts[bisect_left(self._bounds, value)] += 1
        self._sums[label] += value

    def add(self, label: str, counts: Sequence[int], total: float) -> None:
        """Add ``counts`` (one per bucket, the last for +Inf) and their sum ``total``."""
        mine = self._counts.get(label)
        if mine is None:
            mine = self._series(label)
        for i, count in enumerate(counts):
            mine[i] += count
        self._sums[label] += total

    def _series(self, label: str) -> list[int]:
        counts = self._counts[label] = [0] * (len(self._bounds) + 1)
        self._sums[label] = 0.0
        self._created[label] = time.time()
        return counts

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=[self._label])]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=[self._label])
        for label, counts in sorted(self._counts.items()):
            cumulative = 0
            buckets = []
            for bound, count in zip((*self._bounds, float("inf")), counts):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric([label], buckets, self._sums[label])
            family.add_sample(self._name + "_created", {self._label: label}, self._created[label])
        yield family


class _DictCounter(Collector):
    """A labelled counter whose series are entries of a dict, keyed by the tuple of label
    values (any values; exposed as their ``str``): :meth:`inc` is one dict update.

    ``prometheus_client.Counter`` takes a lock and validates on every increment (and
    ``labels()`` looks the child up), a measurable share of the gateway's CPU per request.
    The gateway updates its metrics on the trio thread only, and the registry collects on
    it too, so no lock is needed. Exposed as a ``Counter`` is (``_total`` and ``_created``).
    """

    def __init__(self, name: str, documentation: str, labels: Sequence[str], *,
                 registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = tuple(labels)
        self._values: dict[tuple[Any, ...], float] = {}
        self._created: dict[tuple[Any, ...], float] = {}
        registry.register(self)

    def inc(self, key: tuple[Any, ...], amount: float = 1) -> None:
        """Add ``amount`` to the series of label values ``key`` (one per label, in order)."""
        values = self._values
        if key in values:
            values[key] += amount
        else:
            values[key] = amount
            self._created[key] = time.time()

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self._name, self._documentation, labels=self._labels)]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labels)
        for key, value in sorted(self._values.items(), key=lambda item: tuple(map(str, item[0]))):
            family.add_metric([str(part) for part in key], value, created=self._created[key])
        yield family


class _InFlightCollector(Collector):
    """Reports ``llmgw_gateway_in_flight{replica}`` from a callable, at scrape time."""

    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = counts

    def describe(self) -> list[GaugeMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for replica, count in sorted(self._counts().items()):
            family.add_metric([replica], count)
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(f"{PREFIX}_in_flight", "Requests in flight on each replica.", labels=["replica"])
