"""The control-plane <-> gateway-worker wire protocol: its messages, as plain msgpack values.

Each message is a dict whose ``"t"`` names its kind, sent over a
:class:`~llmgw.router.workers.channel.Channel`. Protocol::

    control -> worker   {"t": "config", ...}               first: where to listen, settings (worker_config)
    control -> worker   {"t": "kvcopy", "replicas"}         a full KV copy follows: forget every other replica
    control -> worker   {"t": "kv", "replica", "delta"}     one KV-cache delta (encode_kv_delta), in
                                                            order; a full copy (header + reset deltas) comes
                                                            before the first state, again after an overflow
    control -> worker   {"t": "kvforget", "replica"}        the replica's KV state is gone
    control -> worker   {"t": "shares", "version", ...}     the gateway's shares of the tenant limits
                                                            (encode_shares); before the first state, then
                                                            whenever they change
    control -> worker   {"t": "state", "version", ...}      routing state (whole); first one before listening
    worker  -> control  {"t": "applied", "version"}         after every state
    worker  -> control  {"t": "shares_applied", "version"}  after every shares message
    worker  -> control  {"t": "ready", "port", "pid"}       listening (or {"t": "failed", "error"})
    worker  -> control  {"t": "report", "id", ...}          usage drained (with its journal mark), in-flight, admission counters,
                                                            KV hash alarms ("kv_alarms", a list of strings);
                                                            every REPORT_INTERVAL_S (id None) or when asked
    control -> worker   {"t": "collect", "id", "metrics"}   asks for a report now (metrics: with samples)
    worker  -> control  {"t": "scrape", "id"}               GET /metrics arrived: merge everyone's samples
    control -> worker   {"t": "scraped", "id", "body"}      the merged exposition
    worker  -> control  {"t": "api", "id", "request"}       an /api/v1/* call (llmgw/router/admin_api.py)
    control -> worker   {"t": "api_reply", "id", "status", "payload"}   the control plane's answer
    control -> worker   {"t": "stop"}                       shut down gracefully (EOF does the same)

Down (control plane -> worker): the worker's settings (:func:`worker_config`), the
routing state as one snapshot (catalog models with their ready replicas and ``created``
times, the active API keys with their tenants' limits, ``serving.stopped``, the cluster
setting ``routing``), the engines' KV-cache deltas one by one (:func:`encode_kv_delta`), and the gateway's shares of
the tenants' limits (:func:`encode_shares`; each worker enforces ``1/workers`` of them,
:func:`~llmgw.router.admission.tenant_limit`). Up (worker -> control
plane): usage counts, in-flight per replica, admission counters, and on request the
worker's Prometheus samples. Functions here are pure conversions; nothing does I/O.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import attrs
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from llmgw.config import Address, AuthConfig, GatewayConfig, MetricsConfig, RoutingConfig, ServingConfig, TracingConfig
from llmgw.spec import KvDelta

from ..admission import AdmissionShares, TenantCounters, TenantShare
from ..auth import KeyEntry, Tenant
from ..metrics import SHARED_FAMILIES
from ..replicas import ModelInfo, Replica, ReplicaTable
from ..settings import GatewaySettings
from ..usage import UsageBatch, UsageCounts
from .channel import Message


# -- settings (down, first) ----------------------------------------------------------------


def worker_config(index: int, host: str, port: int, settings: GatewaySettings) -> Message:
    """Return worker ``index``'s "config" message: where to listen, and ``settings`` with
    the per-model admission limits divided among ``settings.gateway.workers`` (each worker
    admits its share: docs/gateway.md; the tenant limits are divided by the worker's
    admission, which knows the worker count from ``settings.gateway``)."""
    workers = settings.gateway.workers
    serving = attrs.evolve(
        settings.serving,
        max_inflight_per_replica=math.ceil(settings.serving.max_inflight_per_replica / workers),
        queue_size=math.ceil(settings.serving.queue_size / workers),
    )
    tracing = settings.tracing
    return {
        "t": "config", "index": index, "host": host, "port": port,
        "settings": {
            "gateway": attrs.asdict(settings.gateway), "serving": attrs.asdict(serving),
            "auth": attrs.asdict(settings.auth), "routing": attrs.asdict(settings.routing),
            "tracing": attrs.asdict(tracing) if tracing is not None and tracing.endpoint else None,
            "usage_journal": str(settings.usage_journal) if settings.usage_journal is not None else None,
            "metrics": attrs.asdict(settings.metrics),
        },
    }


def decode_settings(config: Message) -> GatewaySettings:
    """Return the :class:`GatewaySettings` of a :func:`worker_config` message (limits
    already this worker's share). Raises KeyError or TypeError for a malformed one."""
    sections = config["settings"]
    tracing = sections.get("tracing")
    journal = sections.get("usage_journal")
    return GatewaySettings(
        gateway=GatewayConfig(**sections["gateway"]), serving=ServingConfig(**sections["serving"]),
        auth=AuthConfig(**sections["auth"]), routing=RoutingConfig(**sections["routing"]),
        tracing=TracingConfig(**tracing) if tracing else None,
        usage_journal=Path(journal) if journal else None,
        metrics=_decode_metrics(sections["metrics"]),
    )


def _decode_metrics(raw: Mapping[str, Any]) -> MetricsConfig:
    listen = raw["listen"]
    return MetricsConfig(listen=Address(**listen) if listen else None, token=str(raw["token"]))


# -- routing state (down) ----------------------------------------------------------------


def encode_table(table: ReplicaTable) -> dict[str, Any]:
    """Return the table's models, their replicas (with engine, adapters and secret), ``created``
    times and model info (engine, adapters, max_loaded_adapters) as msgpack values."""
    models = table.models()
    info = {m.name: table.model_info(m.name) for m in models}
    return {
        "created": {m.name: m.created for m in models},
        "replicas": {
            m.name: [
                [r.id, r.endpoint, r.node_id, r.engine, [list(pair) for pair in r.adapters], r.api_key]
                for r in table.replicas(m.name) or ()
            ]
            for m in models
        },
        "info": {name: [i.engine, list(i.adapters), i.max_loaded_adapters] for name, i in info.items()},
    }


def decode_table(
    data: Mapping[str, Any],
) -> tuple[dict[str, list[Replica]], dict[str, int], dict[str, ModelInfo]]:
    """Return ``(replicas, created, info)``, each by model, from :func:`encode_table`'s value."""
    replicas = {
        model: [
            Replica(rid, model, endpoint, node, engine, tuple((str(n), str(p)) for n, p in adapters), str(api_key))
            for rid, endpoint, node, engine, adapters, api_key in rows
        ]
        for model, rows in data["replicas"].items()
    }
    info = {
        model: ModelInfo(str(engine), tuple(map(str, adapters)), int(max_loaded))
        for model, (engine, adapters, max_loaded) in data.get("info", {}).items()
    }
    return replicas, dict(data["created"]), info


def encode_keys(entries: Iterable[KeyEntry]) -> list[list[Any]]:
    """Return the active keys with their tenants' limits as configured (each worker's
    admission enforces its part of them)."""
    out = []
    for entry in entries:
        t = entry.tenant
        models = sorted(t.models) if t.models is not None else None
        out.append([entry.key_id, entry.secret_hash, t.name, models, t.max_concurrency, t.rpm, t.tpm])
    return out


def decode_keys(rows: Sequence[Sequence[Any]]) -> list[KeyEntry]:
    """Return :class:`KeyEntry` values from :func:`encode_keys`' rows (tenants shared by name)."""
    tenants: dict[tuple[Any, ...], Tenant] = {}
    entries = []
    for key_id, secret_hash, name, models, concurrency, rpm, tpm in rows:
        spec = (name, tuple(models) if models is not None else None, concurrency, rpm, tpm)
        tenant = tenants.get(spec)
        if tenant is None:
            tenant = tenants[spec] = Tenant(
                name, frozenset(models) if models is not None else None, concurrency, rpm, tpm)
        entries.append(KeyEntry(key_id, bytes(secret_hash), tenant))
    return entries


def encode_shares(version: int, shares: AdmissionShares) -> Message:
    """Return the "shares" message of ``shares`` (the gateway's, not yet divided among workers)."""
    return {"t": "shares", "version": version, "default": shares.default,
            "tenants": {name: [s.concurrency, s.rpm, s.tpm] for name, s in shares.tenants.items()}}


def decode_shares(message: Mapping[str, Any]) -> AdmissionShares:
    """Return the :class:`AdmissionShares` of an :func:`encode_shares` message.

    Raises KeyError, TypeError or ValueError for a malformed one.
    """
    return AdmissionShares(float(message["default"]), {
        str(name): TenantShare(float(c), float(r), float(t)) for name, (c, r, t) in message["tenants"].items()})


class MirrorTable(ReplicaTable):
    """A worker's copy of the control plane's table, ``created`` times included."""

    def load_state(self, data: Mapping[str, Any]) -> None:
        """Make the table exactly :func:`encode_table`'s value: replicas, the control plane's
        ``created`` times and model info (engines, adapters)."""
        replicas, created, info = decode_table(data)
        self.replace_all(replicas, info)
        now = int(time.time())
        self._created = {model: int(created.get(model, now)) for model in replicas}


# -- KV-cache deltas (down) ---------------------------------------------------------------


def encode_kv_delta(delta: KvDelta) -> list[Any]:
    """Return ``delta`` as ``[reset, stored, removed, block_size, events_applied, gaps, resyncs]``
    (hashes as lists of ints: msgpack carries uint64)."""
    return [delta.reset, list(delta.stored), list(delta.removed), delta.block_size,
            delta.events_applied, delta.gaps, delta.resyncs]


def decode_kv_delta(data: Sequence[Any]) -> KvDelta:
    """Return the :class:`KvDelta` :func:`encode_kv_delta` encoded.

    Raises ValueError if ``data`` does not have its seven fields.
    """
    if len(data) != 7:
        raise ValueError(f"a KV delta has 7 fields, got {len(data)}")
    reset, stored, removed, block_size, events_applied, gaps, resyncs = data
    return KvDelta(bool(reset), tuple(map(int, stored)), tuple(map(int, removed)), int(block_size),
                   int(events_applied), int(gaps), int(resyncs))


# -- reports (up) -------------------------------------------------------------------------


def encode_usage(drained: UsageBatch) -> dict[str, Any]:
    """Return a drained :class:`UsageBatch` (counts and the worker's journal mark) as msgpack values."""
    rows = [[t, m, c.requests, c.prompt_tokens, c.completion_tokens] for (t, m), c in drained.counts.items()]
    return {"counts": rows, "marks": dict(drained.marks)}


def decode_usage(value: Mapping[str, Any]) -> UsageBatch:
    """Return the :class:`UsageBatch` of :func:`encode_usage`'s value."""
    counts = {(t, m): UsageCounts(int(r), int(p), int(c)) for t, m, r, p, c in value.get("counts") or ()}
    return UsageBatch(counts, {str(j): int(s) for j, s in (value.get("marks") or {}).items()})


def encode_admission(snapshot: Mapping[str, TenantCounters]) -> dict[str, list[int]]:
    return {name: [c.admitted, c.queued, c.shed, c.in_flight, c.tokens] for name, c in snapshot.items()}


def decode_admission(data: Mapping[str, Sequence[int]]) -> dict[str, TenantCounters]:
    return {name: TenantCounters(*map(int, row)) for name, row in data.items()}


# -- metrics ------------------------------------------------------------------------------

#: Samples whose value is a creation timestamp: the earliest wins instead of the sum.
_TIMESTAMP_SUFFIX = "_created"
# SHARED_FAMILIES (llmgw/router/metrics.py) describe the one KV index every worker holds a
# copy of (fed with the same deltas): the largest worker's value is taken (the most up to
# date: a worker may lag by a few deltas), not the sum (N times the truth); a hash alarm is
# 1 while raised in any worker.


def encode_metrics(registry: CollectorRegistry) -> list[list[Any]]:
    """Return every family of ``registry`` as ``[name, help, type, [[sample, labels, value], ...]]``."""
    return [
        [family.name, family.documentation, family.type, [[s.name, dict(s.labels), float(s.value)] for s in family.samples]]
        for family in registry.collect()
    ]


def merge_metrics(parts: Iterable[Sequence[Sequence[Any]]]) -> bytes:
    """Return the Prometheus text exposition of several workers' :func:`encode_metrics` output.

    Samples with the same name and labels are added up (counters, histogram buckets,
    sums and counts, and the in-flight and queued gauges are all per-worker shares of a
    total); ``*_created`` timestamps take the earliest; families in
    :data:`SHARED_FAMILIES` (the KV index, the same in every worker) take the largest.
    """
    families: dict[str, tuple[str, str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]] = {}
    for part in parts:
        for name, documentation, type_, samples in part:
            entry = families.setdefault(name, (documentation, type_, {}))
            values = entry[2]
            shared = name in SHARED_FAMILIES
            for sample_name, labels, value in samples:
                key = (sample_name, tuple(sorted(labels.items())))
                if key not in values:
                    values[key] = value
                elif sample_name.endswith(_TIMESTAMP_SUFFIX):
                    values[key] = min(values[key], value)
                elif shared:
                    values[key] = max(values[key], value)
                else:
                    values[key] = values[key] + value
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(families))
    return generate_latest(registry)


class _Merged:
    """A collector yielding fixed, already merged families."""

    def __init__(self, families: Mapping[str, tuple[str, str, Mapping[tuple[str, tuple[tuple[str, str], ...]], float]]]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        for name, (documentation, type_, values) in self._families.items():
            metric = Metric(name, documentation, type_)
            for (sample_name, labels), value in values.items():
                metric.add_sample(sample_name, dict(labels), value)
            yield metric
