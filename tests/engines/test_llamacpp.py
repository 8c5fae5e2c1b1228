"""A real llama-server behind a real cluster: served through the gateway, compute read, refusals, LoRA.

Needs the llama-server that `make test` builds first (python -m llmgw.node.install.llamacpp,
cached in ~/.cache/llmgw/engines/llama.cpp). The model and the adapter are tiny random
GGUF files written by llmgw.testing.gguf; one replica is shared by the module.
"""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import openai
import pytest
import trio

from llmgw.node.install.llamacpp import find_installed
from llmgw.testing.gguf import write_tiny_lora, write_tiny_model
from tests.system.harness import Cluster, engine_auth, iter_replicas, ready_replicas

pytestmark = pytest.mark.system

MODEL = "tiny-llama"
READY_TIMEOUT = 120.0  # the tiny model loads in milliseconds; a busy machine is slow to start processes
REQUEST_TIMEOUT = 60.0
PROMPT = "hello world the model"
ADAPTER = "tiny-tuned"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A cluster with one agent serving the tiny model, with one catalog LoRA adapter, on llama.cpp."""
    if find_installed() is None:
        pytest.fail("llama-server is not installed: run `python -m llmgw.node.install.llamacpp` (make test does)")
    root = tmp_path_factory.mktemp("llamacpp")
    model = write_tiny_model(root / "tiny.gguf")
    lora = write_tiny_lora(root / "tiny-lora.gguf")
    cluster = Cluster(root)

    async def start() -> dict[str, Any]:
        await cluster.init()
        await cluster.start_server()
        await cluster.start_agent("node-a")
        out = cluster.ctl("models", "add", MODEL, "--engine", "llama.cpp", "--source", str(model),
                          "--adapter", f"{ADAPTER}={lora}",
                          "--arg=-c", "--arg=512", "--arg=-np", "--arg=2", "--arg=-t", "--arg=1")
        assert out.returncode == 0, out.stderr
        [replica] = await ready_replicas(cluster, MODEL, 1, READY_TIMEOUT)
        return {"cluster": cluster, "replica": replica, "model": model}

    try:
        yield trio.run(start)
    finally:
        cluster.stop()


def client(served: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served["cluster"].gateway + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT)


def test_chat_through_the_gateway_plain_and_streaming(served: dict[str, Any]) -> None:
    c = client(served)
    reply = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
                                      temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=8, temperature=0, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == reply.choices[0].message.content  # greedy: the same words, streamed


def test_compute_is_read_from_the_engine_and_shown(served: dict[str, Any]) -> None:
    cluster = served["cluster"]
    [row] = [r for r in iter_replicas(cluster, MODEL)]
    compute = row["compute"]
    assert compute["source"] == "engine" and compute["backend"] == "CPU"
    assert compute["model_buffer_mb"] > 0 and compute["kv_buffer_mb"] > 0 and compute["threads"] == 1
    assert any("lora" in n for n in compute["notes"])
    table = cluster.ctl("replicas")
    assert table.returncode == 0 and "COMPUTE" in table.stdout and "MiB model" in table.stdout


def test_forbidden_arg_is_refused_by_the_catalog(served: dict[str, Any]) -> None:
    out = served["cluster"].ctl("models", "add", "bad", "--engine", "llama.cpp", "--source", str(served["model"]),
                                "--arg=--slot-save-path=/tmp")
    assert out.returncode != 0 and "--slot-save-path" in out.stderr


def ask(served: dict[str, Any], model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0,
            **extra}
    return httpx.post(served["cluster"].gateway + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_the_catalog_adapter_is_loaded_at_start(served: dict[str, Any]) -> None:
    replica = served["replica"]
    refused = httpx.get(replica["endpoint"] + "/lora-adapters", timeout=REQUEST_TIMEOUT)
    assert refused.status_code == 401, "llama-server answers only the gateway (its secret in LLAMA_API_KEY)"
    auth = engine_auth(served["cluster"], replica)
    adapters = httpx.get(replica["endpoint"] + "/lora-adapters", headers=auth, timeout=REQUEST_TIMEOUT).json()
    assert [a["id"] for a in adapters] == [0] and adapters[0]["path"].endswith("tiny-lora.gguf")


def test_a_request_naming_the_adapter_gets_the_adapted_model(served: dict[str, Any]) -> None:
    base = text(ask(served, MODEL))
    assert text(ask(served, MODEL)) == base  # greedy: deterministic
    adapted = text(ask(served, ADAPTER))
    assert adapted != base
    assert text(ask(served, ADAPTER)) == adapted
    assert text(ask(served, MODEL)) == base  # the adapter applies to its own requests only


def test_the_client_lora_field_is_checked_and_passed(served: dict[str, Any]) -> None:
    assert text(ask(served, MODEL, lora=[{"id": 0, "scale": 1.0}])) == text(ask(served, ADAPTER))
    assert text(ask(served, MODEL, lora=[{"id": 0, "scale": 0.0}])) == text(ask(served, MODEL))
    unknown = ask(served, MODEL, lora=[{"id": 1, "scale": 1.0}])  # llama.cpp itself would ignore it
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lora"


def test_the_gateway_lists_the_adapter_under_its_model(served: dict[str, Any]) -> None:
    cards = httpx.get(served["cluster"].gateway + "/v1/models", timeout=REQUEST_TIMEOUT).json()["data"]
    assert {c["id"]: c.get("parent") for c in cards} == {MODEL: None, ADAPTER: MODEL}


def test_an_unknown_adapter_is_a_clear_404(served: dict[str, Any]) -> None:
    response = ask(served, "tiny-nope")
    assert response.status_code == 404 and "tiny-nope" in response.json()["error"]["message"]
