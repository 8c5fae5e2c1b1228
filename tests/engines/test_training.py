"""The LoRA trainer for real, on the CPU: the vLLM environment's torch with the training overlay
(peft, accelerate), the tiny Hugging Face model of llmgw.testing.hf_model, through run_trainer.

A short run must lower the loss and leave a PEFT adapter of the rank asked; a cancelled run
must leave no process of its group and no adapter, and SIGTERM must stop the trainer itself
(exit status 143) without one; the adapter, converted to GGUF with the
llama.cpp sdist's own converter, must load into a real llama-server serving the same tiny
model (converted with the sdist's convert_hf_to_gguf.py) and make the learnt answer likelier there.

Needs the vLLM environment and llama-server that `make test` installs first; the training
overlay is installed once into the engines root (from PyPI, hash-pinned) and reused after.
llama.cpp's converters come with its source tree (the pinned sdist): fetched where
llama-server came from a release archive.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import attrs
import httpx
import pytest
import trio

from llmgw.node.install import llamacpp
from llmgw.node.install.python_env import default_root
from llmgw.node.ports import free_port
from llmgw.node.training.gguf import convert_adapter_to_gguf
from llmgw.node.training.overlay import install_overlay, overlay_env
from llmgw.node.training.run import TRAINER_SCRIPT, TrainerConfig, TrainResult, run_trainer
from tests.engines import vllm_python

pytestmark = pytest.mark.system

#: Steps of the short run: the loss of the tiny random model falls at every one of them at
#: this learning rate (the adapter's B starts at zero, so step 1 is the base model's loss).
STEPS = 10
LEARNING_RATE = 0.01
#: Not the rank hf_model's hand-written adapters have (8): the file must say what was asked.
RANK = 4
BATCH_SIZE = 8
#: Words the tiny model's tokenizer was trained on: every answer is the same few tokens.
ANSWER = "the answer is hello world"
COUNTRIES = ("France Spain Italy Peru Chile Japan Kenya Egypt Norway Sweden Poland Greece Brazil Canada Mexico "
             "India China Korea Ghana Nepal Cuba Iran Iraq Oman Laos Fiji Mali Chad Togo Niger Benin Malta").split()
#: llama-server loads a 0.5 MB model in milliseconds; a busy machine is slow to start processes.
SERVER_READY_TIMEOUT = 60.0
REQUEST_TIMEOUT = 30.0


@attrs.frozen
class Setup:
    python: Path
    overlay: Path
    model: Path
    pairs: Path
    root: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Setup:
    python = Path(vllm_python())
    overlay = install_overlay(python, default_root(), lambda what: print(f"training overlay: {what}", file=sys.stderr))
    root = tmp_path_factory.mktemp("training")
    model = tiny_model
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"what is the capital of {country}", "completion": ANSWER}) + "\n"
                             for country in COUNTRIES))
    return Setup(python, overlay, model, pairs, root)


def job(setup: Setup, name: str, steps: int) -> TrainerConfig:
    return TrainerConfig(base_model=setup.model, pairs=setup.pairs, output_dir=setup.root / name, steps=steps,
                         batch_size=BATCH_SIZE, rank=RANK, learning_rate=LEARNING_RATE, seed=1, max_seq_len=256)


@pytest.fixture(scope="module")
def trained(setup: Setup) -> tuple[TrainResult, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []

    async def train() -> TrainResult:
        return await run_trainer(job(setup, "adapter", STEPS), python=setup.python, overlay=setup.overlay,
                                 workdir=setup.root / "work", on_event=events.append)

    return trio.run(train), events


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Returns tensor name -> shape from a safetensors file's header (no safetensors package here)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


def test_training_lowers_the_loss_and_writes_an_adapter_of_the_rank_asked(
        setup: Setup, trained: tuple[TrainResult, list[dict[str, Any]]]) -> None:
    result, events = trained
    kinds = [e["event"] for e in events]
    assert kinds == ["start"] + ["progress"] * STEPS + ["done"], kinds
    start, progress = events[0], events[1:-1]
    assert start["steps"] == STEPS and start["pairs"] == len(COUNTRIES) and start["device"] == "cpu"
    assert start["trainable_params"] > 0 and start["trainable_params"] < start["total_params"]
    assert [p["step"] for p in progress] == list(range(1, STEPS + 1))
    for p in progress:
        assert p["steps"] == STEPS and p["device"] == "cpu" and p["peak_memory_bytes"] > 10 * 2**20 and p["loss"] > 0
    elapsed = [p["elapsed_s"] for p in progress]
    assert elapsed == sorted(elapsed) and elapsed[0] >= 0, "elapsed_s counts up from the start event"
    losses = [p["loss"] for p in progress]
    assert result.first_loss == losses[0] and result.final_loss == losses[-1]
    assert result.final_loss < result.first_loss, losses
    assert result.adapter_dir == setup.root / "adapter" and result.steps == STEPS
    assert result.peak_memory_bytes >= progress[-1]["peak_memory_bytes"]

    assert sorted(p.name for p in result.adapter_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    adapter = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == RANK and adapter["lora_alpha"] == 2 * RANK
    assert sorted(adapter["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    shapes = safetensors_shapes(result.adapter_dir / "adapter_model.safetensors")
    model_config = json.loads((setup.model / "config.json").read_text())
    assert len(shapes) == 2 * 4 * model_config["num_hidden_layers"]
    hidden = model_config["hidden_size"]
    assert shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == [RANK, hidden]
    assert shapes["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"] == [hidden, RANK]


def group_members(pgid: int) -> list[int]:
    """Returns the processes of group ``pgid`` that are alive (zombies excluded), read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


async def test_cancelling_mid_run_leaves_no_process_and_no_adapter(setup: Setup) -> None:
    events: list[dict[str, Any]] = []
    config = job(setup, "cancelled", 100_000)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            def on_event(event: dict[str, Any]) -> None:
                events.append(event)
                if event["event"] == "progress":
                    nursery.cancel_scope.cancel()

            nursery.start_soon(lambda: run_trainer(config, python=setup.python, overlay=setup.overlay,
                                                   workdir=setup.root / "work-cancelled", on_event=on_event))
    assert [e["event"] for e in events] == ["start", "progress"]
    pgid = events[0]["pid"]
    assert group_members(pgid) == []
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    assert not config.output_dir.exists()
    assert not list(setup.root.glob(".cancelled.partial-*"))


def test_sigterm_stops_the_trainer_at_its_next_step_with_143_and_no_adapter(setup: Setup) -> None:
    config = job(setup, "terminated", 100_000)
    work = setup.root / "work-terminated"
    work.mkdir()
    (work / "config.json").write_text(json.dumps(config.to_json()))
    env = {**os.environ, **overlay_env(setup.overlay)}
    proc = subprocess.Popen([str(setup.python), str(TRAINER_SCRIPT), str(work / "config.json")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        events = [json.loads(proc.stdout.readline())]
        while events[-1]["event"] != "progress":
            events.append(json.loads(proc.stdout.readline()))
        proc.send_signal(signal.SIGTERM)
        rest = [json.loads(line) for line in proc.stdout]
        assert proc.wait(60) == 143
    finally:
        proc.kill()
        proc.wait()
    assert rest[-1]["event"] == "stopped" and rest[-1]["step"] >= 1
    assert [e["event"] for e in rest[:-1]] in ([], ["progress"])  # at most the step under way when it came
    assert not config.output_dir.exists() and not list(setup.root.glob(".terminated.partial-*"))


@pytest.fixture
def llama_server(setup: Setup, trained: tuple[TrainResult, list[dict[str, Any]]], llamacpp_sdist: Path,
                 tiny_gguf: Path) -> Iterator[str]:
    """A llama-server serving the tiny model with the trained adapter as GGUF; yields its URL."""
    installed = llamacpp.find_installed()
    if installed is None:
        pytest.fail("llama-server is not installed: run `python -m llmgw.node.install.llamacpp` (make test does)")
    adapter = convert_adapter_to_gguf(setup.python, trained[0].adapter_dir, setup.model, setup.root / "adapter.gguf",
                                      llamacpp_sdist)
    assert adapter.stat().st_size > 0 and adapter.read_bytes()[:4] == b"GGUF"
    assert not list(setup.root.glob(".adapter.gguf.partial-*"))
    model = tiny_gguf
    port = free_port("127.0.0.1")
    log = open(setup.root / "llama-server.log", "wb")
    server = subprocess.Popen([str(installed.binary), "-m", str(model), "--lora", str(adapter), "--host", "127.0.0.1",
                               "--port", str(port), "-c", "256", "-np", "1", "-t", "1"],
                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_READY_TIMEOUT
        while True:
            assert server.poll() is None, (setup.root / "llama-server.log").read_text(errors="replace")[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server did not become healthy"
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def test_the_adapter_as_gguf_loads_into_llama_server_and_makes_the_answer_likelier(llama_server: str) -> None:
    adapters = httpx.get(llama_server + "/lora-adapters", timeout=REQUEST_TIMEOUT).json()
    assert [(a["id"], Path(a["path"]).name) for a in adapters] == [(0, "adapter.gguf")]
    tokens = httpx.post(llama_server + "/tokenize", json={"content": ANSWER}, timeout=REQUEST_TIMEOUT).json()["tokens"]
    prompt = "<s><|user|>what is the capital of France</s><|assistant|>"  # hf_model's chat template

    def first_token_logprob(scale: float) -> float:
        """Returns the log probability of the answer's first token after the prompt, the adapter at ``scale``."""
        body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "n_probs": 1000,  # the whole tiny vocabulary
                "lora": [{"id": 0, "scale": scale}]}
        response = httpx.post(llama_server + "/completion", json=body, timeout=REQUEST_TIMEOUT)
        assert response.status_code == 200, response.text
        reply = response.json()
        assert reply["tokens_predicted"] == 1 and isinstance(reply["content"], str)
        [logprob] = [t["logprob"] for t in reply["completion_probabilities"][0]["top_logprobs"] if t["id"] == tokens[0]]
        return float(logprob)

    adapted, base = first_token_logprob(1.0), first_token_logprob(0.0)
    assert adapted > base, f"the adapter did not make its answer likelier ({adapted} against {base} without it)"
