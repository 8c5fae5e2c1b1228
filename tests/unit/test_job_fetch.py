"""A training job's result laid out on a node (llmgw/node/job_fetch.py): pieces checked against
the whole's SHA-256, a PEFT tar unpacked with nothing outside its directory, a GGUF kept as is,
a complete result never fetched again."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from llmgw.node.job_fetch import GGUF_NAME, JobFetchError, cached_job_result, fetch_job_result


def tar_of(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def control_plane(data: bytes, fmt: str, piece: int = 7, sha256: str | None = None):  # type: ignore[no-untyped-def]
    """Answers NodeDesk.jobResult as the control plane does: PIECE bytes at a time."""
    calls: list[int] = []

    async def pieces(job_id: str, offset: int) -> tuple[bytes, int, str, str]:
        calls.append(offset)
        return data[offset:offset + piece], len(data), sha256 or hashlib.sha256(data).hexdigest(), fmt

    return pieces, calls


async def test_a_peft_result_is_unpacked_and_kept(tmp_path: Path) -> None:
    data = tar_of({"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"x" * 40})
    pieces, calls = control_plane(data, "peft")
    got = await fetch_job_result("job-1", tmp_path, pieces, lambda _: None, "adapter a")
    assert got == tmp_path / "jobs" / "job-1" and (got / "adapter_config.json").read_bytes() == b'{"r": 4}'
    assert len(calls) == -(-len(data) // 7)
    again = await fetch_job_result("job-1", tmp_path, None, lambda _: None, "adapter a")  # no session needed
    assert again == got and cached_job_result(tmp_path, "job-1") == got


async def test_a_gguf_result_is_one_file(tmp_path: Path) -> None:
    pieces, _ = control_plane(b"GGUF" + b"\0" * 20, "gguf")
    got = await fetch_job_result("job-2", tmp_path, pieces, lambda _: None, "adapter g")
    assert got.name == GGUF_NAME and got.read_bytes()[:4] == b"GGUF"


async def test_damage_escapes_and_no_session_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    data = tar_of({"adapter_config.json": b"{}"})
    pieces, _ = control_plane(data, "peft", sha256="0" * 64)
    with pytest.raises(JobFetchError, match="arrived damaged"):
        await fetch_job_result("job-3", tmp_path, pieces, lambda _: None, "adapter d")
    escaping, _ = control_plane(tar_of({"../../etc/evil": b"x"}), "peft")
    with pytest.raises(JobFetchError, match="not a plain file inside it"):
        await fetch_job_result("job-4", tmp_path, escaping, lambda _: None, "adapter e")
    with pytest.raises(JobFetchError, match="once the agent has joined"):
        await fetch_job_result("job-5", tmp_path, None, lambda _: None, "adapter n")
    assert cached_job_result(tmp_path, "job-3") is None and cached_job_result(tmp_path, "job-4") is None
    assert not (tmp_path.parent / "etc").exists()
