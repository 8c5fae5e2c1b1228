"""NVIDIA XID events from the kernel log, each reported once.

The driver prints one line per event, for instance::

    [14328.198504] NVRM: Xid (PCI:0000:0a:00): 31, pid=13332, name=cuda_plot_k32_v, Ch 00000010, ...
    [Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, ...
    May 6 00:38:27 alex kernel: [ 4909.922970] NVRM: Xid (0000:01:00): 13, 0005 00000000 ...

:func:`parse_xid_lines` reads such lines, :func:`read_kernel_log` fetches the recent kernel
log (journalctl, else dmesg) and :class:`XidWatcher` keeps what it has reported so each
event is reported once. read_kernel_log runs a program and blocks for up to
KERNEL_LOG_TIMEOUT_S; callers on the trio loop use ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import collections
import re
import subprocess
from collections.abc import Callable, Iterable
from typing import Any

import attrs

# How often an agent reads the kernel log for XIDs (issue 16).
XID_INTERVAL_S = 60.0

# How far back journalctl reads: three polls' worth, so an agent whose poll ran late (or
# whose journalctl failed once) still sees every line; the watcher drops the repeats.
KERNEL_LOG_WINDOW_S = 3 * XID_INTERVAL_S

# journalctl on a large journal takes a second or two; ten means it hangs (a journald
# stuck on a full disk), and the agent must not wait on it.
KERNEL_LOG_TIMEOUT_S = 10.0

# How many reported lines a watcher remembers: far more XID lines than a window holds even
# on a card that repeats one every second, and small enough to never matter.
XID_MEMORY_LINES = 10_000

_XID_LINE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\): "
    r"(?P<xid>\d+)(?:,\s*(?P<rest>.*))?$"
)
# Drivers since about 460 name the process: "pid=1234, name=python3, " or, when the event
# belongs to none, "pid='<unknown>', name=<unknown>, "; some print the pid alone.
_PROCESS = re.compile(r"^pid=(?P<pid>'<unknown>'|\d+)(?:, name=(?P<name><unknown>|[^,]*))?(?:,\s*|$)")
# The stamp the kernel (dmesg, journalctl -o short-monotonic, syslog's copy) put in brackets;
# the last one before "NVRM:" where a prefix has several.
_STAMP = re.compile(r"\[\s*(?P<stamp>[^\]]+?)\s*\]")


@attrs.frozen
class XidEvent:
    """One XID line, read.

    ``pci_address`` is as printed ("0000:3b:00": domain, bus, device). ``message`` is what
    follows the code and the process. ``pid`` and ``process`` are None where the driver
    printed none or "<unknown>". ``timestamp`` is the kernel's stamp in brackets as printed
    (seconds since boot, or a date with ``dmesg -T``), None when the line has none;
    ``monotonic_s`` is that stamp as a number when it is one. ``line`` is the whole line.
    """

    pci_address: str
    xid: int
    message: str
    pid: int | None
    process: str | None
    timestamp: str | None
    monotonic_s: float | None
    line: str


def parse_xid_lines(text: str | Iterable[str]) -> list[XidEvent]:
    """Returns the XID events in ``text`` (a log, or its lines), in order.

    Lines that are not XID reports are skipped; nothing raises.
    """
    lines = text.splitlines() if isinstance(text, str) else text
    events = []
    for raw in lines:
        line = raw.strip()
        match = _XID_LINE.search(line)
        if match is None:
            continue
        rest = match.group("rest") or ""
        pid: int | None = None
        process: str | None = None
        found = _PROCESS.match(rest)
        if found is not None:
            pid = int(found.group("pid")) if found.group("pid").isdigit() else None
            name = found.group("name")
            process = None if name in (None, "<unknown>") else name.strip()
            rest = rest[found.end() :]
        stamps = _STAMP.findall(line[: match.start()])
        timestamp = stamps[-1] if stamps else None
        events.append(
            XidEvent(
                pci_address=match.group("pci"),
                xid=int(match.group("xid")),
                message=rest.strip(),
                pid=pid,
                process=process,
                timestamp=timestamp,
                monotonic_s=_seconds(timestamp),
                line=line,
            )
        )
    return events


def _seconds(stamp: str | None) -> float | None:
    """Returns the stamp as seconds since boot, or None when it is a date or absent."""
    if stamp is None:
        return None
    try:
        return float(stamp)
    except ValueError:
        return None


Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def read_kernel_log(*, since_s: float = KERNEL_LOG_WINDOW_S, run: Runner = subprocess.run) -> tuple[list[str], str]:
    """Returns (lines, note): the kernel log's recent lines, and "" or why there are none.

    Asks ``journalctl -k -o short-monotonic`` for the last ``since_s`` seconds of this
    boot; where journalctl is missing or fails, reads the whole ring buffer with ``dmesg``
    (older lines then come too: the watcher reports each once). Each command gets
    KERNEL_LOG_TIMEOUT_S. Never raises: when neither answers the lines are [] and the note
    says why ("no kernel log: journalctl: ...; dmesg: ..."). ``run`` is subprocess.run or a
    stand-in taking the same arguments.
    """
    commands = (
        ["journalctl", "-k", "-o", "short-monotonic", "--no-pager", "-q", f"--since=-{max(1, int(since_s))}s"],
        ["dmesg"],
    )
    failures = []
    for argv in commands:
        try:
            done = run(argv, capture_output=True, text=True, timeout=KERNEL_LOG_TIMEOUT_S, check=False)
        except FileNotFoundError:
            failures.append(f"{argv[0]}: not installed")
            continue
        except subprocess.TimeoutExpired:
            failures.append(f"{argv[0]}: no answer in {KERNEL_LOG_TIMEOUT_S:g} s")
            continue
        except OSError as exc:
            failures.append(f"{argv[0]}: {exc}")
            continue
        if done.returncode != 0:
            why = (done.stderr or "").strip().splitlines()
            failures.append(f"{argv[0]}: exit status {done.returncode}" + (f" ({why[-1]})" if why else ""))
            continue
        return (done.stdout or "").splitlines(), ""
    return [], "no kernel log: " + "; ".join(failures)


class XidWatcher:
    """Reports each XID line once, however many kernel-log reads it appears in.

    A line is known by its kernel stamp and its text from "NVRM:" on, so the same event
    read through journalctl and through dmesg is still one event when both print the same
    stamp. Lines without a stamp that repeat word for word count once. Remembers the last
    ``memory`` lines (XID_MEMORY_LINES). Not thread-safe: one task polls it.
    """

    def __init__(self, memory: int = XID_MEMORY_LINES) -> None:
        self._seen: set[tuple[str | None, str]] = set()
        self._order: collections.deque[tuple[str | None, str]] = collections.deque()
        self._memory = memory

    def new_events(self, lines: str | Iterable[str]) -> list[XidEvent]:
        """Returns the XID events in ``lines`` that this watcher has not returned before."""
        fresh = []
        for event in parse_xid_lines(lines):
            key = (event.timestamp, event.line[event.line.find("NVRM:") :])
            if key in self._seen:
                continue
            self._remember(key)
            fresh.append(event)
        return fresh

    def poll(self, *, run: Runner = subprocess.run, **kwargs: Any) -> tuple[list[XidEvent], str]:
        """Returns (new events, note) from one :func:`read_kernel_log` (``kwargs`` go to it).

        Never raises; the note is "" or says why the kernel log could not be read.
        """
        lines, note = read_kernel_log(run=run, **kwargs)
        return self.new_events(lines), note

    def _remember(self, key: tuple[str | None, str]) -> None:
        """Adds ``key``, forgetting the oldest once more than ``memory`` are kept."""
        self._seen.add(key)
        self._order.append(key)
        while len(self._order) > self._memory:
            self._seen.discard(self._order.popleft())
