"""One agent per state directory: an exclusive lock held for the supervisor's lifetime.

Two agents on one state directory (a stop that missed a process, a second unit with the
same path) would both adopt and start the same shards: twice the engines, each agent
restarting the other's. :func:`lock_state_dir` takes ``flock(LOCK_EX | LOCK_NB)`` on
``<state_dir>/agent.lock`` and writes the holder's pid into it, so the second agent is
refused at once with the first one's pid in the message.

The lock belongs to the open file description: it is released when
:meth:`StateDirLock.release` closes it or when the process dies in any way (kill -9
included), so a crashed agent never leaves a stale lock behind. The descriptor is
close-on-exec: engines started by the agent never inherit (and keep) the lock.
All functions here block on the file system: call them through ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["LOCK_FILE", "StateDirLock", "StateDirLocked", "lock_state_dir"]

LOCK_FILE = "agent.lock"


class StateDirLocked(RuntimeError):
    """Another live process holds the state directory's lock (its pid is in the message)."""

    def __init__(self, state_dir: Path, holder: int | None) -> None:
        who = f"process {holder}" if holder else "another process"
        super().__init__(
            f"the agent state directory {state_dir} is in use by {who} (another agent?): "
            "stop that agent first, or give this one its own state_dir"
        )
        self.state_dir = state_dir
        self.holder = holder


class StateDirLock:
    """A held lock on a state directory; :meth:`release` gives it up."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Closes the lock file, which releases the lock. Idempotent. The file stays."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _holder(fd: int) -> int | None:
    """Returns the pid written in the lock file, or None if it holds none (yet)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def lock_state_dir(state_dir: Path) -> StateDirLock:
    """Takes the exclusive lock on ``state_dir`` (created if missing, 0700) and returns it.

    The lock file then holds this process's pid. Raises :class:`StateDirLocked` naming
    the holder's pid if another process (or another open of the file in this one) holds
    it; OSError if the directory or file cannot be created.
    """
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise StateDirLocked(state_dir, holder) from None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # a full disk must not stop the agent: the lock itself holds, only the pid is not shown
    return StateDirLock(path, fd)
