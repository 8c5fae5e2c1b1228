"""Artifacts: files fetched over HTTP, checked, unpacked, and guarded by a lock between fetchers.

What the llama.cpp installer (release archives, the sdist), the Python environment installer
(its lock files) and weights fetch (:mod:`llmgw.node.fetch`) share:

- :func:`download` fetches one URL to a file through ``NAME.partial``: a partial file is
  resumed with an HTTP ``Range`` request when the result can be checked (size or sha256
  known), the size and sha256 are checked before the file gets its final name, and a
  mismatch deletes it. Connecting and every read have a deadline, so a stalled transfer
  fails instead of hanging. Cancellation leaves at most the ``.partial`` file.
- :class:`Meter` turns byte counts into throttled progress sentences.
- :func:`sha256_file` hashes a file; :func:`safe_extract` unpacks an archive, refusing
  any member that would land outside the destination, any link pointing out of it and
  any device file or FIFO before anything is written.
- :func:`exclusive` (async) and :func:`exclusive_blocking` (threads) hold an exclusive
  lock file (:func:`lock_file_for` names the one beside a target), so two agents (or two
  tasks) never fetch or install into the same place at once: the second waits, then
  finds the first one's result.

Every failure raises :class:`ArtifactError` with a sentence for the operator; callers
re-raise it as their own error type (``InstallError``, ``FetchError``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import tarfile
import zipfile
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path, PurePosixPath
from typing import IO, Any, AsyncIterator, Callable, Iterator, Mapping

import httpx
import trio

__all__ = [
    "ArtifactError",
    "CONNECT_TIMEOUT",
    "Meter",
    "PARTIAL_SUFFIX",
    "READ_TIMEOUT",
    "download",
    "exclusive",
    "exclusive_blocking",
    "fraction_text",
    "hash_into",
    "human_size",
    "lock_file_for",
    "new_client",
    "safe_extract",
    "sha256_file",
]

# -- tunables ---------------------------------------------------------------------------
#: Connecting to a release server, an index or a hub: one that does not answer in this time is down.
CONNECT_TIMEOUT = 15.0
#: Between two chunks of a transfer: a stalled transfer fails (and resumes from its
#: ``.partial`` on the next try) instead of hanging an install or a shard start.
READ_TIMEOUT = 60.0
#: Bytes read per call when hashing a file: large enough that per-call overhead is
#: negligible, small enough to keep memory flat.
CHUNK_SIZE = 1024 * 1024
#: At most one progress sentence per this many seconds (plus forced ones at start and end):
#: a multi-GB fetch must not flood the control plane with status reports.
PROGRESS_INTERVAL = 2.0
#: How often a fetcher waiting for another one's lock checks whether it is free.
LOCK_POLL = 0.5
#: Suffix of a file being downloaded; it gets its final name only once checked.
PARTIAL_SUFFIX = ".partial"

Say = Callable[[str], None]
#: Turns (bytes done, total or None when unknown) into a progress sentence.
Describe = Callable[[int, "int | None"], str]


class ArtifactError(Exception):
    """A download, check or unpack failed; ``str()`` says what failed and what the operator can do."""


# -- progress -----------------------------------------------------------------------------

_UNITS = (("GB", 1000**3), ("MB", 1000**2), ("kB", 1000), ("B", 1))


def human_size(n: int) -> str:
    """Returns ``n`` bytes as "4.0 GB"/"16 MB"-style text."""
    for unit, size in _UNITS:
        if n >= size or unit == "B":
            value = n / size
            return f"{value:.1f} {unit}" if unit == "GB" else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def fraction_text(done: int, total: int | None) -> str:
    """Returns "1.2/4.0 GB" (both figures in the unit that suits ``total``), or
    :func:`human_size` of ``done`` when the total is unknown."""
    if total is None:
        return human_size(done)
    for unit, size in _UNITS:
        if total >= size or unit == "B":
            return f"{done / size:.1f}/{total / size:.1f} {unit}"
    raise AssertionError("unreachable")


class Meter:
    """Counts the bytes of one or more downloads and tells ``say`` about them.

    ``describe(done, total)`` makes the sentence (default :func:`fraction_text`); ``total``
    is None while unknown. With ``learn_total`` (one file of unknown size), the total is
    taken from the first response's length. Sentences go out at most every
    :data:`PROGRESS_INTERVAL` seconds, except forced ones. ``say`` must be cheap and never raise.
    """

    def __init__(
        self,
        say: Say,
        describe: Describe = fraction_text,
        *,
        done: int = 0,
        total: int | None = None,
        learn_total: bool = False,
    ) -> None:
        self.say = say
        self.describe = describe
        self.done = done
        self.total = total
        self.learn_total = learn_total
        self._last = -PROGRESS_INTERVAL

    def learn(self, total: int) -> None:
        """Sets the total (once, with ``learn_total``) and reports it at once."""
        if self.learn_total and self.total is None:
            self.total = total
            self.report(force=True)

    def add(self, n: int) -> None:
        """Counts ``n`` more bytes (negative: a transfer started over) and reports if due."""
        self.done += n
        self.report()

    def report(self, force: bool = False) -> None:
        """Tells ``say`` the current figures, unless one went out less than the interval ago."""
        now = trio.current_time()
        if not force and now - self._last < PROGRESS_INTERVAL:
            return
        self._last = now
        self.say(self.describe(self.done, self.total))


# -- hashing --------------------------------------------------------------------------------


def hash_into(path: Path, hasher: Any) -> Any:
    """Feeds the bytes of ``path`` to ``hasher`` (a hashlib object) and returns it.

    Blocking: call in a thread for large files. Raises OSError if ``path`` cannot be read.
    """
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_SIZE):
            hasher.update(chunk)
    return hasher


def sha256_file(path: Path) -> str:
    """Returns the hex sha256 of ``path`` (blocking: call in a thread for large files)."""
    return str(hash_into(path, hashlib.sha256()).hexdigest())


# -- downloading ------------------------------------------------------------------------------


def new_client(headers: Mapping[str, str] | None = None) -> httpx.AsyncClient:
    """Returns an HTTP client with the connect and read deadlines above, following redirects.

    The caller closes it (``async with`` or ``aclose``).
    """
    timeout = httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT)
    return httpx.AsyncClient(headers=dict(headers or {}), timeout=timeout, follow_redirects=True)


async def download(
    client: httpx.AsyncClient,
    url: str,
    dest: Path,
    meter: Meter,
    *,
    size: int | None = None,
    sha256: str = "",
    origin: str = "the source",
    label: str = "",
) -> Path:
    """Downloads ``url`` to ``dest`` through ``dest.partial``; returns ``dest``.

    A partial file from an earlier try is resumed (``Range``) when ``size`` or ``sha256``
    can check the result, else started over. ``dest`` gets its name only once the size
    and sha256 (each when given) match. ``label`` names the file in messages (default:
    its name), ``origin`` says who published the sha256. ``meter`` counts the bytes.

    Raises :class:`ArtifactError` for an HTTP error status, a network failure or a stall
    (the partial file is kept for the next try when it can be resumed), a size or sha256
    mismatch (the partial file is deleted). Cancellation propagates and leaves at most
    the partial file.
    """
    label = label or dest.name
    partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
    await trio.Path(dest.parent).mkdir(parents=True, exist_ok=True)
    checkable = size is not None or bool(sha256)
    offset = partial.stat().st_size if checkable and partial.exists() else 0
    if size is not None and offset > size:
        offset = 0
    hasher = hashlib.sha256()
    if offset:
        await trio.to_thread.run_sync(hash_into, partial, hasher)
        meter.add(offset)
    if size is None or offset < size:
        offset, hasher = await _transfer(client, url, partial, offset, hasher, meter, resumable=checkable)
    if size is not None and offset != size:
        await trio.Path(partial).unlink(missing_ok=True)
        raise ArtifactError(
            f"{label}: received {offset} bytes but {origin} says {size}; "
            "the partial file was deleted, the next try starts it again"
        )
    actual = hasher.hexdigest()
    if sha256 and actual != sha256.lower():
        await trio.Path(partial).unlink(missing_ok=True)
        raise ArtifactError(
            f"{label} has sha256 {actual}, but {origin} says {sha256.lower()}; the download does not match and "
            "was deleted (corrupt in transit, or changed or tampered with at the source)"
        )
    await trio.Path(partial).rename(dest)
    return dest


async def _transfer(
    client: httpx.AsyncClient,
    url: str,
    partial: Path,
    offset: int,
    hasher: Any,
    meter: Meter,
    *,
    resumable: bool,
) -> tuple[int, Any]:
    """Appends the bytes of ``url`` from ``offset`` on to ``partial``; returns its new length
    and the hasher (a fresh one when the server ignored the range and the file started over)."""
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    try:
        async with client.stream("GET", url, headers=headers) as response:
            if response.status_code == 416 and offset:
                return offset, hasher  # nothing beyond what we have; the size check decides
            if response.status_code not in (200, 206):
                raise ArtifactError(f"{url} answered HTTP {response.status_code}; check the URL or its mirror")
            if offset and response.status_code == 200:
                # The server ignored the range: start over rather than append a second copy.
                meter.add(-offset)
                offset, hasher = 0, hashlib.sha256()
            length = response.headers.get("content-length", "")
            if length.isdigit():
                meter.learn(offset + int(length))
            # Appending only to what was hashed; anything else there is stale and overwritten.
            async with await trio.open_file(partial, "ab" if offset else "wb") as out:
                async for chunk in response.aiter_bytes():
                    await out.write(chunk)
                    hasher.update(chunk)
                    offset += len(chunk)
                    meter.add(len(chunk))
    except httpx.HTTPError as exc:
        what = f"{type(exc).__name__}: {exc}".rstrip(": ")
        if resumable and offset:
            then = f"broke off after {human_size(offset)}; the next try resumes from there"
        else:
            then = "the next try starts again"
        raise ArtifactError(f"cannot download {url} ({what}); {then}") from exc
    return offset, hasher


# -- locks --------------------------------------------------------------------------------


def lock_file_for(target: Path) -> Path:
    """Returns the lock file that guards ``target`` (a file or directory): ``.NAME.lock`` beside it."""
    return target.with_name(f".{target.name}.lock")


def _lock_nowait(path: Path, *, block: bool = False) -> IO[str] | None:
    """Returns ``path`` opened and exclusively locked, or None while another holds it.

    With ``block``, waits for the lock instead (never returns None). A lock won on a file
    its holder has removed meanwhile (see :func:`_release`) does not count: the file at
    ``path`` now is tried instead.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        except BaseException:
            f.close()
            raise
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(path).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()


def _release(path: Path, f: IO[str]) -> None:
    """Removes the lock file, then unlocks it: no lock files are left behind, and a waiter
    that wins the removed file tries again (:func:`_lock_nowait`)."""
    try:
        path.unlink(missing_ok=True)
    finally:
        f.close()


@asynccontextmanager
async def exclusive(path: Path, on_wait: Callable[[], None] = lambda: None) -> AsyncIterator[None]:
    """Holds an exclusive lock on the file ``path`` (created, with its directory) for the block.

    One holder at a time across processes and across tasks of one process (each entry
    opens the file anew). While another holds it, waits, checking every
    :data:`LOCK_POLL` seconds; ``on_wait`` is called once when it has to wait.
    Cancellation while waiting holds nothing. Leaving the block removes the file and
    releases the lock. Raises OSError if the file cannot be created.
    """
    f = await trio.to_thread.run_sync(_lock_nowait, path)
    if f is None:
        on_wait()
        while f is None:
            await trio.sleep(LOCK_POLL)
            f = await trio.to_thread.run_sync(_lock_nowait, path)
    try:
        yield
    finally:
        _release(path, f)


@contextmanager
def exclusive_blocking(path: Path, on_wait: Callable[[], None] = lambda: None) -> Iterator[None]:
    """:func:`exclusive` for blocking code (a worker thread or a command line): the wait blocks.

    ``on_wait`` is called once before blocking. Raises OSError if the file cannot be created.
    """
    f = _lock_nowait(path)
    if f is None:
        on_wait()
        f = _lock_nowait(path, block=True)
    assert f is not None
    try:
        yield
    finally:
        _release(path, f)


# -- unpacking ------------------------------------------------------------------------------


#: The permission bits an unpacked file keeps: never setuid, setgid or sticky, never writable
#: by group or others (what tarfile's "data" filter keeps).
DATA_MODE_MASK = 0o755


def _inside(root: Path, target: Path) -> bool:
    """Returns whether ``target`` (normalised, not resolved) lies inside ``root``."""
    root_n = os.path.normpath(root)
    target_n = os.path.normpath(target)
    return target_n == root_n or target_n.startswith(root_n + os.sep)


def _check_member(dest: Path, name: str, link: str | None, hard: bool) -> None:
    """Raises ArtifactError if member ``name`` (or its link target) would leave ``dest``."""
    pure = PurePosixPath(name)
    outside = f"the archive is refused: member {name!r} would be written outside the install directory"
    if pure.is_absolute() or ".." in pure.parts or "\0" in name:
        raise ArtifactError(outside)
    target = dest / pure
    if not _inside(dest, target):
        raise ArtifactError(outside)
    if link is not None:
        lpure = PurePosixPath(link)
        points_out = f"the archive is refused: link {name!r} -> {link!r} points outside the install directory"
        if lpure.is_absolute():
            raise ArtifactError(points_out)
        resolved = dest / lpure if hard else target.parent / lpure
        if not _inside(dest, Path(os.path.normpath(resolved))):
            raise ArtifactError(points_out)


def safe_extract(archive: Path, dest: Path, *, prefix: str = "") -> None:
    """Unpacks ``archive`` (.tar.gz/.tgz/.tar.xz/.zip) into ``dest``; only members under ``prefix`` if given.

    Every member is checked BEFORE anything is written: absolute paths, ``..``, links
    whose target leaves ``dest`` (any link inside a zip), device files and FIFOs refuse
    the whole archive (:class:`ArtifactError` naming the member). Blocking: call in a thread.
    """
    dest.mkdir(parents=True, exist_ok=True)
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            infos = [i for i in zf.infolist() if i.filename.startswith(prefix)]
            for info in infos:
                mode = info.external_attr >> 16
                if stat.S_ISLNK(mode):
                    raise ArtifactError(f"the archive is refused: {info.filename!r} is a symbolic link inside a zip")
                _check_member(dest, info.filename, None, False)
            for info in infos:
                zf.extract(info, dest)
                mode = (info.external_attr >> 16) & 0o777
                if mode and not info.is_dir():
                    os.chmod(dest / info.filename, mode)
        return
    with tarfile.open(archive) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
        for m in members:
            if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
                raise ArtifactError(f"the archive is refused: {m.name!r} is a device file or FIFO")
            _check_member(dest, m.name, m.linkname if (m.issym() or m.islnk()) else None, m.islnk())
        if hasattr(tarfile, "data_filter"):
            # The members were checked above; the "data" filter checks again (and strips setuid bits).
            tf.extractall(dest, members=members, filter="data")
            return
        # Python before 3.11.4 (Debian 12's 3.11.2) has no filters: do what "data" does to the
        # checked members, so nothing is made setuid nor handed to the archive's owners.
        for m in members:
            m.mode &= DATA_MODE_MASK
            m.uid, m.gid, m.uname, m.gname = os.getuid(), os.getgid(), "", ""
        tf.extractall(dest, members=members)
