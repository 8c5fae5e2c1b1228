"""Upgrading the llmgw a machine runs (an agent, a control plane): releases side by side, a
``current`` link, rollback.

A machine upgradeable over the cluster runs llmgw from a *release root*::

    ROOT/releases/0.1.0/      a virtual environment holding llmgw 0.1.0
    ROOT/releases/0.2.0/      the next one, installed beside it
    ROOT/current -> releases/0.2.0     what the units run (ROOT/current/bin/python -m llmgw ...)
    ROOT/previous -> releases/0.1.0    what a rollback puts back

(docs/operations.md, "Upgrading", says how to lay a machine out this way; the units the joins
write on such a machine start ``ROOT/current/bin/python -m llmgw``.) The leader sends a release
wheel in pieces (:class:`llmgw.releasefiles.ReleaseInbox`) to each standby through its feed and
to each agent over its session, then asks it to install it (:func:`install_here`): the wheel is
checked against its SHA-256, the running environment is copied to the new release's directory
(its dependencies come along, so nothing is downloaded that the release does not add), the
wheel is installed into the copy with the copy's pip, the copy's ``llmgw --version`` must name
the wheel's version, and only then ``current`` is switched (a new link renamed over the old
one: atomic). The process answers, then exits with :data:`UPGRADE_EXIT_STATUS`, which its unit
restarts on (``RestartForceExitStatus=75``); an agent's engines keep running and the new agent
adopts them. :func:`rollback_release` switches ``current`` back to ``previous`` the same way.
Until a new agent has joined a control plane, its upgrade is *pending* (:func:`mark_pending`):
one that has not joined by the deadline (the run's ``--timeout``) switches back to
``previous`` by itself and exits 75 again, so a release that installs and starts but cannot
serve does not strand the node.

Every blocking step runs in a worker thread; errors are :class:`ReleaseError` with the
reason in words, and leave ``current`` as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from llmgw import __version__
from llmgw.files import atomic_write, read_json_mapping
from llmgw.releasefiles import ReleaseError, ReleaseInbox, sha256_file, wheel_version

#: The exit status that tells the agent's supervisor (systemd: ``RestartForceExitStatus=75``,
#: EX_TEMPFAIL) to start it again: from ``current``, now the new release.
UPGRADE_EXIT_STATUS = 75
#: Seconds pip may take to install a release into the copied environment (new dependencies
#: are downloaded from the node's package index).
INSTALL_TIMEOUT_S = 900.0
#: Seconds the new release's ``llmgw --version`` may take (imports the package).
VERSION_CHECK_TIMEOUT_S = 60.0
CURRENT, PREVIOUS, RELEASES = "current", "previous", "releases"
#: The upgrade not yet confirmed, in the release root: {"from", "to", "deadline"} (Unix time).
PENDING_FILE = "upgrade-pending.json"


def find_root(prefix: str = sys.prefix) -> Path | None:
    """Return the release root this process runs from (``ROOT`` when ``prefix``, links
    resolved, is ``ROOT/releases/V`` and ``ROOT/current`` points at it), else None."""
    try:
        release = Path(prefix).resolve()
        root = release.parent.parent
        if release.parent.name == RELEASES and (root / CURRENT).resolve() == release:
            return root
    except OSError:
        return None
    return None


def current_release(root: Path) -> str:
    """Return the name of the release ``root/current`` points at; raises ReleaseError if none."""
    try:
        return os.readlink(root / CURRENT).rstrip("/").rsplit("/", 1)[-1]
    except OSError as exc:
        raise ReleaseError(f"{root / CURRENT} is not a link to a release: {exc.strerror}") from None


def _run(argv: list[str], timeout: float, what: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ReleaseError(f"{what} took over {timeout:.0f} s") from None
    except OSError as exc:
        raise ReleaseError(f"{what} could not run: {exc}") from None
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
        raise ReleaseError(f"{what} failed (exit {done.returncode}):\n  " + "\n  ".join(tail))
    return done.stdout


def _switch(root: Path, link: str, target: str) -> None:
    """Point ``root/link`` at ``releases/target`` by renaming a new link over it (atomic)."""
    tmp = root / f".{link}.new"
    tmp.unlink(missing_ok=True)
    os.symlink(f"{RELEASES}/{target}", tmp)
    os.replace(tmp, root / link)


def install_release(root: Path, wheel: Path, sha256: str) -> tuple[str, str]:
    """Install ``wheel`` as a new release under ``root`` and make it current (see the module
    docstring); return (new release, previous release). Blocking: run it in a thread.

    Raises ReleaseError, ``current`` unchanged, when the wheel's SHA-256 is not ``sha256``,
    the version already runs, the copy or pip fails, or the new ``llmgw --version`` does
    not name the version.
    """
    version = wheel_version(wheel.name)
    got = sha256_file(wheel)
    if got != sha256.lower():
        raise ReleaseError(f"{wheel.name}: SHA-256 {got}, expected {sha256}: the release was damaged on the way")
    running = current_release(root)
    if running == version:
        raise ReleaseError(f"this node already runs llmgw {version}")
    target = root / RELEASES / version
    if target.exists():
        shutil.rmtree(target)  # a release left half-installed by an earlier attempt
    try:
        shutil.copytree((root / CURRENT).resolve(), target, symlinks=True)
        python = str(target / "bin" / "python")
        _run([python, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "--quiet", str(wheel)],
             INSTALL_TIMEOUT_S, f"pip install {wheel.name}")
        said = _run([str(target / "bin" / "llmgw"), "--version"], VERSION_CHECK_TIMEOUT_S, "the new llmgw --version")
        if version not in said.split():
            raise ReleaseError(f"the new release's llmgw --version says {said.strip()!r}, not {version}")
    except (ReleaseError, OSError) as exc:
        shutil.rmtree(target, ignore_errors=True)
        if isinstance(exc, ReleaseError):
            raise
        raise ReleaseError(f"cannot copy the running environment to {target}: {exc}") from None
    _switch(root, PREVIOUS, running)
    _switch(root, CURRENT, version)
    return version, running


def lay_out(root: Path, prefix: str = sys.prefix) -> Path:
    """Make ``root`` a release root holding this environment (``prefix``) as release
    ``__version__``: a copy at ``root/releases/VERSION`` and ``root/current`` pointing at it;
    return the release's directory. Blocking. Where ``current`` points at that release
    already, nothing is copied (running it twice is safe). Raises ReleaseError when ``current``
    points at another release, OSError when the copy fails (the partial copy is removed)."""
    release = root / RELEASES / __version__
    if (root / CURRENT).is_symlink():
        running = current_release(root)
        if running != __version__:
            raise ReleaseError(f"{root / CURRENT} points at release {running}, not {__version__}: this machine is "
                               "laid out already (upgrade it with `llmgw ctl upgrade`)")
        return release
    if not release.exists():
        try:
            shutil.copytree(Path(prefix).resolve(), release, symlinks=True)
        except OSError:
            shutil.rmtree(release, ignore_errors=True)
            raise
    _switch(root, CURRENT, __version__)
    return release


def release_root() -> Path:
    """Return the release root this process runs from; raises ReleaseError saying how to get one."""
    root = find_root()
    if root is None:
        raise ReleaseError(f"this llmgw runs from {sys.prefix}, not from a release root (ROOT/releases/VERSION with "
                           "ROOT/current pointing at it): reinstall it that way to upgrade it over the cluster "
                           "(docs/operations.md, Upgrading)")
    return root


async def install_here(root: Path, inbox: ReleaseInbox, name: str, sha256: str) -> tuple[str, str]:
    """Install the received wheel ``name`` (checked against ``sha256``) under ``root``, this
    process's release root (:func:`release_root`), and make it current; return (new release,
    previous release). The wheel is removed once installed.

    Where ``current`` already points at that release but this process runs another (a
    control plane upgraded the machine's root first: one root per machine), nothing is
    installed again: the caller only restarts. Raises ReleaseError as :func:`install_release` does.
    """
    version = wheel_version(name)
    running = current_release(root)
    if running == version and __version__ != version and (root / RELEASES / version).is_dir():
        return version, __version__
    wheel = inbox.path(name)
    if not wheel.is_file():
        raise ReleaseError(f"{name} was not received (send it with receiveRelease first)")
    result = await trio.to_thread.run_sync(install_release, root, wheel, sha256)
    wheel.unlink(missing_ok=True)
    return result


def mark_pending(root: Path, previous: str, release: str, deadline: float) -> None:
    """Record that ``release`` must join a control plane by ``deadline`` (Unix time), or the
    node goes back to ``previous`` by itself (:class:`~llmgw.node.agent.Agent` watches it)."""
    data = {"from": previous, "to": release, "deadline": deadline}
    atomic_write(root / PENDING_FILE, (json.dumps(data) + "\n").encode())


def read_pending(root: Path) -> dict[str, Any] | None:
    """Return the pending upgrade of ``root`` (None: none, or an unreadable marker, removed)."""
    path = root / PENDING_FILE
    try:
        data = read_json_mapping(path)
    except (OSError, ValueError):
        data = {}
    if data is not None and not {"from", "to", "deadline"} <= set(data):
        path.unlink(missing_ok=True)
        return None
    return data


def clear_pending(root: Path) -> None:
    """Forget the pending upgrade of ``root`` (it joined, or was rolled back)."""
    (root / PENDING_FILE).unlink(missing_ok=True)


def rollback_release(root: Path) -> tuple[str, str]:
    """Make ``previous`` current again (and the current one previous); return (now current,
    now previous). Raises ReleaseError when there is no previous release to go back to."""
    running = current_release(root)
    try:
        before = os.readlink(root / PREVIOUS).rstrip("/").rsplit("/", 1)[-1]
    except OSError:
        raise ReleaseError(f"no previous release under {root} to roll back to") from None
    if not (root / RELEASES / before).is_dir():
        raise ReleaseError(f"the previous release {before} is gone from {root / RELEASES}")
    _switch(root, PREVIOUS, running)
    _switch(root, CURRENT, before)
    return before, running
