"""A node's training job reports (llmgw/node/jobs.py) across a control plane failover: the
result's pieces start again from the first for the leader that adopts the job (it holds none
of the pieces sent to the one before), also when the failover comes between the last piece
and the job's end. The reporters stand in for the control planes'
JobReporter capabilities; the failover as a whole runs in tests/engines/test_training_e2e.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import capnp
import pytest
import trio

from llmgw.node import jobs


class Leader:
    """A control plane's JobReporter as the scheduler keeps it: pieces must follow each other
    from offset 0 (llmgw/control/training.py); ``dies_after`` pieces, it stops answering."""

    def __init__(self, dies_after: int | None = None) -> None:
        self.received = b""
        self.offsets: list[int] = []
        self.dies_after = dies_after
        self.dead = trio.Event()
        self.ended: tuple[bool, str] | None = None

    def _alive(self) -> None:
        if self.dies_after is not None and len(self.offsets) >= self.dies_after:
            self.dead.set()
            raise capnp.KjException("disconnected: the leader is gone")

    async def result(self, offset: int, piece: bytes, total: int, sha256: str, fmt: str) -> None:
        self._alive()
        if offset != len(self.received):
            raise capnp.KjException(f"piece at {offset} does not follow the {len(self.received)} bytes received")
        self.offsets.append(offset)
        self.received += piece

    async def finished(self, ok: bool, message: str) -> None:
        self._alive()
        assert self.received, "the end of a job whose result this leader does not hold"
        self.ended = (ok, message)


async def test_a_result_is_sent_again_from_its_first_piece_to_the_leader_that_adopts_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs, "RESULT_PIECE_BYTES", 4)
    result = b"0123456789abcdefghij"  # five pieces
    old, new = Leader(dies_after=2), Leader()
    runner = jobs.JobRunner(tmp_path, train=None)  # type: ignore[arg-type]
    reports = jobs._Reports("job-1", old, trio.CancelScope())
    with trio.fail_after(10):  # without the restart the node waits REBIND_GRACE_S for yet another leader
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner._send_result, result, "peft", reports)
            await old.dead.wait()  # two pieces reached the old leader; the third found it gone
            reports.rebind(new)  # the new leader adopts the job when the node rejoins
    assert old.offsets == [0, 4]
    assert new.offsets == [0, 4, 8, 12, 16] and new.received == result
    assert not reports.lost
    assert hashlib.sha256(new.received).hexdigest() == hashlib.sha256(result).hexdigest()


async def test_a_leader_that_adopts_the_job_after_its_whole_result_gets_it_before_the_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs, "RESULT_PIECE_BYTES", 4)
    result = b"0123456789abcdefghij"
    old, new = Leader(dies_after=5), Leader()  # the old leader takes every piece, then goes
    runner = jobs.JobRunner(tmp_path, train=None)  # type: ignore[arg-type]
    reports = jobs._Reports("job-1", old, trio.CancelScope())
    with trio.fail_after(10):
        delivered = await runner._send_result(result, "peft", reports)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner._report_end, True, "", delivered, reports)
            await old.dead.wait()  # the end found the old leader gone
            reports.rebind(new)
    assert old.received == result and old.ended is None
    assert new.offsets == [0, 4, 8, 12, 16] and new.received == result and new.ended == (True, "")
