"""Reading an engine's requests in flight from its own pages (llmgw.node.engines.load)."""

from __future__ import annotations

import pytest

from llmgw.node.engines import get_engine
from llmgw.node.engines.load import (
    LLAMACPP_SLOTS, VLLM_METRICS, in_flight_probe, llamacpp_slots_in_flight, vllm_metrics_in_flight,
)

# Recorded from the simulator (python -m llmgw.sim --max-num-seqs 1) with two streams sent:
# one running, one waiting (excerpt: the two gauges and a neighbour).
SIM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0009765625
"""

# vLLM's shape with two engine cores (data parallel: one sample per ``engine`` label), and a
# per-reason gauge whose name only starts like the waiting one: it must not be counted twice.
VLLM_DP_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 2.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="Qwen/Qwen3-0.6B",reason="capacity"} 2.0
"""

# llama-server's GET /slots, two slots, shaped as its server README shows (fields abridged).
LLAMACPP_SLOTS_BODY = """\
[
  {"id": 0, "id_task": 135, "n_ctx": 65536, "speculative": false, "is_processing": true,
   "params": {"n_predict": -1, "seed": 4294967295, "temperature": 0.8},
   "next_token": [{"has_next_token": true, "has_new_line": false, "n_remain": -1, "n_decoded": 0}]},
  {"id": 1, "id_task": 0, "n_ctx": 65536, "speculative": false, "is_processing": false,
   "params": {"n_predict": -1, "seed": 4294967295, "temperature": 0.8},
   "next_token": [{"has_next_token": true, "has_new_line": false, "n_remain": -1, "n_decoded": 0}]}
]
"""


def test_vllm_metrics_sum_running_and_waiting() -> None:
    assert vllm_metrics_in_flight(SIM_METRICS) == 2
    assert vllm_metrics_in_flight(VLLM_DP_METRICS) == 5
    idle = SIM_METRICS.replace("} 1.0", "} 0.0")
    assert vllm_metrics_in_flight(idle) == 0


def test_vllm_metrics_without_the_gauges_is_refused() -> None:
    with pytest.raises(ValueError, match="num_requests_running"):
        vllm_metrics_in_flight("# HELP llamacpp:requests_processing x\nllamacpp:requests_processing 1\n")


# Recorded from a real llama-server b11312 (llmgw's build; tiny model, -np 2), idle.
LLAMACPP_SLOTS_RECORDED = (
    '[{"id":0,"n_ctx":256,"speculative":false,"is_processing":false},'
    '{"id":1,"n_ctx":256,"speculative":false,"is_processing":false}]'
)


def test_a_real_idle_llama_server_has_nothing_in_flight() -> None:
    assert llamacpp_slots_in_flight(LLAMACPP_SLOTS_RECORDED) == 0
    busy = LLAMACPP_SLOTS_RECORDED.replace('"is_processing":false}]', '"is_processing":true}]')
    assert llamacpp_slots_in_flight(busy) == 1


def test_llamacpp_slots_count_those_processing() -> None:
    assert llamacpp_slots_in_flight(LLAMACPP_SLOTS_BODY) == 1
    assert llamacpp_slots_in_flight(LLAMACPP_SLOTS_BODY.replace('"is_processing": true', '"is_processing": false')) == 0


@pytest.mark.parametrize("body", ["Not Found", '{"error": {"code": 501}}', '[{"id": 0}]'])
def test_llamacpp_slots_unreadable_is_refused(body: str) -> None:
    with pytest.raises(ValueError):
        llamacpp_slots_in_flight(body)


def test_each_adapter_names_its_probe_or_none() -> None:
    assert in_flight_probe(get_engine("sim")) is VLLM_METRICS
    assert in_flight_probe(get_engine("vllm")) is VLLM_METRICS
    assert in_flight_probe(get_engine("llama.cpp")) is LLAMACPP_SLOTS
    assert in_flight_probe(get_engine("sglang")) is None  # cannot say: the drain waits the fixed time
    assert in_flight_probe(object()) is None
