"""Engine processes: spawn, identify, adopt, follow output, stop.

An engine must outlive the agent that started it (the agent may restart or be
upgraded while the engine keeps serving). So an engine runs in its own session and
process group, its stdin is /dev/null, and its stdout and stderr go to a log file in
the shard's state directory (opened for append; the agent closes its copy right after
the spawn), never to a pipe that would break when the agent dies.
:class:`OutputTail` follows that file, so output is read the same way whether the
engine is our child or was adopted from a previous agent.

A process is identified by :class:`ProcessIdentity` (pid, create time, command line);
a later agent adopts a process only when all three still match, so a recycled pid is
never mistaken for the engine.

Waiting for exit uses trio's own child handling for processes we spawned and a pidfd
(``os.pidfd_open``, Linux 5.3+) for adopted processes that are not our children, with
a bounded psutil poll as the fallback where pidfds are unavailable.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import attrs
import psutil
import trio

from llmgw.node.engine_user import EngineUser, popen_identity

logger = logging.getLogger(__name__)

# How many of an engine's last output lines are kept in memory per shard: enough for
# a traceback or a CUDA error plus context, small enough for hundreds of shards.
OUTPUT_LINES = 500

# How often the output reader looks for new lines in the log file. There is no
# portable file-change notification in trio; 0.1 s keeps `logs` fresh and costs nothing.
OUTPUT_POLL_INTERVAL = 0.1

# When rebuilding the last-lines buffer of an adopted engine, read at most this much
# of the log file's end (OUTPUT_LINES lines of up to ~500 bytes each).
OUTPUT_TAIL_BYTES = 256 * 1024

# A line longer than this is cut (engines sometimes print whole tensors or JSON blobs).
MAX_LINE_CHARS = 4096

# How often an adopted process is polled for exit where pidfds are unavailable.
ADOPTED_POLL_INTERVAL = 0.5

# The spawn returns once exec has closed the child's close-on-exec descriptors, but the
# kernel sets up the new image's argument area a moment later: /proc/PID/cmdline reads
# empty in between. The identity is read again until it shows the command line, every
# EXEC_SETTLE_POLL seconds for at most EXEC_SETTLE_WAIT (exec takes microseconds; a
# second covers a loaded machine, and after it the identity is kept as read).
EXEC_SETTLE_POLL = 0.001
EXEC_SETTLE_WAIT = 1.0

# After SIGKILL a process is gone within milliseconds unless it is stuck in the kernel
# (uninterruptible I/O); give up waiting after this and say so rather than hang a stop.
KILL_WAIT = 10.0

# create_time is computed from the kernel's start ticks and boot time; allow float noise.
_CREATE_TIME_TOLERANCE = 0.01


@attrs.frozen
class ProcessIdentity:
    """Who a process is: pid alone is recycled, pid + create time + cmdline is not."""

    pid: int
    create_time: float
    cmdline: tuple[str, ...] = attrs.field(converter=tuple)

    def to_json(self) -> dict[str, Any]:
        """Returns a JSON-ready dict (see :meth:`from_json`)."""
        return {"pid": self.pid, "create_time": self.create_time, "cmdline": list(self.cmdline)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProcessIdentity:
        """Returns the identity stored by :meth:`to_json`; KeyError/TypeError if malformed."""
        return cls(pid=int(data["pid"]), create_time=float(data["create_time"]), cmdline=tuple(data["cmdline"]))


def identity_of(pid: int) -> ProcessIdentity | None:
    """Returns the identity of the live process ``pid``, or None if it is gone or a zombie."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return ProcessIdentity(pid=pid, create_time=proc.create_time(), cmdline=tuple(proc.cmdline()))
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def same_process(a: ProcessIdentity, b: ProcessIdentity) -> bool:
    """Returns True if both name one process: same pid and start time (the command line
    may differ, engines retitle themselves)."""
    return a.pid == b.pid and abs(a.create_time - b.create_time) <= _CREATE_TIME_TOLERANCE


def matches(identity: ProcessIdentity) -> bool:
    """Returns True if a live process has this pid, create time and command line."""
    current = identity_of(identity.pid)
    if current is None:
        return False
    return (
        abs(current.create_time - identity.create_time) <= _CREATE_TIME_TOLERANCE
        and current.cmdline == identity.cmdline
    )


def describe_exit(returncode: int | None) -> str:
    """Returns how a process ended, in words: "exited with code 3", "killed by signal SIGKILL"."""
    if returncode is None:
        return "exited (exit status unknown: it was adopted, not our child)"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by signal {name}"
    return f"exited with code {returncode}"


class EngineProcess(Protocol):
    """A running engine, spawned or adopted. ``identity.pid`` is also its process group id."""

    identity: ProcessIdentity
    adopted: bool

    async def wait(self) -> int | None:
        """Waits for the process to exit; returns its exit code (negative: signal), None if unknown."""
        ...

    def poll(self) -> int | None | bool:
        """Returns the exit code if exited (None if unknown), or False while running."""
        ...

    def close(self) -> None:
        """Releases OS handles (pidfd). Does not signal the process."""
        ...


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Sends ``sig`` to process group ``pgid``; returns False if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


class SpawnedProcess:
    """An engine we started ourselves (our child): trio reaps it and gives its exit code."""

    adopted = False

    def __init__(self, proc: trio.Process, identity: ProcessIdentity) -> None:
        self._proc = proc
        self.identity = identity

    async def wait(self) -> int | None:
        """Waits for exit and returns the exit code (negative for a signal). Cancellable."""
        return await self._proc.wait()

    def poll(self) -> int | None | bool:
        """Returns the exit code if the child exited, False while it runs."""
        code = self._proc.poll()
        return False if code is None else code

    def close(self) -> None:
        """Nothing to release: trio owns the child's handles."""


class AdoptedProcess:
    """An engine started by a previous agent: not necessarily our child.

    Exit is observed through a pidfd (readable once the process exits); where pidfds
    are unavailable, psutil is polled every :data:`ADOPTED_POLL_INTERVAL` seconds.
    The exit code is known only if the process happens to be our child (tests), else None.
    """

    adopted = True

    def __init__(self, identity: ProcessIdentity, pidfd: int | None) -> None:
        self.identity = identity
        self._pidfd = pidfd
        self._lock = trio.Lock()  # only one task may wait_readable on the pidfd
        self._exited = False
        self._returncode: int | None = None

    async def wait(self) -> int | None:
        """Waits for exit; returns the code if it was our child, else None. Cancellable."""
        async with self._lock:
            if not self._exited:
                if self._pidfd is not None:
                    await trio.lowlevel.wait_readable(self._pidfd)
                else:
                    while self._alive():
                        await trio.sleep(ADOPTED_POLL_INTERVAL)
                self._exited = True
                self._returncode = self._reap()
        return self._returncode

    def poll(self) -> int | None | bool:
        """Returns the exit code (None if unknown) once exited, False while running."""
        if self._exited:
            return self._returncode
        if self._alive():
            return False
        self._exited = True
        self._returncode = self._reap()
        return self._returncode

    def _alive(self) -> bool:
        """Same pid and create time (not cmdline: engines may retitle themselves) and not a zombie."""
        current = identity_of(self.identity.pid)
        return current is not None and abs(current.create_time - self.identity.create_time) <= _CREATE_TIME_TOLERANCE

    def _reap(self) -> int | None:
        """Reaps the process if it is our child and returns its code; None otherwise."""
        try:
            pid, status = os.waitpid(self.identity.pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        return os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        """Closes the pidfd (waking any waiter with ClosedResourceError)."""
        if self._pidfd is not None:
            fd, self._pidfd = self._pidfd, None
            trio.lowlevel.notify_closing(fd)
            os.close(fd)


def adopt(identity: ProcessIdentity) -> AdoptedProcess | None:
    """Returns a handle on the process ``identity`` names, or None if that process is gone.

    None also when the pid now belongs to another process (different create time or
    command line). The pidfd is opened before the identity is checked, so it cannot end
    up pointing at a process that took over the pid in between.
    """
    pidfd: int | None = None
    try:
        pidfd = os.pidfd_open(identity.pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError) as exc:  # no pidfd support: fall back to polling
        logger.debug("pidfd_open(%d) unavailable (%s); polling instead", identity.pid, exc)
    if not matches(identity):
        if pidfd is not None:
            os.close(pidfd)
        return None
    return AdoptedProcess(identity, pidfd)


async def spawn(
    argv: Sequence[str], *, env: Mapping[str, str], log_path: Path, cwd: Path | None = None,
    user: EngineUser | None = None,
) -> SpawnedProcess:
    """Starts ``argv`` in a new session with output appended to ``log_path``; returns its handle.

    stdin is /dev/null and stdout+stderr go to the log file, whose descriptor the agent
    closes right after the spawn: the engine holds nothing that ties it to the agent.
    With ``user`` the process runs as that user, its groups exactly ``user.groups`` (the
    switch happens in the child before exec; None: as the agent). Raises OSError if the
    program cannot be started (missing executable, bad cwd, a user it cannot switch to).
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        proc = await trio.lowlevel.open_process(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(env),
            cwd=cwd,
            **popen_identity(user),
        )
    finally:
        os.close(fd)
    identity = await _identity_after_exec(proc.pid)
    if identity is None:  # exited already; keep what we know so the watcher sees the exit
        identity = ProcessIdentity(pid=proc.pid, create_time=0.0, cmdline=tuple(argv))
    return SpawnedProcess(proc, identity)


async def _identity_after_exec(pid: int) -> ProcessIdentity | None:
    """Returns the identity of the just-spawned ``pid`` once its command line is readable.

    None if the process is gone already. A process whose command line stays empty for
    :data:`EXEC_SETTLE_WAIT` seconds (it cleared its own arguments) is returned as read.
    """
    identity = identity_of(pid)
    with trio.move_on_after(EXEC_SETTLE_WAIT):
        while identity is not None and not identity.cmdline:
            await trio.sleep(EXEC_SETTLE_POLL)
            identity = identity_of(pid)
    return identity


async def terminate(process: EngineProcess, grace: float) -> int | None:
    """Stops ``process`` and its whole process group; returns its exit code (None if unknown).

    SIGTERM to the group, up to ``grace`` seconds for the engine to exit, then SIGKILL
    to the group -- sent even if the engine exited in time, so a child it left behind
    dies too. Raises trio.TooSlowError if the process survives SIGKILL for
    :data:`KILL_WAIT` seconds (stuck in the kernel). Cancellation stops the waiting,
    not the signals already sent.
    """
    pgid = process.identity.pid
    if process.poll() is False:
        signal_group(pgid, signal.SIGTERM)
        with trio.move_on_after(grace):
            await process.wait()
    signal_group(pgid, signal.SIGKILL)
    with trio.fail_after(KILL_WAIT):
        return await process.wait()


class OutputTail:
    """Follows an engine's log file and keeps its last :data:`OUTPUT_LINES` lines.

    ``on_line`` (optional) is called with every new line as it is read; exceptions
    from it are logged and otherwise ignored. Lines are decoded as UTF-8 with
    replacement characters, stripped of their newline, and cut at MAX_LINE_CHARS.
    """

    def __init__(self, path: Path, *, on_line: Callable[[str], None] | None = None, maxlen: int = OUTPUT_LINES):
        self.path = path
        self.on_line = on_line
        self.lines: collections.deque[str] = collections.deque(maxlen=maxlen)
        #: Lines ever added (the cursor ``llmgw ctl logs -f`` follows with: llmgw/logbook.py).
        self.total = 0
        self._offset = 0
        self._partial = b""
        self._run_lines = 0  # lines read since mark_run_start()

    def load_existing(self) -> None:
        """Fills the buffer from the end of the file and continues from its current end.

        Used on adoption: the engine's recent output survives the agent's restart.
        A missing file means no output yet. Does not call ``on_line``.
        """
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                start = max(0, size - OUTPUT_TAIL_BYTES)
                f.seek(start)
                data = f.read(size - start)
        except FileNotFoundError:
            self._offset = 0
            return
        except OSError as exc:
            logger.warning("cannot read the engine log %s (%s); its earlier output is not shown", self.path, exc)
            self.skip_to_end()
            return
        chunks = data.split(b"\n")
        if start > 0:
            chunks = chunks[1:]  # the first piece is probably the end of a longer line
        self._partial = chunks.pop()  # b"" if the file ends with a newline
        for raw in chunks:
            self.lines.append(self._decode(raw))
        self.total += len(chunks)
        self._offset = size
        self._run_lines = len(self.lines)  # an adopted run's output so far counts as this run's

    def skip_to_end(self) -> None:
        """Continues from the file's current end (before spawning a new run)."""
        try:
            self._offset = self.path.stat().st_size
        except OSError:
            self._offset = 0
        self._partial = b""

    def mark_run_start(self) -> None:
        """Starts counting lines for :meth:`run_output` (call when an engine run starts)."""
        self._run_lines = 0

    def run_output(self, n: int) -> tuple[str, ...]:
        """Returns up to ``n`` last lines printed since :meth:`mark_run_start`."""
        n = min(n, self._run_lines, len(self.lines))
        return tuple(list(self.lines)[len(self.lines) - n :]) if n > 0 else ()

    def last(self, n: int) -> list[str]:
        """Returns up to ``n`` of the last lines, oldest first."""
        if n <= 0:
            return []
        return list(self.lines)[-n:]

    def read_new(self, *, final: bool = False) -> int:
        """Reads what was appended since the last call; returns the number of new lines.

        ``final``: the writer is gone, so a last line without newline is kept too.
        If the file shrank (rotated or truncated) reading restarts at its beginning.
        """
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                if size < self._offset:
                    self._offset, self._partial = 0, b""
                if size == self._offset and not (final and self._partial):
                    return 0
                f.seek(self._offset)
                data = f.read(size - self._offset)
        except FileNotFoundError:
            return 0
        self._offset += len(data)
        chunks = (self._partial + data).split(b"\n")
        self._partial = chunks.pop()
        if final and self._partial:
            chunks.append(self._partial)
            self._partial = b""
        for raw in chunks:
            line = self._decode(raw)
            self.lines.append(line)
            self.total += 1
            self._run_lines += 1
            if self.on_line is not None:
                try:
                    self.on_line(line)
                except Exception:
                    logger.exception("output line callback failed for %s", self.path)
        return len(chunks)

    async def follow(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reads new lines every :data:`OUTPUT_POLL_INTERVAL` seconds until cancelled.

        A log file that cannot be read is logged once and retried; it never ends the task.
        """
        task_status.started()
        complained = False
        while True:
            try:
                self.read_new()
            except OSError as exc:  # e.g. permissions changed under us: keep the engine, lose its output
                if not complained:
                    logger.warning("cannot read the engine log %s: %s", self.path, exc)
                    complained = True
            await trio.sleep(OUTPUT_POLL_INTERVAL)

    @staticmethod
    def _decode(raw: bytes) -> str:
        line = raw.decode("utf-8", errors="replace").rstrip("\r")
        return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + " [...]"
