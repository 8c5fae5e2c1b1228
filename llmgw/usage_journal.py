"""An append-only journal of finished requests' usage: a crash of the gateway loses at most
the requests in flight at that moment.

The gateway counts usage in memory and the control plane stores it every
``serving.usage_flush_interval``; a kill -9 in between used to lose what was counted since
the last flush. Now every process that counts usage (the one gateway, or each worker of
a pool) also appends each finished request to its own *journal*, and the control plane
replays what is left of the journals into the store on start, before the gateway serves.

Layout, in one directory (``<state_dir>/usage-journal``, mode 0700)::

    <journal id>.<first sequence, 16 digits>.usage     one segment, mode 0600

A journal id is random per process start. A record is one line,
``<crc32 of the JSON, 8 hex digits> <JSON [seq, tenant, model, prompt, completion]>``;
sequences start at 1 in each journal and go up by one per record. A line cut short (the
process or the disk failed mid-write) or whose checksum does not match is skipped.

Exactly once, by a mark per journal: the store keeps, per journal id, the highest sequence
whose usage it holds, written in the same transaction as that usage
(``Store.add_usage(rows, marks=...)``). While serving, the meter's counts carry their
journal's last sequence to the store, and then :func:`release` deletes the segments
entirely at or below the mark. On start, :func:`read_journals` returns what every journal
left holds; the records above its mark are stored with the new mark in one transaction,
then the journal's files are deleted (:func:`remove_journal`), then its mark. A crash
between any two of these steps only repeats a step that changes nothing the second time.

:class:`UsageJournal` is synchronous (one ``write`` per record, on the trio thread: a few
microseconds) and never raises on the request path: a write that fails (disk full) is
counted (``failures``, the gateway's ``llmgw_usage_journal_write_failures_total``) and
logged at most once per :data:`FAILURE_LOG_INTERVAL_S`, and serving goes on with the
in-memory count alone.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import time
import zlib
from pathlib import Path
from typing import Callable, Mapping

import attrs

from llmgw.logthrottle import LogThrottle, reason

log = logging.getLogger(__name__)

#: The journal directory's name under a control plane's state directory.
JOURNAL_DIR_NAME = "usage-journal"
SEGMENT_SUFFIX = ".usage"
# fsync policy: no fsync per record. Each record reaches the kernel with one ``write``
# before the request counts as finished, which is all a crash of the gateway process
# (kill -9, OOM kill) cannot take away; an fsync per request would put a disk flush on
# every request's path. A segment is fdatasync'ed when it is closed (rotation, stop), so
# power loss or a kernel crash loses at most the open segment's unsynced tail.
#: A segment is closed and a new one started past this size, so :func:`release` can
#: delete stored records while the journal keeps growing (about 10,000 records).
SEGMENT_MAX_BYTES = 1 << 20
#: ... or past this age, so a quiet gateway's stored records do not linger for days.
SEGMENT_MAX_AGE_S = 60.0
#: Repeated write failures (a full disk fails every request) are logged once with a count
#: per this interval, not once per request.
FAILURE_LOG_INTERVAL_S = 60.0
#: Bound on one record's tenant and model names: longer ones are never valid catalog or
#: tenant names, and the journal must not grow by what a client sends.
MAX_NAME_CHARS = 256


@attrs.frozen
class JournalRecord:
    """One finished request's usage, as journaled."""

    seq: int
    tenant: str
    model: str
    prompt_tokens: int
    completion_tokens: int


def journal_dir(state_dir: Path) -> Path:
    """Return the usage journal directory under a control plane's ``state_dir``."""
    return state_dir / JOURNAL_DIR_NAME


def encode_record(record: JournalRecord) -> bytes:
    """Return ``record`` as one journal line (checksum, space, JSON, newline)."""
    body = json.dumps(
        [record.seq, record.tenant, record.model, record.prompt_tokens, record.completion_tokens],
        separators=(",", ":"), ensure_ascii=True,
    ).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def decode_record(line: bytes) -> JournalRecord | None:
    """Return the record of one journal line (without its newline), or None if it is torn
    or corrupt (checksum mismatch, not a record)."""
    crc, _, body = line.partition(b" ")
    try:
        if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
            return None
        seq, tenant, model, prompt, completion = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(tenant, str) and isinstance(model, str)
            and all(type(n) is int and n >= 0 for n in (seq, prompt, completion))):
        return None
    return JournalRecord(seq, tenant, model, prompt, completion)


def _segment_name(journal_id: str, first_seq: int) -> str:
    return f"{journal_id}.{first_seq:016d}{SEGMENT_SUFFIX}"


def _segments(directory: Path) -> dict[str, list[tuple[int, Path]]]:
    """Return each journal's segments as (first sequence, path), oldest first ({} if the
    directory does not exist)."""
    found: dict[str, list[tuple[int, Path]]] = {}
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return found
    for path in entries:
        journal_id, dot, rest = path.name.partition(".")
        first, suffix_dot, _ = rest.partition(".")
        if not dot or not suffix_dot or not path.name.endswith(SEGMENT_SUFFIX) or not first.isdigit():
            continue
        found.setdefault(journal_id, []).append((int(first), path))
    for segments in found.values():
        segments.sort()
    return found


def read_journals(directory: Path) -> dict[str, list[JournalRecord]]:
    """Return every journal's records in ``directory``, by journal id, in sequence order.

    Torn or corrupt lines are skipped (and logged with their count). Raises ``OSError`` if
    a segment cannot be read.
    """
    journals: dict[str, list[JournalRecord]] = {}
    for journal_id, segments in _segments(directory).items():
        records: list[JournalRecord] = []
        skipped = 0
        for _, path in segments:
            data = path.read_bytes()
            lines = data.split(b"\n")
            # The last element is what follows the last newline: b"" or a torn record.
            skipped += bool(lines[-1])
            for line in lines[:-1]:
                record = decode_record(line)
                if record is None:
                    skipped += 1
                else:
                    records.append(record)
        if skipped:
            log.warning("usage journal %s: skipped %d torn or corrupt record(s)", journal_id, skipped)
        records.sort(key=lambda r: r.seq)
        journals[journal_id] = records
    return journals


def remove_journal(directory: Path, journal_id: str) -> None:
    """Delete every segment of ``journal_id`` in ``directory`` (missing ones are fine).

    Raises ``OSError`` if one cannot be deleted.
    """
    for _, path in _segments(directory).get(journal_id, ()):
        path.unlink(missing_ok=True)


def release(directory: Path, marks: Mapping[str, int]) -> int:
    """Delete the segments whose records are all at or below their journal's mark in
    ``marks`` (the store holds them); return how many were deleted.

    A segment is deleted only once a newer one of the same journal starts at or below
    ``mark + 1``, so the segment a journal is appending to is never deleted. Errors are
    logged, never raised (the files are deleted at the next release or replay instead).
    """
    deleted = 0
    for journal_id, segments in _segments(directory).items():
        mark = marks.get(journal_id)
        if mark is None:
            continue
        for (_, path), (next_first, _) in zip(segments, segments[1:]):
            if next_first > mark + 1:
                break
            try:
                path.unlink(missing_ok=True)
                deleted += 1
            except OSError as exc:
                log.warning("usage journal: could not delete %s: %s", path, exc)
    return deleted


class UsageJournal:
    """One process's journal in ``directory`` (created 0700 on first use).

    :meth:`append` writes one record and returns its sequence; the file is opened on the
    first append, so a journal that records nothing leaves nothing behind. :meth:`close`
    syncs and closes the open segment. ``on_failure`` is called once per failed write
    (the gateway counts it in a metric).
    """

    def __init__(
        self, directory: Path, *, journal_id: str | None = None,
        on_failure: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Path(directory)
        self.id = journal_id or secrets.token_hex(8)
        self.on_failure = on_failure
        self.failures = 0
        self._clock = clock
        self._seq = 0
        self._fd: int | None = None
        self._size = 0  # bytes of whole records in the open segment
        self._torn = False  # the open segment may end in a partly written record
        self._opened_at = 0.0
        self._failing = False
        self._throttle = LogThrottle(log, interval=FAILURE_LOG_INTERVAL_S, clock=clock)

    @property
    def seq(self) -> int:
        """The sequence of the last record appended (0 before the first)."""
        return self._seq

    def append(self, tenant: str, model: str, prompt_tokens: int, completion_tokens: int) -> int:
        """Journal one finished request; return its sequence number.

        Never raises: a failed write is counted and logged (rate-limited); what it left half
        written is cut off before the next record is written (in the same file, so a disk
        that stays full does not leave a file per request).
        """
        self._seq += 1
        record = JournalRecord(self._seq, tenant[:MAX_NAME_CHARS], model[:MAX_NAME_CHARS],
                               prompt_tokens, completion_tokens)
        line = encode_record(record)
        try:
            if self._torn and self._fd is not None:
                os.ftruncate(self._fd, self._size)
                self._torn = False
            if self._fd is None or self._size >= SEGMENT_MAX_BYTES \
                    or self._clock() - self._opened_at >= SEGMENT_MAX_AGE_S:
                self._rotate()
            assert self._fd is not None
            self._torn = True  # until the whole record is written
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, f"short write ({written} of {len(line)} bytes)")
            self._torn = False
            self._size += written
        except OSError as exc:
            self._failed(exc)
        else:
            if self._failing:
                self._failing = False
                self._throttle.recovered("write", "usage journal %s: journaling again", self.id)
        return self._seq

    def close(self) -> None:
        """Sync and close the open segment (if any). Idempotent; never raises."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.fdatasync(fd)
        except OSError as exc:
            log.warning("usage journal %s: could not sync its last segment: %s", self.id, exc)
        finally:
            os.close(fd)

    def _rotate(self) -> None:
        """Close the open segment and open a new one starting at the current sequence."""
        self.close()
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.directory / _segment_name(self.id, self._seq)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._size = 0
        self._opened_at = self._clock()

    def _failed(self, exc: OSError) -> None:
        self.failures += 1
        self._failing = True
        if self.on_failure is not None:
            self.on_failure()
        self._throttle.failure(
            "write", logging.WARNING, "usage journal %s: a record was not journaled (%s); usage is still "
            "counted in memory, but a crash before the next store flush would lose it", self.id, reason(exc))
