"""LoRA training jobs as the control plane, the nodes and ``llmgw ctl jobs`` share them (issue 17).

A job names the catalog model the adapter is for, the safetensors weights to train on, the
node (or any that fits) and the card memory it needs, and carries the question/answer pairs.
The leader keeps it in the store and sends it to a node (llmgw/control/training.py); the
node's agent trains it in a nursery of its own (llmgw/node/jobs.py) and reports through a
capability handed per job; the result comes back in checksummed pieces and is kept in the
store until registered as an adapter.
"""

from __future__ import annotations

import math
import re

import attrs

from llmgw.training_pairs import parse_pairs

#: States of a job; the last three are final.
QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
FINAL_STATES = frozenset({SUCCEEDED, FAILED, CANCELLED})

#: The pairs travel in one RPC message: well under Cap'n Proto's 64 MiB traversal limit, and
#: far more than a fine-tuning set of question/answer pairs (tens of thousands of them).
MAX_PAIRS_BYTES = 16 * 1024 * 1024

#: Result files travel in pieces of this size (a GGUF or PEFT adapter is a few MB to a few
#: hundred MB): small enough for one RPC message, large enough that a 100 MB file is 100 calls.
RESULT_PIECE_BYTES = 1024 * 1024

#: Result formats: a tar of the PEFT adapter directory (vLLM loads it) or one GGUF file
#: (llama-server's --lora).
PEFT, GGUF = "peft", "gguf"

_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


@attrs.frozen
class TrainingParams:
    """How to train: ``steps`` optimiser steps, or (``steps`` 0) ``epochs`` passes over the pairs."""

    steps: int = 0
    epochs: float = 3.0
    rank: int = 8
    alpha: float = 16.0
    learning_rate: float = 2e-4
    seed: int = 0
    max_seq_len: int = 512

    def problem(self) -> str | None:
        """Returns what is wrong with these parameters, naming the option, or None."""
        if self.steps < 0:
            return f"--steps must be 0 (train by epochs) or more, got {self.steps}"
        if self.steps == 0 and not (0 < self.epochs <= 1000):
            return f"--epochs must be above 0 and at most 1000, got {self.epochs:g}"
        if self.rank not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            return f"--rank must be a power of two from 1 to 256 (what vLLM's --max-lora-rank accepts), got {self.rank}"
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            return f"--alpha must be a positive number, got {self.alpha}"
        if not (math.isfinite(self.learning_rate) and 0 < self.learning_rate < 1):
            return f"--lr must be between 0 and 1, got {self.learning_rate}"
        if not (16 <= self.max_seq_len <= 65536):
            return f"--max-seq-len must be from 16 to 65536, got {self.max_seq_len}"
        return None


@attrs.frozen
class TrainingJob:
    """One job as the store keeps it and every view shows it.

    ``gpu`` is the placement index it trains on (-1: the CPU, or not placed yet); ``loss``
    and ``first_loss`` are NaN until the trainer reports them; ``result_*`` describe the
    kept result (``result_bytes`` 0: none).
    """

    id: str
    adapter: str
    model: str
    weights: str
    node: str = ""
    gpu_mib: int = 0
    params: TrainingParams = TrainingParams()
    state: str = QUEUED
    message: str = ""
    assigned_node: str = ""
    gpu: int = -1
    step: int = 0
    steps: int = 0
    loss: float = math.nan
    first_loss: float = math.nan
    peak_memory_bytes: int = 0
    device: str = ""
    pairs: int = 0
    created_by: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    result_bytes: int = 0
    result_sha256: str = ""
    result_format: str = ""
    register: bool = False  # add the result to the model as an adapter once it succeeds

    @property
    def final(self) -> bool:
        """Whether the job has ended (succeeded, failed or cancelled)."""
        return self.state in FINAL_STATES


def check_job_id(job_id: str) -> str:
    """Returns ``job_id`` if it is a job id as the control plane makes them; raises ValueError."""
    if not _ID.match(job_id):
        raise ValueError(f"{job_id!r} is not a job id (see `llmgw ctl jobs list`)")
    return job_id


def check_pairs(data: bytes) -> int:
    """Returns how many training pairs ``data`` (JSON Lines, :mod:`llmgw.training_pairs`) holds;
    raises ValueError naming the bad lines by number and what is wrong with each, or when the
    file is larger than MAX_PAIRS_BYTES. The node's trainer applies the same checks."""
    if len(data) > MAX_PAIRS_BYTES:
        raise ValueError(f"the pairs file is {len(data)} bytes; at most {MAX_PAIRS_BYTES} are accepted")
    return len(parse_pairs(data.split(b"\n")))
