"""Fetching a model's weights onto this node: a local path, an http(s) URL or a Hugging Face repository.

A catalog model's ``source`` is a local path (used in place, never copied), an http(s) URL
of one file or a Hugging Face repository; :mod:`llmgw.catalog.sources` parses it.

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
from urllib.parse import urlsplit

import attrs
import httpx
import trio

from llmgw.catalog.sources import SourceError, WeightsSource, is_remote, parse_source
from llmgw.config.defaults import DEFAULT_HF_ENDPOINT
from llmgw.node.install.artifact import (
    PARTIAL_SUFFIX,
    ArtifactError,
    Meter,
    download,
    exclusive,
    fraction_text,
    human_size,
    lock_file_for,
    new_client,
)
from llmgw.node.job_fetch import JobFetchError, JobPieces, cached_job_result, fetch_job_result
from llmgw.spec import Adapter

__all__ = [
    "FetchError",
    "FetchSettings",
    "RemoteFile",
    "cached_path",
    "fetch_adapters",
    "fetch_weights",
]

#: The file list is one small JSON document. (Downloads have the connect and read
#: deadlines of :mod:`llmgw.node.install.artifact`.)
LISTING_TIMEOUT = 60.0
#: Marker written into a repository's directory once every file is complete.
COMPLETE_MARKER = ".llmgw-complete"

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
    #: Fetches pieces of a training job's result over the agent's session (llmgw/node/job_fetch.py);
    #: None: ``llmgw-job://`` sources cannot be fetched here.
    job_results: JobPieces | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class RemoteFile:
    """One file to download: its URL, where it goes (relative), its size and sha256 when known."""

    url: str
    relative: str
    size: int | None = None
    sha256: str = ""


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

    Raises :class:`FetchError` with an operator sentence on a malformed source, a missing
    local path, an HTTP error, a size or sha256 mismatch (the bad partial file is deleted),
    too little disk space, or an unreachable server. Two fetches of the same weights (two
    agents sharing the directory, or two shards) take turns under a lock file beside the
    target; the second finds the first one's result. Cancellation propagates and leaves
    only ``.partial`` files, which the next fetch resumes.
    """
    try:
        parsed = parse_source(source, settings.hf_endpoint)
    except SourceError as exc:
        raise FetchError(str(exc)) from None
    if parsed.kind == "job":
        try:
            return await fetch_job_result(parsed.location, settings.weights_dir, settings.job_results, progress, what)
        except JobFetchError as exc:
            raise FetchError(str(exc)) from None
    if parsed.kind == "local":
        path = Path(parsed.location).expanduser()
        if not path.exists():
            raise FetchError(
                f"{what} path {path} does not exist on this node; copy it there or give an http(s) or hf:// source"
            )
        return path

    def figures(done: int, total: int | None) -> str:
        return f"fetching {what}: {fraction_text(done, total)}"

    def waiting() -> None:
        progress(f"fetching {what}: waiting for another fetch of it on this node to finish")

    owned = client is None
    if client is None:
        client = _new_client(settings)
    try:
        if parsed.kind == "url":
            final = _url_target(parsed, settings)
            if final.exists():
                return final
            async with exclusive(lock_file_for(final), waiting):
                if not final.exists():
                    meter = Meter(progress, figures, learn_total=True)
                    files = [RemoteFile(parsed.location, final.name, None, parsed.sha256)]
                    await _download_all(client, files, final.parent, meter)
            return final
        return await _fetch_repo(client, parsed, settings, Meter(progress, figures), waiting)
    except ArtifactError as exc:
        raise FetchError(str(exc)) from exc
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
    except SourceError:
        return None
    if parsed.kind == "job":
        return cached_job_result(settings.weights_dir, parsed.location)
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
    return new_client(headers)


async def _fetch_repo(
    client: httpx.AsyncClient, source: WeightsSource, settings: FetchSettings, meter: Meter, waiting: Callable[[], None]
) -> Path:
    """Returns the directory of the repository's commit, downloaded unless marked complete.

    Downloads under the directory's lock (``waiting`` is called once if another holds it)
    and writes :data:`COMPLETE_MARKER` last. Raises :class:`FetchError` (listing) or
    ArtifactError (a file's download).
    """
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
    async with exclusive(lock_file_for(target), waiting):
        if (target / COMPLETE_MARKER).exists():
            return target  # another fetch finished it while this one waited
        meter.total = _total(files)
        await _download_all(client, files, target, meter)
        marker = {"repo": source.location, "revision": source.revision, "commit": commit}
        await trio.Path(target / COMPLETE_MARKER).write_text(json.dumps(marker))
    return target


def _check_relative(relative: str, repo: str) -> None:
    """Raises :class:`FetchError` unless ``relative`` stays inside the repository's directory."""
    path = PurePosixPath(relative)
    if not relative or path.is_absolute() or ".." in path.parts or relative.endswith(PARTIAL_SUFFIX):
        raise FetchError(f"repository {repo} lists a file {relative!r} that would land outside its directory; refused")


def _total(files: list[RemoteFile]) -> int | None:
    """Returns the bytes of all ``files``, or None when the size of any is unknown."""
    sizes = [f.size for f in files]
    return None if None in sizes else sum(f.size or 0 for f in files)


async def _download_all(client: httpx.AsyncClient, files: list[RemoteFile], target: Path, meter: Meter) -> None:
    """Downloads every file not yet complete under ``target``, counting into ``meter``
    (whose ``total`` is all of ``files``, or None), with a report at start and at end.

    Raises :class:`FetchError` when the disk cannot take the missing files, ArtifactError
    when a download fails. Cancellation leaves only ``.partial`` files.
    """
    pending = [f for f in files if not (target / f.relative).exists()]
    meter.done += sum(f.size or 0 for f in files if f not in pending)
    await trio.Path(target).mkdir(parents=True, exist_ok=True)
    if meter.total is not None:
        needed = sum(f.size or 0 for f in pending)
        free = (await trio.to_thread.run_sync(shutil.disk_usage, target)).free
        if needed > free:
            raise FetchError(
                f"weights need {human_size(needed)} but {target} has {human_size(free)} free; "
                "free disk space or point weights_dir in agent.yaml at a larger disk"
            )
    meter.report(force=True)
    for remote in pending:
        await download(client, remote.url, target / remote.relative, meter,
                       size=remote.size, sha256=remote.sha256, label=remote.relative)
    meter.report(force=True)
