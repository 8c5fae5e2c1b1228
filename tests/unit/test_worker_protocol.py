"""What crosses the gateway-worker channel: settings, KV deltas, and merged metrics
(llmgw/router/workers/protocol.py)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from llmgw.config import GatewayConfig, RoutingConfig, ServingConfig, TracingConfig
from llmgw.router.kvindex import KvIndex
from llmgw.router.metrics import GatewayMetrics
from llmgw.router.settings import GatewaySettings
from llmgw.router.usage import UsageBatch, UsageCounts
from llmgw.router.workers.protocol import (
    SHARED_FAMILIES, decode_kv_delta, decode_settings, decode_usage, encode_kv_delta, encode_metrics, encode_usage,
    merge_metrics, worker_config,
)
from llmgw.spec import KvDelta


def through_channel(value: object) -> object:
    """Return ``value`` as the other end of a channel sees it (msgpack both ways)."""
    return msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False, strict_map_key=False)


@pytest.mark.parametrize("tracing", [None, TracingConfig(), TracingConfig(endpoint="http://collector:4318")])
def test_a_worker_gets_the_settings_with_its_share_of_the_admission_limits(tracing: TracingConfig | None) -> None:
    settings = GatewaySettings(
        gateway=GatewayConfig(connect_timeout=1.5, workers=3),
        serving=ServingConfig(max_request_bytes=1000, max_inflight_per_replica=10, queue_size=7, queue_timeout=2.0),
        routing=RoutingConfig(policy="round-robin"), tracing=tracing,
    )
    config = through_channel(worker_config(2, "127.0.0.1", 8080, settings))
    assert isinstance(config, dict)
    assert (config["t"], config["index"], config["host"], config["port"]) == ("config", 2, "127.0.0.1", 8080)
    got = decode_settings(config)
    share = ServingConfig(max_request_bytes=1000, max_inflight_per_replica=4, queue_size=3, queue_timeout=2.0)
    assert got == GatewaySettings(gateway=settings.gateway, serving=share, routing=settings.routing,
                                  tracing=tracing if tracing is not None and tracing.endpoint else None)


def test_a_worker_gets_the_usage_journal_directory_and_reports_its_mark(tmp_path: Path) -> None:
    settings = GatewaySettings(gateway=GatewayConfig(workers=2), usage_journal=tmp_path / "journal")
    assert decode_settings(through_channel(worker_config(0, "127.0.0.1", 0, settings))).usage_journal == (
        tmp_path / "journal")
    batch = UsageBatch({("acme", "m"): UsageCounts(2, 3, 4)}, {"j1": 7})
    assert decode_usage(through_channel(encode_usage(batch))) == batch  # type: ignore[arg-type]
    assert not decode_usage({})


@pytest.mark.parametrize("delta", [
    KvDelta(),
    KvDelta(reset=True),
    KvDelta(reset=True, stored=(1, 2, 3), block_size=16, events_applied=7, gaps=1, resyncs=2),
    KvDelta(stored=(2**64 - 1, 0, 12345678901234567890), removed=(5, 2**63), block_size=32, events_applied=9),
])
def test_kv_delta_survives_the_channel(delta: KvDelta) -> None:
    assert decode_kv_delta(through_channel(encode_kv_delta(delta))) == delta  # type: ignore[arg-type]


def test_a_kv_delta_keeps_the_order_of_its_hashes() -> None:
    delta = KvDelta(reset=True, stored=(9, 3, 7, 1), block_size=16)
    decoded = decode_kv_delta(through_channel(encode_kv_delta(delta)))  # type: ignore[arg-type]
    index = KvIndex()
    index.apply("r", decoded)
    entry = index.replica("r")
    assert entry is not None and list(entry.blocks) == [9, 3, 7, 1]  # oldest first, as stored


def test_a_malformed_kv_delta_is_refused() -> None:
    with pytest.raises(ValueError, match="7 fields"):
        decode_kv_delta([True, [1], []])


def samples(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def worker_metrics(blocks: list[int], events: int, requests: int) -> list[list[object]]:
    """One worker's encoded metrics: a KV index of ``blocks`` from replica "r" and ``requests`` served."""
    metrics = GatewayMetrics(lambda name: name == "m")
    index = KvIndex()
    index.apply("r", KvDelta(reset=True, stored=tuple(blocks), block_size=16, events_applied=events))
    metrics.bind_kv(index)
    metrics.alarm("m", "r", True)
    for _ in range(requests):
        metrics.usage("t", "m", 1, 1)
    return encode_metrics(metrics.registry)


def test_kv_index_families_are_not_summed_over_workers() -> None:
    # Worker 1 lags by one delta: the merge reports the most up-to-date worker's view.
    merged = samples(merge_metrics([worker_metrics([1, 2, 3], 3, 2), worker_metrics([1, 2], 2, 5)]))
    assert merged[("llmgw_gateway_kv_index_blocks", ())] == 3
    assert merged[("llmgw_gateway_kv_events_applied_total", (("replica", "r"),))] == 3
    assert merged[("llmgw_gateway_kv_index_evicted_total", ())] == 0
    assert merged[("llmgw_gateway_kv_hash_alarm", (("model", "m"), ("replica", "r")))] == 1
    # Per-worker shares are still added up.
    assert merged[("llmgw_gateway_prompt_tokens_total", (("model", "m"), ("tenant", "t")))] == 7


def test_shared_families_name_real_families() -> None:
    names = {family.name for family in GatewayMetrics(lambda name: True).registry.collect()}
    assert SHARED_FAMILIES <= names


def test_counters_are_summed_and_created_takes_the_earliest() -> None:
    parts = []
    for n in (1, 4):
        registry = CollectorRegistry()
        Counter("c", "help", registry=registry).inc(n)
        parts.append(encode_metrics(registry))
    created = [p[0][3][1][2] for p in parts]
    merged = samples(merge_metrics(parts))
    assert merged[("c_total", ())] == 5
    assert merged[("c_created", ())] == min(created)
