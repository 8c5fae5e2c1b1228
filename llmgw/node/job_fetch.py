"""Fetching a training job's result from the control plane: sources ``llmgw-job://JOB`` (issue 17).

The control plane keeps each finished job's adapter (llmgw/control/training.py); a node
fetches it over its session (``NodeDesk.jobResult``, through ``FetchSettings.job_results``)
in pieces, checks the whole against the SHA-256 the control plane keeps, and lays it out
under ``<weights_dir>/jobs/<JOB>/``: a PEFT adapter unpacked there (the directory is what
vLLM loads), a GGUF adapter as ``adapter.gguf`` (what llama-server's ``--lora`` loads). A
marker written last makes it complete; a job's result never changes, so a complete one is
never fetched again.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
from pathlib import Path, PurePosixPath
from typing import Awaitable, Callable

import trio

from llmgw.training import GGUF, PEFT

#: Written last into a job's directory once its result is laid out.
COMPLETE_MARKER = ".llmgw-complete"
#: The name a GGUF result gets in its directory.
GGUF_NAME = "adapter.gguf"

#: Asks the control plane for a piece of job JOB's result at OFFSET: returns (bytes, total
#: size, sha256 of the whole, format). Raises with the control plane's reason.
JobPieces = Callable[[str, int], Awaitable[tuple[bytes, int, str, str]]]


class JobFetchError(Exception):
    """A job's result could not be fetched or laid out; ``str()`` says why."""


def job_dir(weights_dir: Path, job_id: str) -> Path:
    return weights_dir / "jobs" / job_id


def cached_job_result(weights_dir: Path, job_id: str) -> Path | None:
    """Returns what a complete fetch of job ``job_id`` left (the PEFT directory or the GGUF
    file), or None."""
    directory = job_dir(weights_dir, job_id)
    if not (directory / COMPLETE_MARKER).exists():
        return None
    gguf = directory / GGUF_NAME
    return gguf if gguf.exists() else directory


async def fetch_job_result(job_id: str, weights_dir: Path, pieces: JobPieces | None,
                           progress: Callable[[str], None], what: str) -> Path:
    """Returns the local path of job ``job_id``'s result, fetched first unless complete.
    Raises JobFetchError (no session to fetch over, a damaged or unknown result). Cancellation
    leaves no directory that counts as complete."""
    found = await trio.to_thread.run_sync(cached_job_result, weights_dir, job_id)
    if found is not None:
        return found
    if pieces is None:
        raise JobFetchError(f"{what} is a training job's result, fetched from the control plane over the agent's "
                            "session; this node has none now: it is fetched once the agent has joined")
    directory = job_dir(weights_dir, job_id)
    partial = directory.with_name(directory.name + ".partial")
    digest, received, total, sha256, fmt = hashlib.sha256(), 0, None, "", ""
    await trio.to_thread.run_sync(lambda: partial.parent.mkdir(parents=True, exist_ok=True))
    data = bytearray()
    while total is None or received < total:
        try:
            chunk, total, sha256, fmt = await pieces(job_id, received)
        except Exception as exc:  # noqa: BLE001 - the control plane's reason, said once
            raise JobFetchError(f"{what}: the control plane did not give job {job_id}'s result: {exc}") from None
        if not chunk and received < total:
            raise JobFetchError(f"{what}: the control plane sent nothing at byte {received} of {total}")
        data += chunk
        digest.update(chunk)
        received += len(chunk)
        progress(f"fetching {what}: {received}/{total} bytes")
    if digest.hexdigest() != sha256:
        raise JobFetchError(f"{what}: job {job_id}'s result arrived damaged (its SHA-256 does not match)")
    await trio.to_thread.run_sync(_lay_out, bytes(data), fmt, partial, directory)
    found = cached_job_result(weights_dir, job_id)
    assert found is not None
    return found


def _lay_out(data: bytes, fmt: str, partial: Path, directory: Path) -> None:
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    if fmt == GGUF:
        (partial / GGUF_NAME).write_bytes(data)
    elif fmt == PEFT:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                name = PurePosixPath(member.name)
                if not member.isfile() or name.is_absolute() or ".." in name.parts:
                    raise JobFetchError(f"the adapter archive holds {member.name!r}, which is not a plain file "
                                        "inside it: refused")
                target = partial.joinpath(*name.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                with source, target.open("wb") as out:
                    shutil.copyfileobj(source, out)
    else:
        raise JobFetchError(f"unknown result format {fmt!r}")
    (partial / COMPLETE_MARKER).write_text("complete\n")
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
