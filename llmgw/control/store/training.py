"""The store's LoRA training jobs and their files (migration 10), shared by both backends.

:class:`TrainingStore` is mixed into :class:`~llmgw.control.store.sql.SqlStore`: it only
needs the store's ``_run`` (one transaction in a worker thread). Files (a job's pairs, its
result) are kept as pieces of at most ``RESULT_PIECE_BYTES`` in ``training_files``, each
with its SHA-256, so a large adapter never has to be one database value and a damaged
piece is found when it is read (PostgreSQL's BYTEA and SQLite's BLOB alike).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Any, Callable

import attrs

from llmgw.control.store.base import ConflictError, StoreError
from llmgw.training import RESULT_PIECE_BYTES, TrainingJob, TrainingParams

_COLUMNS = ("id, adapter, model, weights, node, gpu_mib, params, state, message, assigned_node, gpu, progress, "
            "pairs, created_by, created_at, updated_at, result_bytes, result_sha256, result_format, register")
_PROGRESS = ("step", "steps", "loss", "first_loss", "peak_memory_bytes", "device")
#: A job's files: the pairs it trains on, its result, and its log (what its trainer reported,
#: the last LOG_LINES lines, kept so a control plane that takes over still shows them).
PAIRS, RESULT, LOG = "pairs", "result", "log"


class NoSuchJob(StoreError):
    """No training job has that id."""


def _job(row: Any) -> TrainingJob:
    (job_id, adapter, model, weights, node, gpu_mib, params, state, message, assigned, gpu, progress, pairs,
     created_by, created_at, updated_at, result_bytes, result_sha256, result_format, register) = row
    done = json.loads(progress)
    return TrainingJob(
        job_id, adapter, model, weights, node, int(gpu_mib), TrainingParams(**json.loads(params)), state, message,
        assigned, int(gpu), int(done.get("step", 0)), int(done.get("steps", 0)),
        _float(done.get("loss")), _float(done.get("first_loss")), int(done.get("peak_memory_bytes", 0)),
        str(done.get("device", "")), int(pairs), created_by, float(created_at), float(updated_at),
        int(result_bytes), result_sha256, result_format, bool(register),
    )


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


def _progress_json(job: TrainingJob) -> str:
    values = {name: getattr(job, name) for name in _PROGRESS}
    for name in ("loss", "first_loss"):
        if math.isnan(values[name]):
            values[name] = None
    return json.dumps(values)


def _row(job: TrainingJob) -> tuple[Any, ...]:
    return (job.id, job.adapter, job.model, job.weights, job.node, job.gpu_mib, json.dumps(attrs.asdict(job.params)),
            job.state, job.message, job.assigned_node, job.gpu, _progress_json(job), job.pairs, job.created_by,
            job.created_at, job.updated_at, job.result_bytes, job.result_sha256, job.result_format, int(job.register))


def _insert_pieces(tx: Any, job_id: str, kind: str, data: bytes) -> None:
    """Writes ``data`` as job ``job_id``'s file ``kind``: pieces of RESULT_PIECE_BYTES, each with its SHA-256."""
    for seq, start in enumerate(range(0, len(data), RESULT_PIECE_BYTES)):
        piece = data[start:start + RESULT_PIECE_BYTES]
        tx.execute("INSERT INTO training_files (job_id, kind, seq, data, sha256) VALUES (?, ?, ?, ?, ?)",
                   (job_id, kind, seq, piece, hashlib.sha256(piece).hexdigest()))


class TrainingStore:
    """Training jobs and their files, on a SQL store."""

    _run: Callable[..., Any]

    async def create_training_job(self, job: TrainingJob, pairs: bytes) -> TrainingJob:
        """Stores ``job`` (queued, stamped now) with its ``pairs``; returns it as stored.
        Raises ConflictError when a job of that id exists."""
        now = time.time()
        job = attrs.evolve(job, created_at=now, updated_at=now)

        def create(tx: Any) -> TrainingJob:
            if tx.execute("SELECT 1 FROM training_jobs WHERE id = ?", (job.id,)):
                raise ConflictError(f"a training job {job.id!r} exists already")
            row = _row(job)
            tx.execute(f"INSERT INTO training_jobs ({_COLUMNS}) VALUES ({', '.join('?' * len(row))})", row)
            _insert_pieces(tx, job.id, PAIRS, pairs)
            return job

        return await self._run(create, write=True, fenced=True)

    async def list_training_jobs(self, *, state: str | None = None) -> list[TrainingJob]:
        """Returns every job (with ``state``, only those in it), oldest first."""
        where, params = ("WHERE state = ? ", (state,)) if state is not None else ("", ())
        return await self._run(lambda tx: [_job(r) for r in tx.execute(
            f"SELECT {_COLUMNS} FROM training_jobs {where}ORDER BY created_at, id", params)], write=False)

    async def get_training_job(self, job_id: str) -> TrainingJob:
        """Returns job ``job_id``; raises NoSuchJob."""

        def get(tx: Any) -> TrainingJob:
            rows = tx.execute(f"SELECT {_COLUMNS} FROM training_jobs WHERE id = ?", (job_id,))
            if not rows:
                raise NoSuchJob(f"no training job {job_id!r} (see `llmgw ctl jobs list`)")
            return _job(rows[0])

        return await self._run(get, write=False)

    async def update_training_job(self, job: TrainingJob, *, unless_final: bool = True) -> TrainingJob:
        """Stores ``job``'s state, placement and progress (stamped now); returns the job as
        stored. With ``unless_final`` a job that has already ended is left as it is (and
        returned so): a late report cannot revive a cancelled job. Raises NoSuchJob."""

        def update(tx: Any) -> TrainingJob:
            rows = tx.execute(f"SELECT {_COLUMNS} FROM training_jobs WHERE id = ?", (job.id,))
            if not rows:
                raise NoSuchJob(f"no training job {job.id!r}")
            stored = _job(rows[0])
            if unless_final and stored.final:
                return stored
            new = attrs.evolve(job, updated_at=time.time())
            tx.execute("UPDATE training_jobs SET state = ?, message = ?, assigned_node = ?, gpu = ?, progress = ?, "
                       "updated_at = ?, result_bytes = ?, result_sha256 = ?, result_format = ? WHERE id = ?",
                       (new.state, new.message, new.assigned_node, new.gpu, _progress_json(new), new.updated_at,
                        new.result_bytes, new.result_sha256, new.result_format, new.id))
            return new

        return await self._run(update, write=True, fenced=True)

    async def put_training_file(self, job_id: str, kind: str, data: bytes) -> str:
        """Replaces job ``job_id``'s file ``kind`` with ``data``; returns its SHA-256."""

        def put(tx: Any) -> str:
            tx.execute("DELETE FROM training_files WHERE job_id = ? AND kind = ?", (job_id, kind))
            _insert_pieces(tx, job_id, kind, data)
            return hashlib.sha256(data).hexdigest()

        return await self._run(put, write=True, fenced=True)

    async def read_training_file(self, job_id: str, kind: str) -> bytes:
        """Returns job ``job_id``'s file ``kind`` (b"" when there is none). Raises StoreError
        naming the piece whose bytes no longer match their SHA-256."""

        def read(tx: Any) -> bytes:
            rows = tx.execute("SELECT seq, data, sha256 FROM training_files WHERE job_id = ? AND kind = ? ORDER BY seq",
                              (job_id, kind))
            out = []
            for seq, data, digest in rows:
                data = bytes(data)
                if hashlib.sha256(data).hexdigest() != digest:
                    raise StoreError(f"training job {job_id}: piece {seq} of its {kind} is damaged in the store "
                                     "(its SHA-256 does not match)")
                out.append(data)
            return b"".join(out)

        return await self._run(read, write=False)
