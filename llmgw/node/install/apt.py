"""apt-get for engine installers, waiting out a held dpkg/apt lock.

On a fresh machine, unattended-upgrades or cloud-init often holds the apt lock for
minutes. :func:`apt_get` runs ``apt-get`` non-interactively; when it fails only because
the lock is held, it says so through ``progress`` and the log, and tries again until
:data:`APT_LOCK_WAIT` has passed, then fails naming the process that holds the lock.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from typing import Sequence

import trio

from llmgw.node.install import InstallError, Progress

__all__ = ["APT_LOCK_WAIT", "apt_get", "apt_install"]

log = logging.getLogger(__name__)

#: How long a held lock is waited for before the install fails: long enough for
#: unattended-upgrades' usual run on boot, short enough that a stuck dpkg is reported.
APT_LOCK_WAIT = 10 * 60.0
#: Pause between attempts while the lock is held.
APT_LOCK_POLL = 5.0
#: One apt-get run (download and unpack of a few packages) may take this long.
APT_RUN_TIMEOUT = 30 * 60.0

_LOCK_HELD = re.compile(r"Could not get lock|Unable to acquire the dpkg frontend lock|Unable to lock")
_HOLDER = re.compile(r"held by process (\d+)(?: \(([^)]*)\))?")


def _lock_holder(output: str) -> str | None:
    """Returns who holds the lock ("process 1234 (unattended-upgr)"), "another process", or None if not a lock error."""
    if not _LOCK_HELD.search(output):
        return None
    match = _HOLDER.search(output)
    if not match:
        return "another process"
    return f"process {match.group(1)}" + (f" ({match.group(2)})" if match.group(2) else "")


async def apt_get(
    args: Sequence[str],
    progress: Progress,
    *,
    apt_get_command: str = "apt-get",
    lock_wait: float = APT_LOCK_WAIT,
    poll: float = APT_LOCK_POLL,
) -> str:
    """Runs ``apt-get ARGS`` (non-interactive) and returns its output.

    While apt's lock is held by another process, reports "waiting for the apt lock (held
    by process N (name)), up to 10 minutes" and retries every ``poll`` seconds for up to
    ``lock_wait`` seconds. Raises :class:`InstallError` with apt's last error line when
    apt-get fails otherwise, or naming the holder when the lock stays held. Cancellation
    kills apt-get (trio.run_process does).
    """
    command = [apt_get_command, *args]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    deadline = trio.current_time() + lock_wait
    waited = False
    while True:
        with trio.fail_after(APT_RUN_TIMEOUT):
            result = await trio.run_process(
                command, capture_stdout=True, stderr=subprocess.STDOUT, check=False, env=env
            )
        output = result.stdout.decode(errors="replace")
        if result.returncode == 0:
            if waited:
                log.info("apt: the lock was released; %s done", " ".join(args[:1]))
            return output
        holder = _lock_holder(output)
        if holder is None:
            errors = [line for line in output.splitlines() if line.startswith("E:")] or output.splitlines()[-1:]
            raise InstallError(
                f"apt-get {' '.join(args)} failed (exit {result.returncode}): "
                f"{errors[-1] if errors else 'no output'}; fix the node's package sources or install it by hand"
            )
        if trio.current_time() >= deadline:
            raise InstallError(
                f"apt's lock stayed held by {holder} for {lock_wait / 60:.0f} minutes; "
                "wait for it to finish (or stop it) and the install is retried"
            )
        message = f"waiting for the apt lock (held by {holder}), up to {lock_wait / 60:.0f} minutes"
        if not waited:
            log.warning("apt: %s", message)
        waited = True
        progress(message)
        await trio.sleep(poll)


async def apt_install(packages: Sequence[str], progress: Progress, **kwargs: object) -> None:
    """Installs ``packages`` with ``apt-get install -y --no-install-recommends``; see :func:`apt_get`.

    Reports "apt-get install PKGS" before it starts. Raises :class:`InstallError` on failure.
    """
    progress(f"apt-get install {' '.join(packages)}")
    await apt_get(["install", "-y", "--no-install-recommends", *packages], progress, **kwargs)  # type: ignore[arg-type]
