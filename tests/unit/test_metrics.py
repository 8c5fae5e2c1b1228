"""GatewayMetrics on its own: labels, bounded cardinality, private registries, in-flight sources."""

from __future__ import annotations

import pytest

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from llmgw.config import GatewayConfig
from llmgw.router.http import upstream
from llmgw.router.metrics import CHUNK_GAP_BUCKETS, LATENCY_BUCKETS, TTFT_BUCKETS, GatewayMetrics


def samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    result = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            result[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return result


def test_request_path_api_records_each_series() -> None:
    metrics = GatewayMetrics(lambda name: name == "m")
    metrics.admitted("t", "m")
    metrics.queued("t", "m", 1)
    metrics.queued("t", "m", 1)
    metrics.queued("t", "m", -1)
    metrics.shed("t", "m", "rpm")
    metrics.usage("t", "m", 10, 5)
    metrics.usage("t", "m", -1, 0)  # nonsense from an engine is ignored
    metrics.upstream_error("r1", "connect")
    metrics.retry("m")
    got = samples(metrics)
    assert got[("llmgw_gateway_admitted_total", (("model", "m"), ("tenant", "t")))] == 1
    assert got[("llmgw_gateway_queued", (("model", "m"), ("tenant", "t")))] == 1
    assert got[("llmgw_gateway_shed_total", (("model", "m"), ("reason", "rpm"), ("tenant", "t")))] == 1
    assert got[("llmgw_gateway_prompt_tokens_total", (("model", "m"), ("tenant", "t")))] == 10
    assert got[("llmgw_gateway_completion_tokens_total", (("model", "m"), ("tenant", "t")))] == 5
    assert got[("llmgw_gateway_upstream_errors_total", (("kind", "connect"), ("replica", "r1")))] == 1
    assert got[("llmgw_gateway_upstream_retries_total", (("model", "m"),))] == 1


def test_models_outside_the_catalog_are_unknown() -> None:
    metrics = GatewayMetrics(lambda name: name == "m")
    for name in ["m", "x", "y", "", None]:
        metrics.admitted("t", name)  # type: ignore[arg-type]
    models = {dict(labels)["model"] for (name, labels) in samples(metrics) if name == "llmgw_gateway_admitted_total"}
    assert models == {"m", "unknown"}


def test_registries_are_private() -> None:
    first, second = GatewayMetrics(), GatewayMetrics()
    first.retry("m")
    assert ("llmgw_gateway_upstream_retries_total", (("model", "m"),)) in samples(first)
    assert ("llmgw_gateway_upstream_retries_total", (("model", "m"),)) not in samples(second)
    assert REGISTRY.get_sample_value("llmgw_gateway_upstream_retries_total", {"model": "m"}) is None


def test_in_flight_own_counts_and_forget() -> None:
    metrics = GatewayMetrics()
    metrics.in_flight("r1", 1)
    metrics.in_flight("r1", 1)
    metrics.in_flight("r2", 1)
    metrics.in_flight("r2", -1)
    metrics.upstream_error("r1", "timeout")
    got = samples(metrics)
    assert got[("llmgw_gateway_in_flight", (("replica", "r1"),))] == 2
    assert ("llmgw_gateway_in_flight", (("replica", "r2"),)) not in got
    metrics.forget_replica("r1")
    names = {(name, dict(labels).get("replica")) for name, labels in samples(metrics)}
    assert ("llmgw_gateway_in_flight", "r1") not in names
    assert ("llmgw_gateway_upstream_errors_total", "r1") not in names


def test_in_flight_read_from_a_source_at_scrape_time() -> None:
    counts = {"a": 3}
    metrics = GatewayMetrics(in_flight_source=lambda: counts, replica_ids=lambda: ["a", "b"])
    metrics.in_flight("a", 1)  # ignored: the source is the truth
    got = samples(metrics)
    assert got[("llmgw_gateway_in_flight", (("replica", "a"),))] == 3
    assert got[("llmgw_gateway_in_flight", (("replica", "b"),))] == 0
    counts.clear()
    assert samples(metrics)[("llmgw_gateway_in_flight", (("replica", "a"),))] == 0


def test_middleware_observations() -> None:
    metrics = GatewayMetrics()
    metrics.request_done("m", "t", 200, 0.2)
    metrics.first_chunk("m", 0.05)
    first = metrics.chunk_gaps("m")
    first.add(0.02)
    first.flush()
    gaps = metrics.chunk_gaps("m")
    gaps.add(0.01)
    gaps.add(0.5)
    got = samples(metrics)
    assert got[("llmgw_gateway_requests_total", (("model", "m"), ("status", "200"), ("tenant", "t")))] == 1
    assert got[("llmgw_gateway_request_duration_seconds_count", (("model", "m"),))] == 1
    assert got[("llmgw_gateway_time_to_first_token_seconds_count", (("model", "m"),))] == 1
    assert got[("llmgw_gateway_inter_chunk_seconds_count", (("model", "m"),))] == 1  # the stream's are not in yet
    gaps.flush()
    got = samples(metrics)
    assert got[("llmgw_gateway_inter_chunk_seconds_count", (("model", "m"),))] == 3
    assert got[("llmgw_gateway_inter_chunk_seconds_sum", (("model", "m"),))] == pytest.approx(0.53)
    assert got[("llmgw_gateway_inter_chunk_seconds_bucket", (("le", "0.025"), ("model", "m")))] == 2
    assert got[("llmgw_gateway_inter_chunk_seconds_bucket", (("le", "+Inf"), ("model", "m")))] == 3


def test_buckets_span_milliseconds_to_minutes() -> None:
    for buckets in (LATENCY_BUCKETS, TTFT_BUCKETS, CHUNK_GAP_BUCKETS):
        assert list(buckets) == sorted(buckets)
        assert buckets[0] <= 0.005
        assert buckets[-1] >= 10
    assert LATENCY_BUCKETS[-1] >= upstream.UpstreamTimeouts().first_byte


def test_config_deadline_defaults_match_the_gateway() -> None:
    config, timeouts = GatewayConfig(), upstream.UpstreamTimeouts()
    assert config.connect_timeout == timeouts.connect
    assert config.first_byte_timeout == timeouts.first_byte
    assert config.chunk_timeout == timeouts.chunk
