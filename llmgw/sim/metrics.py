"""Prometheus text exposition of the simulated engine's counters, with vLLM's metric names and labels."""

from __future__ import annotations

import time

from llmgw.sim.engine import TTFT_BUCKETS, Engine


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(engine: Engine) -> str:
    """Return the ``/metrics`` body for ``engine``."""
    cfg = engine.cfg
    lab = f'engine="0",model_name="{_esc(cfg.model)}"'
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, str, float]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            out.append(f"{name}{suffix}{{{labels}}} {float(value)!r}")

    metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", [("", lab, engine.running)])
    metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", [("", lab, engine.waiting)])
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", [("", lab, engine.kv_usage())])
    metric("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.", [("_total", lab, engine.cache.queries)])
    metric("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.", [("_total", lab, engine.cache.hits)])
    metric("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", [("_total", lab, engine.prompt_tokens)])
    metric("vllm:generation_tokens", "counter", "Number of generation tokens processed.", [("_total", lab, engine.generation_tokens)])
    metric(
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        [("_total", f'{lab},finished_reason="{r}"', engine.finished.get(r, 0)) for r in ("stop", "length", "abort")],
    )
    buckets = []
    cumulative = 0
    for bound, count in zip(TTFT_BUCKETS, engine.ttft_counts):
        cumulative += count
        buckets.append(("_bucket", f'{lab},le="{bound}"', cumulative))
    cumulative += engine.ttft_counts[-1]
    buckets.append(("_bucket", f'{lab},le="+Inf"', cumulative))
    buckets.append(("_count", lab, cumulative))
    buckets.append(("_sum", lab, engine.ttft_sum))
    metric("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.", buckets)
    info = (
        f'block_size="{cfg.block_size}",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
        f'num_gpu_blocks="{cfg.num_blocks}",prefix_caching_hash_algo="sha256_cbor"'
    )
    metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", [("", info, 1.0)])
    if cfg.enable_lora:
        lora = (
            f'max_lora="{cfg.max_loras}",running_lora_adapters="{_esc(",".join(sorted(engine.running_loras)))}",'
            f'waiting_lora_adapters="{_esc(",".join(sorted(engine.waiting_loras)))}"'
        )
        metric("vllm:lora_requests_info", "gauge", "Running stats on lora requests.", [("", lora, time.time())])
    return "\n".join(out) + "\n"
