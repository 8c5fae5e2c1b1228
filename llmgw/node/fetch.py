"""Fetching a model's weights onto this node: a local path, an http(s) URL or a Hugging Face repository.

A catalog model's ``source`` is one of:

- a local path (``/models/x.gguf``, ``file:///models/x``): used in place, never copied;
- an http(s) URL of one file (``https://host/x.gguf``, optionally ``#sha256=HEX`` to check it);
- a Hugging Face repository: ``hf://org/repo`` or ``hf://org/repo@revision``, or a repository
  page URL on the configured endpoint (``https://huggingface.co/org/repo``,
  ``.../org/repo/tree/REV``), read as the repository id.

:func:`fetch_weights` returns the local path the engine gets. Downloads land in the node's
weights directory, each file first as ``NAME.partial``; a partial file is resumed with an
HTTP ``Range`` request, checked against its size (and sha256 where the source publishes
one), and only then renamed to ``NAME``. A repository is marked complete with a marker
file once every file is in place, so the next start does not re-read it. Cancellation at
any point leaves at most ``.partial`` files (resumed next time), never a half file under
its final name.

The Hugging Face client speaks the hub's plain HTTP API: ``GET /api/models/{repo}/revision/{rev}?blobs=true``
for the file list (``siblings``: ``rfilename``, ``size``, ``lfs.sha256``) and the commit,
then ``GET /{repo}/resolve/{commit}/{path}`` for each file's bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shutil
from pathlib import Path, PurePosixPath
from typing import Callable, Sequence
from urllib.parse import unquote, urlsplit

import attrs
import httpx
import trio

from llmgw.spec import Adapter

__all__ = [
    "DEFAULT_HF_ENDPOINT",
    "FetchError",
    "FetchSettings",
    "RemoteFile",
    "WeightsSource",
    "cached_path",
    "fetch_adapters",
    "fetch_weights",
    "is_remote",
    "parse_source",
]

DEFAULT_HF_ENDPOINT = "https://huggingface.co"

#: Bytes read per chunk when hashing a partial file before resuming it: large enough that
#: per-call overhead is negligible, small enough to keep memory flat.
CHUNK_SIZE = 1024 * 1024
#: At most one progress message per this many seconds (plus one at start and one at the
#: end): a multi-GB fetch should not flood the control plane with status reports.
PROGRESS_INTERVAL = 2.0
#: Connecting and each read may take this long before the transfer counts as stalled;
#: a stalled transfer fails (and resumes from its .partial on the next try).
CONNECT_TIMEOUT = 15.0
READ_TIMEOUT = 60.0
#: The file list is one small JSON document.
LISTING_TIMEOUT = 60.0
#: Marker written into a repository's directory once every file is complete.
COMPLETE_MARKER = ".llmgw-complete"
PARTIAL_SUFFIX = ".partial"

Progress = Callable[[str], None]


class FetchError(Exception):
    """Weights could not be fetched; ``str()`` says what failed and what the operator can do."""


@attrs.frozen
class FetchSettings:
    """Where weights go and where the hub is (agent.yaml ``weights_dir``, ``hf_endpoint``).

    ``hf_token``: a Hugging Face access token for gated repositories ("" = anonymous).
    """

    weights_dir: Path
    hf_endpoint: str = DEFAULT_HF_ENDPOINT
    hf_token: str = ""


@attrs.frozen
class WeightsSource:
    """A parsed ``source``. ``kind`` is "local", "url" or "hf"."""

    kind: str
    location: str  # the path (local), the URL without fragment (url), or "org/repo" (hf)
    revision: str = "main"  # hf only
    sha256: str = ""  # url only: from a "#sha256=HEX" fragment


@attrs.frozen
class RemoteFile:
    """One file to download: its URL, where it goes (relative), its size and sha256 when known."""

    url: str
    relative: str
    size: int | None = None
    sha256: str = ""


_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


def is_remote(source: str) -> bool:
    """Returns True when ``source`` must be downloaded (an http(s) URL or hf:// repository)."""
    return source.startswith(("http://", "https://", "hf://"))


def parse_source(source: str, hf_endpoint: str = DEFAULT_HF_ENDPOINT) -> WeightsSource:
    """Returns what ``source`` names (see the module docstring).

    A URL on ``hf_endpoint``'s host (or huggingface.co) whose path is ``/org/repo`` or
    ``/org/repo/tree/REV`` is a repository page; ``/org/repo/resolve/REV/file`` and any
    other URL is one file. Raises :class:`FetchError` for an empty source or a malformed
    repository id.
    """
    source = source.strip()
    if not source:
        raise FetchError("the model has no weights source; set the model's source to a path, URL or hf://org/repo")
    if source.startswith("hf://"):
        repo, _, rev = source[len("hf://") :].partition("@")
        return _hf_source(source, repo.strip("/"), rev or "main")
    if source.startswith(("http://", "https://")):
        parts = urlsplit(source)
        hub_hosts = {urlsplit(hf_endpoint).netloc, "huggingface.co"}
        segments = [unquote(s) for s in parts.path.split("/") if s]
        if parts.netloc in hub_hosts and len(segments) in (2, 4) and not parts.query:
            if len(segments) == 2:
                return _hf_source(source, "/".join(segments), "main")
            if segments[2] == "tree":
                return _hf_source(source, "/".join(segments[:2]), segments[3])
        sha = ""
        fragment = parts.fragment
        if fragment.startswith("sha256="):
            sha = fragment[len("sha256=") :]
            if not _HEX64.match(sha):
                raise FetchError(f"weights source {source!r}: '#sha256=' must be followed by 64 hex digits")
        url = parts._replace(fragment="").geturl()
        return WeightsSource("url", url, sha256=sha.lower())
    if source.startswith("file://"):
        return WeightsSource("local", unquote(urlsplit(source).path))
    return WeightsSource("local", source)


def _hf_source(source: str, repo: str, revision: str) -> WeightsSource:
    if not _REPO_ID.match(repo) or ".." in repo:
        raise FetchError(
            f"weights source {source!r}: {repo!r} is not a Hugging Face repository id; write hf://org/repo[@revision]"
        )
    return WeightsSource("hf", repo, revision=revision)


async def fetch_weights(
    source: str,
    settings: FetchSettings,
    progress: Progress = lambda _msg: None,
    *,
    what: str = "weights",
    client: httpx.AsyncClient | None = None,
) -> Path:
    """Makes the weights named by ``source`` present on this node and returns their local path.

    A local source is returned as is once it exists. A URL returns the downloaded file; a
    repository returns its directory (``<weights_dir>/hf/<org>/<repo>/<commit>``). What is
    already complete is not downloaded again. ``progress`` gets messages like
    "fetching weights: 1.2/4.0 GB" (``what`` names the thing fetched in them and in a
    missing path's error). ``client`` (optional) is used instead of a fresh one.

    Raises :class:`FetchError` with an operator sentence on a missing local path, an HTTP
    error, a size or sha256 mismatch (the bad partial file is deleted), too little disk
    space, or an unreachable server. Cancellation propagates and leaves only ``.partial``
    files, which the next fetch resumes.
    """
    parsed = parse_source(source, settings.hf_endpoint)
    if parsed.kind == "local":
        path = Path(parsed.location).expanduser()
        if not path.exists():
            raise FetchError(
                f"{what} path {path} does not exist on this node; copy it there or give an http(s) or hf:// source"
            )
        return path

    def figures(done: str) -> None:
        progress(f"fetching {what}: {done}")

    owned = client is None
    if client is None:
        client = _new_client(settings)
    try:
        if parsed.kind == "url":
            final = _url_target(parsed, settings)
            target, name = final.parent, final.name
            if final.exists():
                return final
            files = [RemoteFile(parsed.location, name, None, parsed.sha256)]
            await _download_all(client, files, target, figures)
            return final
        return await _fetch_repo(client, parsed, settings, figures)
    finally:
        if owned:
            await client.aclose()


def _url_target(parsed: WeightsSource, settings: FetchSettings) -> Path:
    """Returns where the file of a URL source is kept: ``<weights_dir>/url/<digest>/<name>``."""
    name = posixpath.basename(urlsplit(parsed.location).path) or "weights"
    digest = hashlib.sha256(parsed.location.encode()).hexdigest()[:16]
    return settings.weights_dir / "url" / digest / name


async def fetch_adapters(
    adapters: Sequence[Adapter],
    settings: FetchSettings,
    progress: Progress = lambda _msg: None,
    *,
    check_local: bool = True,
) -> tuple[Adapter, ...]:
    """Makes each LoRA adapter present on this node; returns them, in order, with ``source``
    replaced by the local path the engine loads.

    Each adapter is fetched like weights (:func:`fetch_weights`: resumable, checked, cached
    in the weights directory); ``progress`` gets "fetching adapter NAME: 3/8 MB". A local
    source is used in place (checked to exist unless ``check_local`` is False: the
    simulated engine's adapters need no files). Raises :class:`FetchError` naming the
    adapter that failed; adapters fetched before it stay cached. Cancellation propagates
    (only ``.partial`` files remain).
    """
    local: list[Adapter] = []
    for adapter in adapters:
        if not check_local and not is_remote(adapter.source):
            local.append(adapter)
            continue
        try:
            path = await fetch_weights(adapter.source, settings, progress, what=f"adapter {adapter.name}")
        except FetchError as exc:
            raise FetchError(f"LoRA adapter {adapter.name!r}: {exc}") from exc
        local.append(Adapter(name=adapter.name, source=str(path)))
    return tuple(local)


def cached_path(source: str, settings: FetchSettings) -> Path | None:
    """Returns where a completed fetch of ``source`` lies on this node, without any network
    call, or None if it is not (or not certainly) there.

    For re-attaching to a running engine after an agent restart: a local source is itself;
    a URL its downloaded file; a repository the one complete download of its revision (a
    revision that is a commit id matches its directory; a branch matches the marker).
    """
    try:
        parsed = parse_source(source, settings.hf_endpoint)
    except FetchError:
        return None
    if parsed.kind == "local":
        path = Path(parsed.location).expanduser()
        return path if path.exists() else None
    if parsed.kind == "url":
        final = _url_target(parsed, settings)
        return final if final.exists() else None
    repo_dir = settings.weights_dir / "hf" / parsed.location
    found = []
    for marker in repo_dir.glob(f"*/{COMPLETE_MARKER}"):
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if parsed.revision in (info.get("revision"), info.get("commit")):
            found.append(marker.parent)
    return found[0] if len(found) == 1 else None


def _new_client(settings: FetchSettings) -> httpx.AsyncClient:
    headers = {"User-Agent": "llmgw-agent"}
    token = settings.hf_token or os.environ.get("HF_TOKEN", "")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    timeout = httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT)
    return httpx.AsyncClient(headers=headers, timeout=timeout, follow_redirects=True)


async def _fetch_repo(
    client: httpx.AsyncClient, source: WeightsSource, settings: FetchSettings, progress: Progress
) -> Path:
    endpoint = settings.hf_endpoint.rstrip("/")
    listing_url = f"{endpoint}/api/models/{source.location}/revision/{source.revision}"
    with trio.fail_after(LISTING_TIMEOUT):
        try:
            response = await client.get(listing_url, params={"blobs": "true"})
        except httpx.HTTPError as exc:
            raise FetchError(
                f"cannot reach {endpoint} for {source.location}@{source.revision} ({exc}); "
                "check the node's network or set hf_endpoint in agent.yaml to a reachable mirror"
            ) from exc
    if response.status_code in (401, 403):
        raise FetchError(
            f"{endpoint} refused access to {source.location} (HTTP {response.status_code}); "
            "the repository may be gated: set HF_TOKEN for the agent"
        )
    if response.status_code == 404:
        raise FetchError(f"{endpoint} has no repository {source.location} at revision {source.revision!r}")
    if response.status_code != 200:
        raise FetchError(f"{endpoint} answered HTTP {response.status_code} listing {source.location}")
    try:
        info = response.json()
        commit = str(info.get("sha") or source.revision)
        siblings = info["siblings"]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FetchError(f"{endpoint} sent a file list for {source.location} that cannot be read ({exc})") from exc
    if not re.fullmatch(r"[A-Za-z0-9._-]+", commit):
        raise FetchError(f"{endpoint} named an invalid commit {commit!r} for {source.location}")
    target = settings.weights_dir / "hf" / source.location / commit
    if (target / COMPLETE_MARKER).exists():
        return target
    files = []
    for sibling in siblings:
        relative = str(sibling.get("rfilename", ""))
        _check_relative(relative, source.location)
        lfs = sibling.get("lfs") or {}
        size = lfs.get("size", sibling.get("size"))
        sha = str(lfs.get("sha256") or "")
        url = f"{endpoint}/{source.location}/resolve/{commit}/{relative}"
        files.append(RemoteFile(url, relative, int(size) if size is not None else None, sha.lower()))
    await _download_all(client, files, target, progress)
    marker = {"repo": source.location, "revision": source.revision, "commit": commit}
    await trio.Path(target / COMPLETE_MARKER).write_text(json.dumps(marker))
    return target


def _check_relative(relative: str, repo: str) -> None:
    """Raises :class:`FetchError` unless ``relative`` stays inside the repository's directory."""
    path = PurePosixPath(relative)
    if not relative or path.is_absolute() or ".." in path.parts or relative.endswith(PARTIAL_SUFFIX):
        raise FetchError(f"repository {repo} lists a file {relative!r} that would land outside its directory; refused")


async def _download_all(client: httpx.AsyncClient, files: list[RemoteFile], target: Path, progress: Progress) -> None:
    """Downloads every file not yet complete under ``target``, reporting overall progress."""
    pending = [f for f in files if not (target / f.relative).exists()]
    known = [f.size for f in files if f.size is not None]
    total = sum(known) if len(known) == len(files) else None
    done = sum(f.size or 0 for f in files if f not in pending)
    await trio.Path(target).mkdir(parents=True, exist_ok=True)
    if total is not None:
        needed = sum(f.size or 0 for f in pending)
        free = (await trio.to_thread.run_sync(shutil.disk_usage, target)).free
        if needed > free:
            raise FetchError(
                f"weights need {_human(needed)} but {target} has {_human(free)} free; "
                "free disk space or point weights_dir in agent.yaml at a larger disk"
            )
    meter = _Meter(progress, done, total)
    meter.report(force=True)
    for remote in pending:
        await _download_one(client, remote, target / remote.relative, meter)
    meter.report(force=True)


class _Meter:
    """Turns byte counts into throttled "A/B UNIT" figures for ``progress``."""

    def __init__(self, progress: Progress, done: int, total: int | None) -> None:
        self.progress = progress
        self.done = done
        self.total = total
        self._last = -PROGRESS_INTERVAL

    def add(self, n: int) -> None:
        self.done += n
        self.report()

    def report(self, force: bool = False) -> None:
        now = trio.current_time()
        if not force and now - self._last < PROGRESS_INTERVAL:
            return
        self._last = now
        if self.total is None:
            self.progress(_human(self.done))
        else:
            self.progress(_fraction(self.done, self.total))


_UNITS = (("GB", 1000**3), ("MB", 1000**2), ("kB", 1000), ("B", 1))


def _human(n: int) -> str:
    """Returns ``n`` bytes as "4.0 GB"/"16 MB"-style text."""
    for unit, size in _UNITS:
        if n >= size or unit == "B":
            value = n / size
            return f"{value:.1f} {unit}" if unit == "GB" else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def _fraction(done: int, total: int) -> str:
    """Returns "1.2/4.0 GB": both figures in the unit that suits ``total``."""
    for unit, size in _UNITS:
        if total >= size or unit == "B":
            return f"{done / size:.1f}/{total / size:.1f} {unit}"
    raise AssertionError("unreachable")


async def _download_one(client: httpx.AsyncClient, remote: RemoteFile, final: Path, meter: _Meter) -> None:
    """Downloads ``remote`` to ``final`` through ``final.partial``, resuming what is there.

    The partial file is renamed to ``final`` only after its size and sha256 (when known)
    match; on a mismatch it is deleted and :class:`FetchError` raised.
    """
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    await trio.Path(final.parent).mkdir(parents=True, exist_ok=True)
    offset = partial.stat().st_size if partial.exists() else 0
    if remote.size is not None and offset > remote.size:
        await trio.Path(partial).unlink()
        offset = 0
    hasher = hashlib.sha256()
    if offset:
        await trio.to_thread.run_sync(_hash_prefix, partial, hasher)
        meter.add(offset)
    if remote.size is None or offset < remote.size:
        offset, hasher = await _transfer(client, remote, partial, offset, hasher, meter)
    if remote.size is not None and offset != remote.size:
        await trio.Path(partial).unlink()
        raise FetchError(
            f"{remote.relative}: received {offset} bytes but the source says {remote.size}; "
            "the partial file was deleted, the next try starts it again"
        )
    if remote.sha256 and hasher.hexdigest() != remote.sha256:
        await trio.Path(partial).unlink()
        raise FetchError(
            f"{remote.relative}: sha256 {hasher.hexdigest()} does not match the published {remote.sha256}; "
            "the download was deleted (a corrupt transfer or a changed file at the source)"
        )
    await trio.Path(partial).rename(final)


def _hash_prefix(path: Path, hasher: "hashlib._Hash") -> None:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_SIZE):
            hasher.update(chunk)


async def _transfer(
    client: httpx.AsyncClient,
    remote: RemoteFile,
    partial: Path,
    offset: int,
    hasher: "hashlib._Hash",
    meter: _Meter,
) -> tuple[int, "hashlib._Hash"]:
    """Appends the bytes from ``offset`` on to ``partial``; returns its new length and the hasher.

    The hasher is a fresh one when the server ignored the range and the file started over.
    """
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    try:
        async with client.stream("GET", remote.url, headers=headers) as response:
            if response.status_code == 416 and offset:
                return offset, hasher  # nothing beyond what we have; the size check decides
            if response.status_code not in (200, 206):
                raise FetchError(f"{remote.url} answered HTTP {response.status_code}; check the model's source")
            mode = "ab"
            if offset and response.status_code == 200:
                # The server ignored the range: start over rather than append a second copy.
                meter.add(-offset)
                offset, mode = 0, "wb"
                hasher = hashlib.sha256()
            async with await trio.open_file(partial, mode) as out:
                async for chunk in response.aiter_bytes():
                    await out.write(chunk)
                    hasher.update(chunk)
                    offset += len(chunk)
                    meter.add(len(chunk))
    except httpx.HTTPError as exc:
        raise FetchError(
            f"download of {remote.url} broke off at {_human(offset)} ({exc or type(exc).__name__}); "
            "the next try resumes from there"
        ) from exc
    return offset, hasher
