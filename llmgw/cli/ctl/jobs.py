"""``llmgw ctl jobs``: LoRA fine-tuning jobs (train, list, show, logs, cancel, download)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import click
import trio

from llmgw.cli.ctl.common import call, json_option, target_of
from llmgw.cli.output import fail, print_table
from llmgw.client import ClientError, ClusterClient
from llmgw.spec import gpu_display
from llmgw.training import TrainingJob, TrainingParams, check_pairs

#: Seconds between two looks at a followed job: its progress is written every 2 s.
FOLLOW_POLL_S = 2.0
_DEFAULTS = TrainingParams()


@click.group()
def jobs() -> None:
    """LoRA fine-tuning jobs: train an adapter for a catalog model on question/answer pairs."""


@jobs.command("train")
@click.option("--model", "-m", required=True, help="The catalog model the adapter is for.")
@click.option("--data", "data_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='Pairs, JSON Lines: {"prompt": "...", "completion": "..."} or {"messages": [...]} per line.')
@click.option("--name", default="", help="The adapter's name (default: MODEL-lora-<job>).")
@click.option("--weights", default="", help="The safetensors weights to train on (default: the model's source).")
@click.option("--node", default="", help="Train on this node (default: any that fits).")
@click.option("--gpu-mib", type=click.IntRange(0), default=0, show_default=True,
              help="Card memory the job needs, in MiB (0: train on the CPU).")
@click.option("--steps", type=click.IntRange(0), default=0, show_default=True,
              help="Optimiser steps (0: train by --epochs).")
@click.option("--epochs", type=float, default=_DEFAULTS.epochs, show_default=True)
@click.option("--rank", type=int, default=_DEFAULTS.rank, show_default=True)
@click.option("--alpha", type=float, default=_DEFAULTS.alpha, show_default=True)
@click.option("--lr", type=float, default=_DEFAULTS.learning_rate, show_default=True, help="Learning rate.")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True)
@click.option("--max-seq-len", type=int, default=_DEFAULTS.max_seq_len, show_default=True)
@click.option("--register", is_flag=True, help="Once it succeeds, add the adapter to the model (as "
                                                "`ctl models adapters add MODEL NAME --from-job JOB` would).")
@json_option
@click.pass_context
def train(ctx: click.Context, model: str, data_path: Path, name: str, weights: str, node: str, gpu_mib: int,
          steps: int, epochs: float, rank: int, alpha: float, lr: float, seed: int, max_seq_len: int,
          register: bool, as_json: bool) -> None:
    """Queue a training job; the leader sends it to a node with vLLM installed (its torch trains)."""
    params = TrainingParams(steps, epochs, rank, alpha, lr, seed, max_seq_len)
    problem = params.problem()
    if problem:
        fail(problem)
    try:
        pairs = data_path.read_bytes()
        count = check_pairs(pairs)
    except (OSError, ValueError) as exc:
        fail(f"{data_path}: {exc}")
    adapter = name or f"{model}-lora-{time.strftime('%Y%m%d%H%M%S')}"
    job = call(ctx, as_json, lambda c: c.train_job(adapter, model, pairs, params, weights=weights, node=node,
                                                   gpu_mib=gpu_mib, register=register))
    click.echo(f"queued {job.id}: adapter {job.adapter} for {job.model}, {count} pairs"
               + (f", on {node}" if node else "") + (f", {gpu_mib} MiB of a card" if gpu_mib else ", on a CPU"))
    click.echo(f"follow it: llmgw ctl jobs logs -f {job.id}")
    if register:
        click.echo(f"once it succeeds, {job.adapter} is added to {job.model}'s adapters")


@jobs.command("list")
@json_option
@click.pass_context
def list_jobs(ctx: click.Context, as_json: bool) -> None:
    """Every training job, oldest first."""
    rows = call(ctx, as_json, lambda c: c.jobs())
    print_table(["JOB", "ADAPTER", "MODEL", "STATE", "NODE", "DEVICE", "STEP", "LOSS", "MESSAGE"],
                [[j.id, j.adapter, j.model, j.state, _where(j), j.device or "-", f"{j.step}/{j.steps or '?'}",
                  _loss(j), j.message[:60]] for j in rows], empty="no training jobs")


@jobs.command("show")
@click.argument("job_id")
@json_option
@click.pass_context
def show(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """One job: what it trains, where, how far it got, its result."""
    job = call(ctx, as_json, lambda c: _find(c, job_id))
    p = job.params
    click.echo(f"{job.id}  {job.state}: {job.message}")
    click.echo(f"adapter {job.adapter} for {job.model}, weights {job.weights}, {job.pairs} pairs")
    click.echo(f"asked: node {job.node or 'any'}, " + (f"{job.gpu_mib} MiB of a card" if job.gpu_mib else "CPU"))
    click.echo(f"runs on: {_where(job)}" + (f" ({job.device})" if job.device and job.gpu >= 0 else ""))
    click.echo(f"params: {'steps ' + str(p.steps) if p.steps else f'epochs {p.epochs:g}'}, rank {p.rank}, "
               f"alpha {p.alpha:g}, lr {p.learning_rate:g}, seed {p.seed}, max-seq-len {p.max_seq_len}")
    click.echo(f"progress: step {job.step}/{job.steps or '?'}, loss {_loss(job)}"
               + (f", peak memory {job.peak_memory_bytes / 1024**2:.0f} MiB" if job.peak_memory_bytes else ""))
    if job.result_bytes:
        click.echo(f"result: {job.result_format}, {job.result_bytes} bytes, sha256 {job.result_sha256} "
                   f"(`llmgw ctl jobs download {job.id}`)")
    click.echo(f"by {job.created_by} at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(job.created_at))}")


@jobs.command("logs")
@click.argument("job_id")
@click.option("--lines", "-n", type=click.IntRange(1, 2000), default=100, show_default=True)
@click.option("--follow", "-f", is_flag=True, help="Then print what the trainer reports until the job ends.")
@json_option
@click.pass_context
def logs(ctx: click.Context, job_id: str, lines: int, follow: bool, as_json: bool) -> None:
    """What the job's trainer reported (events as JSON lines), and what the control plane did with it."""
    if not follow or as_json:
        for line in call(ctx, as_json, lambda c: c.job_logs(job_id, lines)):
            click.echo(line)
        return

    async def follow_job(c: ClusterClient) -> TrainingJob:
        seen: list[str] = []
        while True:
            kept = await c.job_logs(job_id, 2000)
            start = _new_from(seen, kept)
            for line in kept[start:]:
                click.echo(line)
            seen = kept
            job = await _find(c, job_id)
            if job.final:
                return job
            await trio.sleep(FOLLOW_POLL_S)

    job = target_of(ctx).run(follow_job)
    sys.exit(0 if job.state == "succeeded" else 1)


@jobs.command("cancel")
@click.argument("job_id")
@json_option
@click.pass_context
def cancel(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Cancel a job: a queued one at once, a running one once its node killed the trainer."""
    job = call(ctx, as_json, lambda c: c.cancel_job(job_id))
    click.echo(f"{job.id}: {job.state} ({job.message})")


@jobs.command("download")
@click.argument("job_id")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write it (default: ADAPTER.gguf or ADAPTER.tar in this directory).")
@json_option
@click.pass_context
def download(ctx: click.Context, job_id: str, output: Path | None, as_json: bool) -> None:
    """Download a finished job's adapter (a GGUF file, or a tar of the PEFT directory), checked by SHA-256."""

    async def fetch(c: ClusterClient) -> dict[str, object]:
        job = await _find(c, job_id)
        if not job.result_bytes:
            raise ClientError(f"{job.id} has no result ({job.state}: {job.message})")
        target = output or Path(f"{job.adapter}.{'gguf' if job.result_format == 'gguf' else 'tar'}")
        partial = target.with_name(target.name + ".partial")
        with partial.open("wb") as out:
            size, sha256, fmt = await c.download_job(job.id, out.write)
        partial.replace(target)
        return {"job": job.id, "path": str(target), "bytes": size, "sha256": sha256, "format": fmt}

    got = call(ctx, as_json, fetch)
    click.echo(f"wrote {got['path']}: {got['format']}, {got['bytes']} bytes, sha256 {got['sha256']}")


async def _find(c: ClusterClient, job_id: str) -> TrainingJob:
    for job in await c.jobs():
        if job.id == job_id:
            return job
    raise ClientError(f"no training job {job_id!r} (see `llmgw ctl jobs list`)")


def _where(job: TrainingJob) -> str:
    if not job.assigned_node:
        return "-"
    return job.assigned_node + (f" GPU {gpu_display(job.gpu)}" if job.gpu >= 0 else " CPU")


def _loss(job: TrainingJob) -> str:
    if math.isnan(job.loss):
        return "-"
    return f"{job.first_loss:.4g} -> {job.loss:.4g}" if not math.isnan(job.first_loss) else f"{job.loss:.4g}"


def _new_from(seen: list[str], kept: list[str]) -> int:
    """Returns where the lines not printed yet start in ``kept`` (a job keeps its newest 2,000):
    after the longest tail of ``seen`` that ``kept`` begins with."""
    for k in range(min(len(seen), len(kept)), 0, -1):
        if seen[-k:] == kept[:k]:
            return k
    return 0
