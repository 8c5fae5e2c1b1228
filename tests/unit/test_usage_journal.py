"""The usage journal: records survive the process, torn or corrupt lines are skipped,
segments rotate and are released once stored, a failed write is counted and never raised."""

from __future__ import annotations

import errno
import logging
import os
import stat
import zlib
from pathlib import Path

import pytest

from llmgw import usage_journal
from llmgw.router.usage import Usage, UsageCounts, UsageMeter
from llmgw.usage_journal import JournalRecord, UsageJournal, decode_record, encode_record, read_journals, release


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_records_round_trip_and_files_are_private(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    journal = UsageJournal(directory, journal_id="j1")
    assert not directory.exists()  # nothing journaled, nothing left behind
    assert [journal.append("acme", "m", 3, 4), journal.append("beta", "m", 0, 0)] == [1, 2]
    # No close: what a kill -9 leaves behind is already readable.
    assert read_journals(directory) == {"j1": [JournalRecord(1, "acme", "m", 3, 4), JournalRecord(2, "beta", "m", 0, 0)]}
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    [segment] = directory.iterdir()
    assert stat.S_IMODE(segment.stat().st_mode) == 0o600
    journal.close()
    journal.close()  # idempotent


def test_a_torn_last_record_and_a_corrupt_one_are_skipped(tmp_path: Path) -> None:
    journal = UsageJournal(tmp_path, journal_id="j1")
    for n in range(3):
        journal.append("acme", "m", n, 1)
    journal.close()
    [segment] = tmp_path.iterdir()
    lines = segment.read_bytes().split(b"\n")
    flipped = lines[1].replace(b'"acme"', b'"acmf"')  # the checksum no longer matches
    torn = encode_record(JournalRecord(4, "acme", "m", 9, 9))[:-7]
    segment.write_bytes(b"\n".join([lines[0], flipped, lines[2], b""]) + torn)
    assert [r.seq for r in read_journals(tmp_path)["j1"]] == [1, 3]
    assert decode_record(b"") is None and decode_record(b"0000000x []") is None
    body = b'[1,"t","m",-1,0]'
    assert decode_record(b"%08x %s" % (zlib.crc32(body), body)) is None  # negative tokens


def test_segments_rotate_and_release_deletes_only_what_is_stored(tmp_path: Path) -> None:
    clock = FakeClock()
    journal = UsageJournal(tmp_path, journal_id="j1", clock=clock)
    journal.append("t", "m", 1, 1)  # segment from 1
    journal.append("t", "m", 1, 1)
    clock.now += usage_journal.SEGMENT_MAX_AGE_S
    journal.append("t", "m", 1, 1)  # segment from 3
    clock.now += usage_journal.SEGMENT_MAX_AGE_S
    journal.append("t", "m", 1, 1)  # segment from 4: the open one
    assert len(list(tmp_path.iterdir())) == 3
    assert release(tmp_path, {"j1": 1}) == 0  # segment 1-2 is not all stored yet
    assert release(tmp_path, {"other": 99}) == 0
    assert release(tmp_path, {"j1": 3}) == 2
    assert [r.seq for r in read_journals(tmp_path)["j1"]] == [4]
    assert release(tmp_path, {"j1": 99}) == 0  # the newest segment is never released
    journal.close()


def test_a_failed_write_is_counted_and_its_torn_tail_cut_before_the_next_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.usage_journal")
    failures: list[None] = []
    journal = UsageJournal(tmp_path, journal_id="j1", on_failure=lambda: failures.append(None))
    journal.append("t", "m", 1, 1)
    real_write = os.write
    calls: list[int] = []

    def full_disk(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:  # the disk fills up mid-record
            return real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(usage_journal.os, "write", full_disk)
    assert journal.append("t", "m", 1, 1) == 2  # never raises
    assert journal.append("t", "m", 1, 1) == 3
    assert journal.failures == 2 and len(failures) == 2
    monkeypatch.setattr(usage_journal.os, "write", real_write)
    journal.append("t", "m", 1, 1)
    lines = [r.getMessage() for r in caplog.records]
    assert len([line for line in lines if "not journaled" in line]) == 1, lines  # a full disk: one line
    assert "journaling again" in lines[-1] and "1 more failures" in lines[-1]
    journal.close()
    assert [r.seq for r in read_journals(tmp_path)["j1"]] == [1, 4]
    [segment] = tmp_path.iterdir()  # one file, no torn bytes left in it
    assert segment.read_bytes().count(b"\n") == 2 and segment.read_bytes().endswith(b"\n")


def test_the_meter_journals_each_request_and_its_batches_carry_the_mark(tmp_path: Path) -> None:
    meter = UsageMeter(UsageJournal(tmp_path, journal_id="j1"))
    meter.record("t", "m", Usage(3, 4))
    meter.record("t", "m", None)
    batch = meter.drain()
    assert batch.counts == {("t", "m"): UsageCounts(2, 3, 4)} and batch.marks == {"j1": 2}
    meter.record("t", "m", Usage(1, 1))
    meter.restore(batch)  # the store write failed: the mark stays the highest
    again = meter.drain()
    assert again.counts == {("t", "m"): UsageCounts(3, 4, 5)} and again.marks == {"j1": 3}
    assert not meter.drain()
    meter.close()
    assert [(r.seq, r.prompt_tokens) for r in read_journals(tmp_path)["j1"]] == [(1, 3), (2, 0), (3, 1)]
