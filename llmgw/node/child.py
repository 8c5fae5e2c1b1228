"""A child process that reports in lines on stdout, run in a process group of its own.

What the agent runs to completion as the engines' user and listens to while it runs: the
LoRA trainer (:mod:`llmgw.node.training.run`) and engine installs and checks
(:mod:`llmgw.node.install.as_user`). Unlike an engine (:func:`llmgw.node.process.spawn`,
detached so it outlives the agent) such a child is tied to the agent through its pipes:
one whose agent died stops at its next line instead of working for nobody.

:func:`run_reporting_child` starts it, hands each stdout line to a callback as it arrives,
keeps the last lines of its stderr, and stops its whole process group on the way out: on
cancellation (SIGTERM, SIGKILL after a grace) and also after a normal exit (SIGKILL to
whatever it left behind).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
from pathlib import Path
from typing import Callable, Mapping, Sequence

import attrs
import trio

from llmgw.node.engine_user import EngineUser, popen_identity
from llmgw.node.process import KILL_WAIT, signal_group
from llmgw.trioutil import unwrap_single_group

__all__ = ["ChildExit", "GROUP_POLL", "MAX_LINE", "group_alive", "read_lines", "run_reporting_child", "stop_group"]

#: How often the group is checked for survivors after SIGKILL (its leader is reaped by trio;
#: the others are not our children).
GROUP_POLL = 0.05
#: A stdout line longer than this is cut there, the rest of it dropped: a report is a few
#: hundred bytes, so a longer line is output that is not one.
MAX_LINE = 64 * 1024


@attrs.frozen
class ChildExit:
    """How a reporting child ended: its exit ``code`` (negative: the signal that ended it) and
    the last lines of its stderr."""

    code: int | None
    stderr: tuple[str, ...]


async def read_lines(stream: trio.abc.ReceiveStream, on_line: Callable[[bytes], None]) -> None:
    """Calls ``on_line`` with each line of ``stream`` (without its newline) until EOF; a line
    over :data:`MAX_LINE` is cut there, the rest of it dropped."""
    buf = b""
    dropping = False
    async for chunk in stream:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            if dropping:
                dropping = False
                continue
            on_line(raw)
        if len(buf) > MAX_LINE:
            if not dropping:
                on_line(buf[:MAX_LINE])
            buf, dropping = b"", True
    if buf and not dropping:
        on_line(buf)


def group_alive(pgid: int) -> bool:
    """Returns whether any process of group ``pgid`` still exists (zombies count until reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal is still a member
        return True
    return True


async def stop_group(proc: trio.Process, grace: float) -> None:
    """Stops the process group led by ``proc`` and waits until none of it runs.

    SIGTERM to the group while the leader runs, up to ``grace`` seconds for it to exit,
    then SIGKILL to the group (also when the leader exited in time: a child it left
    behind dies too); waits for the leader (our child: reaped) and polls for the other
    members for up to :data:`~llmgw.node.process.KILL_WAIT` seconds. Shielded: runs to the
    end even in a cancelled scope.
    """
    pgid = proc.pid
    with trio.CancelScope(shield=True):
        if proc.returncode is None:
            signal_group(pgid, signal.SIGTERM)
            with trio.move_on_after(grace):
                await proc.wait()
        signal_group(pgid, signal.SIGKILL)
        with trio.move_on_after(KILL_WAIT):
            await proc.wait()
            while group_alive(pgid):
                await trio.sleep(GROUP_POLL)


async def run_reporting_child(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    on_stdout: Callable[[bytes], None],
    stop_grace: float,
    user: EngineUser | None = None,
    stderr_lines: int = 40,
    on_start: Callable[[int], None] = lambda pid: None,
) -> ChildExit:
    """Runs ``argv`` in a new session (as ``user``: its uid, gid and exactly its groups; None:
    as the agent) with ``env`` in ``cwd`` and stdin /dev/null, and returns how it ended once
    its stdout closed and it exited.

    ``on_stdout`` gets each stdout line as it arrives (:func:`read_lines`); it must be cheap,
    and an exception from it stops the child (as a cancellation does) and propagates as
    itself. ``on_start`` gets the child's pid (its process group) as soon as it runs. The
    last ``stderr_lines`` lines of stderr come back in :class:`ChildExit`.

    Raises OSError when the child cannot be started. Cancellation stops the whole group
    (:func:`stop_group`: SIGTERM, SIGKILL after ``stop_grace`` seconds), waits for it, then
    propagates; after a normal exit the group is killed too, so nothing of it outlives the call.
    """
    proc = await trio.lowlevel.open_process(
        list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, env=dict(env), cwd=cwd, **popen_identity(user),
    )
    on_start(proc.pid)
    tail: collections.deque[str] = collections.deque(maxlen=stderr_lines)

    def on_stderr(raw: bytes) -> None:
        tail.append(raw.decode("utf-8", errors="replace").rstrip("\r"))

    try:
        assert proc.stdout is not None and proc.stderr is not None
        with unwrap_single_group():  # on_stdout's own exception reaches the caller as itself
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_lines, proc.stderr, on_stderr)
                await read_lines(proc.stdout, on_stdout)
                await proc.wait()
                # Anything the child left running holds its stderr open: the reader would wait for it.
                signal_group(proc.pid, signal.SIGKILL)
        return ChildExit(proc.returncode, tuple(tail))
    finally:
        with trio.CancelScope(shield=True):
            await stop_group(proc, stop_grace)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    await pipe.aclose()
