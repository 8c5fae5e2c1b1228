"""Benchmark: the LoRA trainer on this machine, and what run_trainer's plumbing costs.

Run::

    python bench/training.py            # 3 rounds of 200 steps (about 40 s on 2 cores)
    python bench/training.py --quick    # 1 round of 50 steps (about 12 s)

Trains the tiny Hugging Face model of :mod:`llmgw.testing.hf_model` (hidden size 64, 2
layers) on 32 pairs of about 36 tokens, LoRA rank 8 on q/k/v/o, batch size 8, on the CPU,
with the vLLM environment's torch and the training overlay (installed first if missing,
as :mod:`llmgw.node.training.overlay` does). Each round runs the same job twice, in an
order that alternates between rounds:

* ``direct``: ``<vLLM python> trainer.py CONFIG`` by ``subprocess.run``, its stdout read
  when it exits (the least a caller can do);
* ``run_trainer``: :func:`llmgw.node.training.run.run_trainer` under trio (its own
  process group, events parsed and handed to a callback as they arrive, stderr tail kept,
  the group stopped and waited for at the end).

Reported per way (medians over the rounds): ``wall_s`` (from starting the process to
having the result), ``train_s`` (the trainer's own time for the steps, from its ``done``
event), ``startup_s`` (the rest: python, torch, transformers and peft imports, loading
the model, tokenizing), ``steps_per_s`` and ``peak_memory_bytes`` (the trainer's peak
RSS). ``ratios.run_trainer_vs_direct_wall`` is run_trainer's wall time over the direct
one's, same job and same steps in the same run: the plumbing's overhead (1.0 is none).
Human progress goes to stderr; the last line of stdout is one JSON object. A run that
fails, or whose two ways disagree on the losses (the job is seeded), exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio  # noqa: E402

from llmgw.node.install.python_env import default_root  # noqa: E402
from llmgw.node.training.overlay import install_overlay, overlay_env, vllm_python  # noqa: E402
from llmgw.node.training.run import TRAINER_SCRIPT, TrainerConfig, parse_event, run_trainer  # noqa: E402
from llmgw.node.training.trainer import QUIET_ENV  # noqa: E402
from llmgw.testing.hf_model import write_tiny_model  # noqa: E402

#: Steps per run: enough that the loop (4-5 ms a step here) is measured beside the
#: seconds of imports, and that run_trainer handles one progress event per step.
STEPS, QUICK_STEPS = 200, 50
#: Rounds (each: both ways once); the median is reported.
ROUNDS, QUICK_ROUNDS = 3, 1
PAIRS = 32
BATCH_SIZE = 8
RANK = 8
#: A run that takes longer than this is stuck (a run is seconds here).
RUN_TIMEOUT = 600.0


class BenchError(Exception):
    """A run failed or the two ways disagree: the timings would mean nothing."""


def write_pairs(path: Path) -> Path:
    """Writes :data:`PAIRS` prompt/completion pairs in words the tiny tokenizer knows."""
    with open(path, "w") as f:
        for i in range(PAIRS):
            f.write(json.dumps({"prompt": f"number {i} hello world the model", "completion": "cache block token "
                                "prefix adapter lora"}) + "\n")
    return path


def direct(python: Path, overlay: Path, config: TrainerConfig, workdir: Path) -> dict[str, Any]:
    """Runs the trainer with subprocess.run; returns its timings and done event."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.json"
    path.write_text(json.dumps(config.to_json()))
    env = {**QUIET_ENV, **os.environ, **overlay_env(overlay)}
    started = time.perf_counter()
    done = subprocess.run([str(python), str(TRAINER_SCRIPT), str(path)], capture_output=True, env=env,
                          timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    events = [e for e in map(parse_event, done.stdout.splitlines()) if e is not None]
    if done.returncode != 0 or not events or events[-1]["event"] != "done":
        raise BenchError(f"the trainer exited {done.returncode}: {done.stderr.decode(errors='replace')[-2000:]}")
    return {"wall_s": wall, "done": events[-1], "events": len(events)}


def through_run_trainer(python: Path, overlay: Path, config: TrainerConfig, workdir: Path) -> dict[str, Any]:
    """Runs the trainer with run_trainer under trio; returns its timings and done event."""
    events: list[dict[str, Any]] = []

    async def main() -> None:
        with trio.fail_after(RUN_TIMEOUT):
            await run_trainer(config, python=python, overlay=overlay, workdir=workdir, on_event=events.append)

    started = time.perf_counter()
    trio.run(main)
    return {"wall_s": time.perf_counter() - started, "done": events[-1], "events": len(events)}


def summary(runs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Returns the medians of one way's runs."""
    wall = statistics.median(r["wall_s"] for r in runs)
    train = statistics.median(r["done"]["elapsed_s"] for r in runs)
    return {
        "runs": len(runs),
        "wall_s": round(wall, 3),
        "train_s": round(train, 3),
        "startup_s": round(statistics.median(r["wall_s"] - r["done"]["elapsed_s"] for r in runs), 3),
        "steps_per_s": round(steps / train, 1),
        "peak_memory_bytes": int(statistics.median(r["done"]["peak_memory_bytes"] for r in runs)),
        "events": runs[0]["events"],
        "first_loss": runs[0]["done"]["first_loss"],
        "final_loss": runs[0]["done"]["final_loss"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; progress on stderr, the JSON result as stdout's last line.

    Returns the exit status: 0, or 1 when a run failed or the two ways disagree.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} round of {QUICK_STEPS} steps")
    parser.add_argument("--steps", type=int, default=0, help=f"steps per run (default {STEPS})")
    parser.add_argument("--rounds", type=int, default=0, help=f"rounds (default {ROUNDS})")
    args = parser.parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)

    def say(what: str) -> None:
        print(f"training bench: {what}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    python = vllm_python()
    overlay = install_overlay(python, default_root(), say)
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-training-"))
    try:
        say("writing the tiny model")
        model = write_tiny_model(str(python), tmp / "model")
        pairs = write_pairs(tmp / "pairs.jsonl")
        results: dict[str, list[dict[str, Any]]] = {"direct": [], "run_trainer": []}
        for round_ in range(rounds):
            order = ["direct", "run_trainer"] if round_ % 2 == 0 else ["run_trainer", "direct"]
            for way in order:
                name = f"{way}-{round_}"
                config = TrainerConfig(base_model=model, pairs=pairs, output_dir=tmp / name / "adapter", steps=steps,
                                       batch_size=BATCH_SIZE, rank=RANK, learning_rate=1e-3, seed=1, max_seq_len=256)
                runner = direct if way == "direct" else through_run_trainer
                result = runner(python, overlay, config, tmp / name)
                results[way].append(result)
                say(f"round {round_ + 1}/{rounds} {way}: {result['wall_s']:.2f} s wall, "
                    f"{result['done']['elapsed_s']:.2f} s training, loss {result['done']['first_loss']:.3f} -> "
                    f"{result['done']['final_loss']:.3f}")
                shutil.rmtree(tmp / name, ignore_errors=True)
        losses = {(r["done"]["first_loss"], r["done"]["final_loss"]) for rs in results.values() for r in rs}
        if len(losses) != 1:
            raise BenchError(f"the same seeded job gave different losses: {sorted(losses)}")
    except (BenchError, subprocess.SubprocessError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    ways = {way: summary(runs, steps) for way, runs in results.items()}
    out = {
        "benchmark": "training",
        "mode": "quick" if args.quick else "full",
        "baseline": "the same trainer script run by subprocess.run (direct), same job and steps, in this run",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "model": "llmgw.testing.hf_model tiny Llama (hidden 64, 2 layers), float32, cpu",
        "job": {"steps": steps, "pairs": PAIRS, "batch_size": BATCH_SIZE, "rank": RANK, "rounds": rounds},
        "ways": ways,
        "ratios": {
            "run_trainer_vs_direct_wall": round(ways["run_trainer"]["wall_s"] / ways["direct"]["wall_s"], 3),
            "run_trainer_vs_direct_train": round(ways["run_trainer"]["train_s"] / ways["direct"]["train_s"], 3),
        },
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
