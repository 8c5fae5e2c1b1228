"""Readers for /proc: CPU time, load averages, memory, and a process group's CPU and memory.

Every reader takes ``root``, the directory that holds ``proc/`` (``Path("/")`` on a live
host; a recorded tree in tests). They are synchronous and quick: each reads a handful of
small files. Errors are the caller's to handle unless a docstring says otherwise: a
missing or malformed file raises OSError or ValueError.

Counters here are cumulative since boot (or since a process started); a rate needs two
readings, and the ``*_percent``/``*_cores`` helpers take the pair.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

ROOT = Path("/")

# /proc/meminfo prints sizes in kibibytes ("kB" there means 1024 bytes).
_KIB = 1024

# The fields of the aggregate "cpu" line of /proc/stat, in the order the kernel prints
# them (proc(5)). Older kernels print fewer; the missing ones read as 0.
_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal", "guest", "guest_nice")

# A "cpu" line needs at least user, nice, system and idle to mean anything.
_MIN_CPU_FIELDS = 4

# Indexes into the fields of /proc/PID/stat that follow the ")" closing comm: the first of
# them is field 3 (state) in proc(5)'s numbering, so field N is at index N - 3.
_STAT_PGRP = 5 - 3
_STAT_UTIME = 14 - 3
_STAT_STIME = 15 - 3
_STAT_STARTTIME = 22 - 3
_STAT_RSS = 24 - 3


@attrs.frozen
class CpuTimes:
    """The aggregate "cpu" line of /proc/stat: time spent by all CPUs together, in clock ticks.

    ``guest`` and ``guest_nice`` are already counted inside ``user`` and ``nice`` (the
    kernel adds them to both), so :attr:`total` leaves them out.
    """

    user: int
    nice: int
    system: int
    idle: int
    iowait: int = 0
    irq: int = 0
    softirq: int = 0
    steal: int = 0
    guest: int = 0
    guest_nice: int = 0

    @property
    def total(self) -> int:
        """Returns all time counted, in ticks (guest time is inside user and nice already)."""
        return (
            self.user + self.nice + self.system + self.idle + self.iowait + self.irq + self.softirq + self.steal
        )

    @property
    def idle_all(self) -> int:
        """Returns the time no task ran, in ticks: idle plus iowait (a CPU waiting on I/O is idle)."""
        return self.idle + self.iowait


@attrs.frozen
class MemoryReading:
    """Memory of the host, in bytes, from /proc/meminfo.

    ``available`` is the kernel's MemAvailable: what new work could get without swapping
    (free memory plus the page cache and slab it can reclaim). ``used`` is ``total -
    available``, so the reclaimable cache does not count as used. Kernels before 3.14 do
    not print MemAvailable; there both are ``None`` (not estimated).
    """

    total: int
    available: int | None
    used: int | None


@attrs.frozen
class GroupSample:
    """The processes of one process group at one moment.

    ``cpu_seconds`` is user plus system time, summed over the group's live processes;
    ``rss_bytes`` their resident memory summed (shared pages count once per process, so
    this can exceed what the group really holds). ``cpu_by_process`` holds each process's
    CPU seconds under (pid, start time in ticks), so that :func:`group_cores` can tell a
    process that exited or a pid that was reused from one that kept running.
    """

    cpu_seconds: float
    rss_bytes: int
    pids: tuple[int, ...]
    cpu_by_process: Mapping[tuple[int, int], float] = attrs.field(factory=dict)


def read_cpu_times(root: Path = ROOT) -> CpuTimes:
    """Returns the aggregate CPU times from ``root``/proc/stat.

    Raises OSError if the file cannot be read, ValueError if it has no well-formed "cpu"
    line.
    """
    text = (root / "proc" / "stat").read_text()
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            return parse_cpu_line(fields[1:])
    raise ValueError(f"{root / 'proc' / 'stat'} has no aggregate 'cpu' line")


def parse_cpu_line(values: list[str]) -> CpuTimes:
    """Returns the CpuTimes of the numbers after "cpu". Raises ValueError when malformed."""
    if len(values) < _MIN_CPU_FIELDS:
        raise ValueError(f"the 'cpu' line of /proc/stat has {len(values)} fields, expected at least 4")
    numbers = [int(v) for v in values[: len(_CPU_FIELDS)]]
    return CpuTimes(**dict(zip(_CPU_FIELDS, numbers)))


def cpu_utilization_percent(before: CpuTimes, after: CpuTimes) -> float | None:
    """Returns how busy all CPUs together were between two readings, 0 to 100.

    Busy is everything but idle and iowait (steal counts as busy: the CPU was not ours to
    idle on). Returns None when no time passed between the readings (or the counters went
    back, as after a CPU was taken offline). Never raises.
    """
    total = after.total - before.total
    if total <= 0:
        return None
    idle = after.idle_all - before.idle_all
    busy = total - idle
    return min(100.0, max(0.0, 100.0 * busy / total))


def read_loadavg(root: Path = ROOT) -> tuple[float, float, float]:
    """Returns the 1, 5 and 15 minute load averages from ``root``/proc/loadavg.

    Raises OSError if the file cannot be read, ValueError if it is malformed.
    """
    fields = (root / "proc" / "loadavg").read_text().split()
    if len(fields) < 3:
        raise ValueError(f"{root / 'proc' / 'loadavg'} has {len(fields)} fields, expected at least 3")
    return float(fields[0]), float(fields[1]), float(fields[2])


def read_memory(root: Path = ROOT) -> MemoryReading:
    """Returns total, available and used memory in bytes from ``root``/proc/meminfo.

    See :class:`MemoryReading` for what "available" and "used" mean. Raises OSError if
    the file cannot be read, ValueError if it has no MemTotal line or a malformed one.
    """
    values: dict[str, int] = {}
    for line in (root / "proc" / "meminfo").read_text().splitlines():
        key, sep, rest = line.partition(":")
        if not sep or key not in ("MemTotal", "MemAvailable"):
            continue
        parts = rest.split()
        if not parts:
            raise ValueError(f"meminfo line {line!r} has no value")
        scale = _KIB if len(parts) > 1 and parts[1] == "kB" else 1
        values[key] = int(parts[0]) * scale
    if "MemTotal" not in values:
        raise ValueError(f"{root / 'proc' / 'meminfo'} has no MemTotal line")
    total = values["MemTotal"]
    available = values.get("MemAvailable")
    used = None if available is None else max(0, total - available)
    return MemoryReading(total=total, available=available, used=used)


def parse_pid_stat(text: str) -> tuple[str, list[str]]:
    """Returns (comm, the fields after comm) of one /proc/PID/stat.

    comm is whatever the process named itself and may hold spaces and parentheses, so it
    runs from the first "(" to the last ")". Raises ValueError when there are none.
    """
    start = text.find("(")
    end = text.rfind(")")
    if start < 0 or end < start:
        raise ValueError(f"malformed /proc/PID/stat: {text[:80]!r}")
    return text[start + 1 : end], text[end + 1 :].split()


def read_process_group(root: Path, pgid: int, *, clock_ticks: int, page_size: int) -> GroupSample:
    """Returns the summed CPU time and resident memory of every process in group ``pgid``.

    Walks ``root``/proc/PID/stat for every numeric PID and keeps those whose pgrp field
    is ``pgid``. ``clock_ticks`` is ``os.sysconf("SC_CLK_TCK")`` and ``page_size``
    ``os.sysconf("SC_PAGE_SIZE")`` on a live host (see :func:`live_units`). A process
    that exits while the walk runs, or whose stat cannot be read or parsed, is left out;
    only a missing or unreadable ``proc`` directory raises OSError. A group with no
    processes gives an empty sample (no pids).
    """
    return read_process_groups(root, [pgid], clock_ticks=clock_ticks, page_size=page_size)[pgid]


def read_process_groups(
    root: Path, pgids: Iterable[int], *, clock_ticks: int, page_size: int
) -> dict[int, GroupSample]:
    """Returns :func:`read_process_group` for each of ``pgids``, walking /proc once.

    Every pgid asked for is in the result (an empty sample if no process has it). Raises
    OSError only if ``root``/proc cannot be listed.
    """
    wanted = set(pgids)
    found: dict[int, list[tuple[int, int, float, int]]] = {pgid: [] for pgid in wanted}
    for entry in os.scandir(root / "proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "stat")) as stat_file:
                text = stat_file.read()
            _comm, fields = parse_pid_stat(text)
            pgrp = int(fields[_STAT_PGRP])
            if pgrp not in wanted:
                continue
            cpu = (int(fields[_STAT_UTIME]) + int(fields[_STAT_STIME])) / clock_ticks
            rss = max(0, int(fields[_STAT_RSS])) * page_size
            started = int(fields[_STAT_STARTTIME])
        except (OSError, ValueError, IndexError):
            # Gone between the listing and the read (ENOENT, or ESRCH on a process being
            # reaped), or a stat we cannot make sense of: not part of this sample.
            continue
        found[pgrp].append((int(entry.name), started, cpu, rss))
    return {pgid: _group_sample(processes) for pgid, processes in found.items()}


def _group_sample(processes: list[tuple[int, int, float, int]]) -> GroupSample:
    """Returns the GroupSample of (pid, start time, cpu seconds, rss bytes) tuples."""
    return GroupSample(
        cpu_seconds=sum(cpu for _pid, _started, cpu, _rss in processes),
        rss_bytes=sum(rss for _pid, _started, _cpu, rss in processes),
        pids=tuple(sorted(pid for pid, _started, _cpu, _rss in processes)),
        cpu_by_process={(pid, started): cpu for pid, started, cpu, _rss in processes},
    )


def group_cores(before: GroupSample, after: GroupSample, seconds: float) -> float:
    """Returns how many cores' worth of CPU the group used between two samples.

    Counts, for each process in ``after``, the CPU time it gained since ``before``; a
    process new since then (or a reused pid, told apart by its start time) counts all its
    time. A process that exited in between is not in ``after`` and its last moments are
    lost: the result can be a little low, never negative. Returns 0.0 when ``seconds`` is
    not positive. Never raises.
    """
    if seconds <= 0:
        return 0.0
    used = 0.0
    for key, cpu in after.cpu_by_process.items():
        previous = before.cpu_by_process.get(key, 0.0)
        used += cpu - previous if cpu >= previous else cpu
    return used / seconds


def live_units() -> tuple[int, int]:
    """Returns (clock ticks per second, page size in bytes) of this host."""
    return int(os.sysconf("SC_CLK_TCK")), int(os.sysconf("SC_PAGE_SIZE"))
