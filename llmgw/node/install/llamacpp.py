"""Installing llama.cpp's ``llama-server``: from a release archive, or built from the PyPI sdist.

Two routes, tried in this order by :meth:`LlamaCppInstaller.install`:

1. **Release archive** (``llama-b11312-bin-ubuntu-x64.tar.gz``) from a URL template
   (default: GitHub releases; point it at a mirror for air-gapped sites). The archive's
   sha256 must match the published checksums file; it is unpacked into a scratch
   directory refusing any member path or link that would leave it; ``ldd`` must find
   every library of ``llama-server`` and ``llama-server --version`` must run. Only then
   is the directory renamed into place and marked installed (marker written last).
2. **Build from source**: the ``llama-cpp-python`` sdist on PyPI vendors the whole
   llama.cpp tree at this release. It is downloaded (pinned version AND sha256),
   unpacked, configured with :data:`CMAKE_FLAGS` (portable: ``GGML_NATIVE=OFF``) and
   only the ``llama-server`` target is built with ninja. Downloads, sources and the build
   tree are cached, so a second build is a no-op and an interrupted one resumes.

Layout (``root`` defaults to ``~/.cache/llmgw/engines/llama.cpp``)::

    root/b11312-cpu-615fe45f/bin/llama-server   built from the sdist (key: build + flags)
    root/b11312-ubuntu-x64/...                  unpacked release archive
    root/<key>/.llmgw-installed.json            the marker: written last, after the checks
    cache/downloads/  cache/src/  cache/build/   what a build keeps between runs

Public API (used by the agent's install framework, ``make test`` and ``llmgw up``)::

    installers(settings) -> [LlamaCppInstaller]      # llmgw.node.install contract
    LlamaCppInstaller(root, cache, url_template=..., checksums_template=...)
        await .probe() -> EngineInfo                 # cheap: marker + binary present
        await .install(version, progress) -> None    # progress: Callable[[str], None]
        await .check() -> str                        # --version + --list-devices, re-verified
    find_installed(roots=None) -> Installed | None   # sync; what the engine adapter runs
    await install(root=None, progress=None, ...) -> Installed   # archive, else sdist build
    await build_from_sdist(root, cache, progress) -> Installed
    await install_from_archive(url, checksums_url, root, progress) -> Installed
    await verify(directory) -> str                    # ldd + --version; raises InstallError

``progress`` is a plain synchronous callable taking one short sentence
("downloading llama_cpp_python-0.3.36.tar.gz (73 MB)", "building llama-server: 120/206");
it must be cheap and never raise. Every failure raises
:class:`llmgw.node.install.InstallError` with a sentence for the operator; cancellation
propagates and leaves nothing marked installed.

Command line (what ``make test`` runs; a cached run takes well under a second)::

    python -m llmgw.node.install.llamacpp [--root DIR] [--quiet]
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import attrs
import trio

from llmgw.node.install import InstallError, log_ignored_marker, register_install_dir, search_roots
from llmgw.node.install.artifact import ArtifactError, Meter, download, exclusive, new_client, safe_extract, sha256_file
from llmgw.spec import ENGINE_INSTALLED, EngineInfo

__all__ = [
    "ARCHIVE_URL_TEMPLATE",
    "BUILD_NUMBER",
    "CHECKSUMS_URL_TEMPLATE",
    "CMAKE_FLAGS",
    "DEFAULT_VERSION",
    "ENGINE_NAME",
    "Installed",
    "LlamaCppInstaller",
    "SDIST_SHA256",
    "SDIST_URL",
    "SDIST_VERSION",
    "build_from_sdist",
    "build_key",
    "default_root",
    "find_installed",
    "install",
    "install_from_archive",
    "installers",
    "verify",
]

ENGINE_NAME = "llama.cpp"

# -- what this llmgw release was checked against ------------------------------------
BUILD_NUMBER = 11312
BUILD_COMMIT = "0c1e570"
DEFAULT_VERSION = f"b{BUILD_NUMBER}"
#: llama-cpp-python's sdist vendors llama.cpp at exactly this build (see docs: shared reference).
SDIST_VERSION = "0.3.36"
#: sha256 of llama_cpp_python-0.3.36.tar.gz as downloaded from PyPI; a different file is refused.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_NAME = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_PROJECT = "llama-cpp-python"
#: Default: fetched with ``pip download`` (the machine's index and mirrors); ``sdist_url=`` another URL.
SDIST_URL = f"https://files.pythonhosted.org/packages/source/l/llama_cpp_python/{SDIST_NAME}"
#: Inside the sdist: the llama.cpp tree that is built.
SDIST_LLAMA_DIR = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp"

#: cmake flags of the source build. GGML_NATIVE=OFF: a cached binary must not SIGILL on
#: another CPU of the same kind; no prebuilt web UI and no OpenSSL (both need the network
#: or extra libraries); the two build flags, because the sdist's shallow .git would make
#: the binary say "build 1".
CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    f"-DLLAMA_BUILD_NUMBER={BUILD_NUMBER}",
    f"-DLLAMA_BUILD_COMMIT={BUILD_COMMIT}",
)

#: Release archive URL; ``{tag}`` is "b11312", ``{asset}`` the archive's file name.
ARCHIVE_URL_TEMPLATE = "https://github.com/ggml-org/llama.cpp/releases/download/{tag}/{asset}"
#: The published checksums: ``{url}`` is the archive's URL, ``{base}`` its directory, ``{asset}``
#: its name. The file holds "HEX  NAME" lines (sha256sum format) or one bare hex digest.
CHECKSUMS_URL_TEMPLATE = "{url}.sha256"
#: Archive name for this OS/CPU: ubuntu x64/arm64 builds are published for CPU-only Linux.
ASSET_TEMPLATE = "llama-{tag}-bin-ubuntu-{arch}.tar.gz"

MARKER = ".llmgw-installed.json"
SRC_MARKER = ".llmgw-extracted"
BINARY = "llama-server"

# -- tunables -------------------------------------------------------------------------
#: ``--version`` and ``ldd`` take milliseconds; a binary that hangs this long is broken.
VERIFY_TIMEOUT = 60.0
#: cmake configure + ninja on a busy 2-core machine took up to 18 minutes; 90 is a hang.
BUILD_TIMEOUT = 90 * 60.0
#: ``pip download`` of the 73 MB sdist (pip's own socket timeout covers each read; this
#: bounds a transfer that keeps trickling): half an hour means the index is unusable.
SDIST_DOWNLOAD_TIMEOUT = 30 * 60.0
#: Build progress ("step 120/206") at most this often (each sentence is reported upward).
PROGRESS_EVERY = 1.0
#: One install at a time per root: this file in the root is locked while installing.
INSTALL_LOCK = ".install.lock"

ProgressFn = Callable[[str], None]


def _no_progress(message: str) -> None:
    """The default progress callback: ignores ``message``."""


# -- layout -------------------------------------------------------------------------------


def default_root() -> Path:
    """Returns ``$XDG_CACHE_HOME/llmgw/engines/llama.cpp`` (default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmgw" / "engines" / "llama.cpp"


def build_key(flags: Sequence[str] = CMAKE_FLAGS) -> str:
    """Returns the directory name of a source build: ``b11312-cpu-<first 8 hex of sha256(flags)>``."""
    digest = hashlib.sha256("\n".join(flags).encode()).hexdigest()[:8]
    return f"{DEFAULT_VERSION}-cpu-{digest}"


def _arch() -> str | None:
    """Returns the release archive's name for this CPU ("x64", "arm64"), or None if none is published."""
    return {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())


@attrs.frozen
class Installed:
    """An installed llama-server: its directory, binary, version tag and ``--version`` line."""

    directory: Path
    binary: Path
    version: str  # "b11312"
    version_line: str  # "version: 0.5.0-dev (build 11312, commit 0c1e570)"
    source: str  # "sdist" or the archive URL
    #: When its marker was written (seconds since the epoch; 0 unknown): the latest install wins.
    installed_at: float = attrs.field(default=0.0, eq=False)


def read_marker(directory: Path) -> Installed | None:
    """Returns the install recorded in ``directory``'s marker, or None if unmarked or it does
    not describe a usable install there (:func:`marker_problem`; logged once)."""
    try:
        data = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    problem = marker_problem(directory, data)
    if problem is not None:
        log_ignored_marker(directory, problem)
        return None
    installed_at = data.get("installed_at")
    return Installed(directory, directory / data["binary"], data["version"], data["version_line"], str(data["source"]),
                     float(installed_at) if isinstance(installed_at, (int, float)) else 0.0)


_BUILD_OF_VERSION = re.compile(r"b(\d+)")
_BUILD_OF_LINE = re.compile(r"\(build (\d+)")


def marker_problem(directory: Path, data: Any) -> str | None:
    """Returns why the marker ``data`` (read from ``directory``) does not describe a usable
    llama-server there, or None when it does.

    Checked: the fields are there and are text; the binary lies inside ``directory`` and is
    executable; and the ``--version`` line recorded at install names the same build as the
    version (``b11312`` and ``(build 11312, ...``), so one build cannot pass for another.
    """
    if not isinstance(data, dict):
        return "its marker is not a JSON object"
    fields = {key: data.get(key) for key in ("version", "version_line", "binary", "source")}
    missing = sorted(key for key, value in fields.items() if not isinstance(value, str) or not value)
    if missing:
        return f"its marker lacks {', '.join(missing)}"
    binary = (directory / fields["binary"]).resolve()
    if not binary.is_relative_to(directory.resolve()):
        return f"its marker names a binary outside the directory ({fields['binary']})"
    if not os.access(binary, os.X_OK):
        return f"{directory / fields['binary']} is missing or not executable"
    wanted = _BUILD_OF_VERSION.fullmatch(fields["version"])
    recorded = _BUILD_OF_LINE.search(fields["version_line"])
    if wanted and recorded and wanted.group(1) != recorded.group(1):
        return f"its marker says {fields['version']} but the binary said {fields['version_line']!r} at install"
    return None


def find_installed(roots: Iterable[Path] | None = None, version: str | None = None) -> Installed | None:
    """Returns the installed llama-server that runs here, of ``version`` (None: any), or None.

    ``roots`` are searched in order (default: the agent's install dirs, then the default
    root; see :func:`llmgw.node.install.search_roots`): the first root holding one wins.
    Within it the version installed last wins (an install of another version, as server.yaml
    ``engines:`` asks, takes over from the one before, as for vLLM's environments), and of
    that version a source build is preferred over an archive. The probe and the engine
    adapter both ask this, so the version reported is the one that runs. Markers that do not
    match their directory are ignored with a log line (:func:`marker_problem`).
    Cheap (reads markers, no process started): safe to call per shard start.
    """
    roots = search_roots(default_root(), ENGINE_NAME) if roots is None else list(roots)
    for root in roots:
        try:
            children = sorted(p for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            continue
        found = [inst for inst in map(read_marker, children)
                 if inst is not None and (version is None or inst.version == version)]
        if found:
            latest = max(found, key=lambda i: i.installed_at).version
            return min((i for i in found if i.version == latest), key=lambda i: (i.source != "sdist", str(i.directory)))
    return None


def _write_marker(inst: Installed) -> None:
    """Writes the marker atomically (temp file + rename): the install counts from this moment."""
    payload = {
        "version": inst.version,
        "version_line": inst.version_line,
        "binary": str(inst.binary.relative_to(inst.directory)),
        "source": inst.source,
        "installed_at": time.time(),
    }
    tmp = inst.directory / (MARKER + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, inst.directory / MARKER)


# -- checks ---------------------------------------------------------------------------


_NOT_FOUND = re.compile(r"^\s*(\S+)\s*=>\s*not found", re.MULTILINE)
_VERSION_LINE = re.compile(r"^version: .*$", re.MULTILINE)


async def _run(argv: Sequence[str], timeout: float, cwd: Path | None = None) -> tuple[int, str]:
    """Runs ``argv``; returns (exit code, stdout+stderr). Raises InstallError on timeout or if it cannot start."""
    try:
        with trio.fail_after(timeout):
            done = await trio.run_process(
                list(argv), capture_stdout=True, stderr=subprocess.STDOUT, check=False, cwd=cwd
            )
    except trio.TooSlowError:
        raise InstallError(f"{argv[0]} did not finish within {timeout:g} s") from None
    except OSError as exc:
        raise InstallError(f"{argv[0]} cannot be started: {exc}") from None
    return done.returncode, (done.stdout or b"").decode(errors="replace")


async def verify(directory: Path, binary: Path | None = None) -> str:
    """Checks an unpacked/built llama-server: ``ldd`` finds every library, ``--version`` runs.

    Returns the ``version: ...`` line. Raises InstallError naming the missing library, the
    exit status and output of a binary that cannot start, or a missing binary.
    """
    binary = binary or directory / "bin" / BINARY
    if not binary.is_file():
        raise InstallError(f"{binary} is missing: the archive or build did not produce llama-server")
    if not os.access(binary, os.X_OK):
        raise InstallError(f"{binary} is not executable")
    if shutil.which("ldd"):
        code, out = await _run(["ldd", str(binary)], VERIFY_TIMEOUT)
        missing = _NOT_FOUND.findall(out)
        if missing:
            raise InstallError(
                f"{binary.name} needs {', '.join(missing)}, which this node does not have (ldd: not found); "
                "install the library or use the source build"
            )
    code, out = await _run([str(binary), "--version"], VERIFY_TIMEOUT, cwd=directory)
    line = _VERSION_LINE.search(out)
    if code != 0 or line is None:
        tail = " | ".join(out.strip().splitlines()[-3:]) or "no output"
        raise InstallError(f"{binary.name} --version failed (exit status {code}): {tail}")
    return line.group(0).strip()


# -- downloads ------------------------------------------------------------------------


def _download_sentence(label: str) -> Callable[[int, int | None], str]:
    """Returns the progress sentence of one download: "downloading X (16 MB): 42%"."""

    def describe(done: int, total: int | None) -> str:
        size = f" ({total / 1e6:.0f} MB)" if total else ""
        share = "" if not done else f": {100 * done // total}%" if total else f": {done / 1e6:.0f} MB"
        return f"downloading {label}{size}{share}"

    return describe


async def _download(
    url: str, dest: Path, progress: ProgressFn, *, label: str | None = None, sha256: str = "", origin: str = ""
) -> Path:
    """Downloads ``url`` to ``dest`` (:func:`llmgw.node.install.artifact.download`), checked
    against ``sha256`` (published by ``origin``) when given; returns ``dest``.

    Raises ArtifactError (the caller turns it into InstallError); cancellation propagates.
    """
    meter = Meter(progress, _download_sentence(label or dest.name), learn_total=True)
    async with new_client() as client:
        return await download(client, url, dest, meter, sha256=sha256, origin=origin or url, label=label or "")


@contextmanager
def _install_errors() -> Iterator[None]:
    """Re-raises an :class:`ArtifactError` of the block as InstallError, with the same sentence."""
    try:
        yield
    except ArtifactError as exc:
        raise InstallError(str(exc)) from None


def parse_checksums(text: str, asset: str) -> str | None:
    """Returns the hex sha256 for ``asset`` in a checksums file ("HEX  NAME" lines, or one bare HEX)."""
    bare = None
    for line in text.splitlines():
        parts = line.strip().split()
        if not parts or not re.fullmatch(r"[0-9a-fA-F]{64}", parts[0]):
            continue
        if len(parts) == 1:
            bare = parts[0].lower()
        elif parts[-1].lstrip("*").split("/")[-1] == asset:
            return parts[0].lower()
    return bare


# -- the two routes -------------------------------------------------------------------


def _asset_name(tag: str) -> str | None:
    arch = _arch()
    if arch is None or sys.platform != "linux":
        return None
    return ASSET_TEMPLATE.format(tag=tag, arch=arch)


async def install_from_archive(
    url: str,
    checksums_url: str,
    root: Path,
    progress: ProgressFn = _no_progress,
    *,
    version: str = DEFAULT_VERSION,
    cache: Path | None = None,
) -> Installed:
    """Installs llama-server from the release archive at ``url``; returns it, marked installed.

    Downloads ``checksums_url``, then the archive (checked against the sha256 published
    there as it arrives; a mismatch deletes it), unpacks into a scratch directory (refusing
    escaping paths and links), runs :func:`verify` there, renames it to
    ``root/<version>-<asset stem>`` and writes the marker last. Raises InstallError (nothing
    is marked installed, the scratch directory is removed) for any failed step.
    """
    cache = cache or root
    asset = url.rsplit("/", 1)[-1]
    stem = re.sub(r"\.(tar\.gz|tgz|tar\.xz|zip)$", "", asset)
    downloads = cache / "downloads"
    archive = downloads / asset
    try:
        with _install_errors():
            sums = downloads / (asset + ".checksums")
            sums.unlink(missing_ok=True)  # read fresh each time: a mirror may have been corrected
            await _download(checksums_url, sums, progress, label=f"checksums of {asset}")
            expected = parse_checksums(sums.read_text(errors="replace"), asset)
            if expected is None:
                raise InstallError(f"{checksums_url} has no sha256 for {asset}; the archive is refused")
            await _download(url, archive, progress, sha256=expected, origin=checksums_url)
            final = root / f"{version}-{stem.removeprefix(f'llama-{version}-bin-')}"
            scratch = root / f".scratch-{final.name}-{os.getpid()}"
            await trio.to_thread.run_sync(shutil.rmtree, scratch, True)
            try:
                progress(f"unpacking {asset}")
                await trio.to_thread.run_sync(safe_extract, archive, scratch)
                binary = _find_binary(scratch)
                progress(f"checking {binary.relative_to(scratch)} (ldd, --version)")
                line = await verify(scratch, binary)
                await trio.to_thread.run_sync(shutil.rmtree, final, True)
                os.replace(scratch, final)
            except BaseException:
                await trio.to_thread.run_sync(shutil.rmtree, scratch, True)
                raise
    finally:
        archive.unlink(missing_ok=True)  # unpacked or refused: the archive itself is not kept
    inst = Installed(final, final / binary.relative_to(scratch), version, line, url)
    _write_marker(inst)
    progress(f"installed {inst.binary} ({line})")
    return inst


def _find_binary(directory: Path) -> Path:
    """Returns the llama-server file in ``directory`` (shallowest first); raises InstallError if none."""
    hits = sorted(directory.rglob(BINARY), key=lambda p: (len(p.parts), str(p)))
    hits = [p for p in hits if p.is_file() and not p.is_symlink()]
    if not hits:
        raise InstallError(f"the archive contains no {BINARY}")
    return hits[0]


_NINJA_STEP = re.compile(rb"^\[(\d+)/(\d+)\]")


async def _run_build_step(argv: Sequence[str], log: Path, progress: ProgressFn, what: str) -> None:
    """Runs one build command, appending its output to ``log``; reports ninja's [N/M] as progress.

    Raises InstallError with the last lines of output if it fails or exceeds BUILD_TIMEOUT.
    """
    tail: list[bytes] = []
    with open(log, "ab") as logf:
        logf.write(("$ " + " ".join(argv) + "\n").encode())
        logf.flush()
        try:
            with trio.fail_after(BUILD_TIMEOUT):
                proc = await trio.lowlevel.open_process(
                    list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
                try:
                    assert proc.stdout is not None
                    buf, last = b"", 0.0
                    async for chunk in proc.stdout:
                        logf.write(chunk)
                        buf += chunk
                        *lines, buf = buf.split(b"\n")
                        for line in lines:
                            tail = (tail + [line])[-15:]
                            m = _NINJA_STEP.match(line)
                            if m and time.monotonic() - last >= PROGRESS_EVERY:
                                last = time.monotonic()
                                progress(f"{what}: step {int(m.group(1))}/{int(m.group(2))}")
                    code = await proc.wait()
                finally:
                    # Cancelled or timed out: the build must not outlive its installer.
                    if proc.returncode is None:
                        proc.kill()
                        with trio.CancelScope(shield=True):
                            await proc.wait()
        except trio.TooSlowError:
            raise InstallError(f"{what} took over {BUILD_TIMEOUT / 60:.0f} minutes; see {log}") from None
        except OSError as exc:
            raise InstallError(f"{what}: {argv[0]} cannot be started ({exc}); install cmake, ninja and g++") from None
    if code != 0:
        text = " | ".join(t.decode(errors="replace") for t in tail[-5:])
        raise InstallError(f"{what} failed (exit status {code}); full log in {log}: {text}")


def _build_tools() -> list[str]:
    """Returns the names of build tools missing from PATH (cmake, ninja, a C++ compiler)."""
    missing = [tool for tool in ("cmake", "ninja") if shutil.which(tool) is None]
    if shutil.which("c++") is None and shutil.which("g++") is None:
        missing.append("g++")
    return missing


async def _pip_download_sdist(dest: Path, progress: ProgressFn) -> None:
    """Fetches the pinned sdist with ``pip download`` into ``dest``.

    pip, not a hard-coded URL: it honours the machine's index, mirrors and proxy
    configuration (pip.conf), as every other package install here does. Raises
    InstallError with pip's last words if it fails, or if it takes over
    :data:`SDIST_DOWNLOAD_TIMEOUT` (pip is killed then).
    """
    progress(f"downloading {SDIST_NAME} from the package index (pip download)")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST_PROJECT,
                f"{SDIST_PROJECT}=={SDIST_VERSION}", "--dest", tmp, "--quiet"]
        result: subprocess.CompletedProcess[bytes] | None = None
        with trio.move_on_after(SDIST_DOWNLOAD_TIMEOUT):  # run_process kills pip when this expires
            result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
        if result is None:
            raise InstallError(
                f"pip download {SDIST_PROJECT}=={SDIST_VERSION} took over {SDIST_DOWNLOAD_TIMEOUT / 60:.0f} minutes; "
                "check the package index or its mirror"
            )
        got = Path(tmp) / SDIST_NAME
        if result.returncode != 0 or not got.is_file():
            last = result.stderr.decode(errors="replace").strip().splitlines()[-3:]
            raise InstallError(f"pip download {SDIST_PROJECT}=={SDIST_VERSION} failed: {' | '.join(last)}")
        os.replace(got, dest)


async def fetch_sdist(cache: Path, progress: ProgressFn = _no_progress, *, sdist_url: str = SDIST_URL) -> Path:
    """Makes the pinned llama-cpp-python sdist's llama.cpp tree present under ``cache`` and returns
    it (``cache/src/`` + :data:`SDIST_LLAMA_DIR`): downloaded unless a copy with the right sha256
    is there, checked against :data:`SDIST_SHA256`, unpacked safely, marked. What building
    llama-server starts from, and what holds llama.cpp's own conversion scripts (a trained LoRA
    adapter becomes GGUF with its convert_lora_to_gguf.py). Raises InstallError."""
    sdist = cache / "downloads" / SDIST_NAME
    if not sdist.is_file() or await trio.to_thread.run_sync(sha256_file, sdist) != SDIST_SHA256:
        sdist.unlink(missing_ok=True)
        sdist.parent.mkdir(parents=True, exist_ok=True)
        if sdist_url == SDIST_URL:
            await _pip_download_sdist(sdist, progress)
        else:
            with _install_errors():
                await _download(sdist_url, sdist, progress)
        progress(f"checking the sha256 of {SDIST_NAME}")
        actual = await trio.to_thread.run_sync(sha256_file, sdist)
        if actual != SDIST_SHA256:
            sdist.unlink(missing_ok=True)
            raise InstallError(
                f"{SDIST_NAME} from {sdist_url} has sha256 {actual}, expected {SDIST_SHA256}; "
                "the file was deleted (check the index or mirror)"
            )
    src = cache / "src" / f"llama_cpp_python-{SDIST_VERSION}"
    if not (src / SRC_MARKER).is_file():
        progress(f"unpacking {SDIST_NAME}")
        await trio.to_thread.run_sync(shutil.rmtree, src, True)
        with _install_errors():
            await trio.to_thread.run_sync(lambda: safe_extract(sdist, cache / "src", prefix=SDIST_LLAMA_DIR))
        (src / SRC_MARKER).write_text(SDIST_SHA256 + "\n")
    return cache / "src" / SDIST_LLAMA_DIR


async def build_from_sdist(
    root: Path,
    cache: Path | None = None,
    progress: ProgressFn = _no_progress,
    *,
    sdist_url: str = SDIST_URL,
    jobs: int | None = None,
) -> Installed:
    """Builds llama-server from the pinned llama-cpp-python sdist; returns it, marked installed.

    Steps (each cached under ``cache``): download (sha256 must equal :data:`SDIST_SHA256`),
    unpack ``vendor/llama.cpp`` safely, cmake configure with :data:`CMAKE_FLAGS`, ninja
    ``llama-server`` only, copy to ``root/<build_key()>/bin``, :func:`verify`, marker last.
    Raises InstallError naming the failed step (and the log file of a failed build).
    """
    cache = cache or root
    missing = _build_tools()
    if missing:
        raise InstallError(
            f"building llama-server needs {', '.join(missing)} on PATH; install them "
            "(apt-get install cmake ninja-build g++, or pip install ninja)"
        )
    key = build_key()
    final = root / key
    existing = read_marker(final)
    if existing is not None:
        return existing
    await fetch_sdist(cache, progress, sdist_url=sdist_url)
    build = cache / "build" / key
    build.mkdir(parents=True, exist_ok=True)
    log = build / "llmgw-build.log"
    progress(f"configuring llama.cpp {DEFAULT_VERSION} (cmake)")
    await _run_build_step(
        ["cmake", "-S", str(cache / "src" / SDIST_LLAMA_DIR), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS],
        log, progress, "configuring llama.cpp",
    )
    jobs = jobs or max(1, os.cpu_count() or 1)
    progress(f"building llama-server {DEFAULT_VERSION} with {jobs} jobs (takes 10-20 minutes on 2 cores)")
    await _run_build_step(
        ["cmake", "--build", str(build), "--target", BINARY, "-j", str(jobs)], log, progress, "building llama-server"
    )
    built = build / "bin" / BINARY
    scratch = root / f".scratch-{key}-{os.getpid()}"
    await trio.to_thread.run_sync(shutil.rmtree, scratch, True)
    try:
        (scratch / "bin").mkdir(parents=True)
        shutil.copy2(built, scratch / "bin" / BINARY)
        if shutil.which("strip"):
            await _run(["strip", str(scratch / "bin" / BINARY)], VERIFY_TIMEOUT)
        progress("checking llama-server (ldd, --version)")
        line = await verify(scratch)
        await trio.to_thread.run_sync(shutil.rmtree, final, True)
        os.replace(scratch, final)
    except BaseException:
        await trio.to_thread.run_sync(shutil.rmtree, scratch, True)
        raise
    inst = Installed(final, final / "bin" / BINARY, DEFAULT_VERSION, line, "sdist")
    _write_marker(inst)
    progress(f"installed {inst.binary} ({line})")
    return inst


async def install(
    root: Path | None = None,
    progress: ProgressFn = _no_progress,
    *,
    cache: Path | None = None,
    version: str = DEFAULT_VERSION,
    url_template: str = ARCHIVE_URL_TEMPLATE,
    checksums_template: str = CHECKSUMS_URL_TEMPLATE,
    try_archive: bool = True,
    sdist_url: str = SDIST_URL,
) -> Installed:
    """Returns an installed llama-server of ``version``: the one already there, else a release
    archive, else (only for :data:`DEFAULT_VERSION`) a build from the sdist.

    Archive failures (unreachable, refused) are reported through ``progress`` and fall back
    to the build. Raises InstallError when no route works, with every route's reason.
    One install at a time per ``root`` (a file lock); others wait.
    """
    root = root or default_root()
    cache = cache or root

    def waiting() -> None:
        progress("waiting for another llama.cpp install on this machine to finish")

    async with exclusive(root / INSTALL_LOCK, waiting):
        existing = find_installed([root], version)
        if existing is not None:
            return existing
        reasons = []
        asset = _asset_name(version)
        if try_archive and asset is not None:
            url = url_template.format(tag=version, asset=asset)
            sums = checksums_template.format(url=url, base=url.rsplit("/", 1)[0], asset=asset, tag=version)
            try:
                return await install_from_archive(url, sums, root, progress, version=version, cache=cache)
            except InstallError as exc:
                reasons.append(f"release archive: {exc}")
                progress(f"no usable release archive ({exc}); building from source instead")
        elif try_archive:
            reasons.append(f"release archive: none is published for {platform.machine()} {sys.platform}")
        if version != DEFAULT_VERSION:
            reasons.append(f"source build: only {DEFAULT_VERSION} is pinned in this llmgw")
            raise InstallError(f"llama.cpp {version} cannot be installed: " + "; ".join(reasons))
        try:
            return await build_from_sdist(root, cache, progress, sdist_url=sdist_url)
        except InstallError as exc:
            reasons.append(f"source build: {exc}")
            raise InstallError(f"llama.cpp {version} cannot be installed: " + "; ".join(reasons)) from None


# -- the install framework's contract --------------------------------------------------


class LlamaCppInstaller:
    """llama.cpp for :mod:`llmgw.node.install` (see that module's contract).

    ``root``: install directories; ``cache``: downloads/sources/builds; templates as in :func:`install`.
    ``search``: more roots where an installed llama-server counts (the agent passes the default
    root, where `make test` and `llmgw up` build it); installs always go to ``root``.
    """

    name = ENGINE_NAME
    default_version = DEFAULT_VERSION

    def __init__(
        self,
        root: Path | None = None,
        cache: Path | None = None,
        *,
        url_template: str = ARCHIVE_URL_TEMPLATE,
        checksums_template: str = CHECKSUMS_URL_TEMPLATE,
        sdist_url: str = SDIST_URL,
        search: Sequence[Path] = (),
    ) -> None:
        self.root = root or default_root()
        self.roots = [self.root, *search]
        self.cache = cache or self.root
        self.url_template = url_template
        self.checksums_template = checksums_template
        self.sdist_url = sdist_url

    async def probe(self) -> EngineInfo:
        """Returns installed (version "b11312", detail: the ``--version`` line) from the marker; cheap.

        ``installable`` when a release archive exists for this CPU/OS or the build tools are present.
        """
        inst = find_installed(self.roots)
        missing = _build_tools()
        installable = _asset_name(DEFAULT_VERSION) is not None or not missing
        if inst is not None:
            return EngineInfo(self.name, True, inst.version, installable, f"{inst.version_line} at {inst.binary}",
                              path=str(inst.binary), origin=ENGINE_INSTALLED)
        detail = "" if installable else f"no release archive for this machine and {', '.join(missing)} missing for a source build"
        return EngineInfo(self.name, False, "", installable, detail)

    async def install(self, version: str, progress: ProgressFn) -> None:
        """Installs ``version`` (archive, else source build); raises InstallError."""
        await install(
            self.root, progress, cache=self.cache, version=version or DEFAULT_VERSION,
            url_template=self.url_template, checksums_template=self.checksums_template, sdist_url=self.sdist_url,
        )

    async def check(self) -> str:
        """Re-verifies the installed binary (ldd, --version) and lists its devices; returns the text.

        A binary that no longer passes has its marker removed (so it probes as not installed
        and is installed again) and InstallError is raised.
        """
        inst = find_installed(self.roots)
        if inst is None:
            raise InstallError("llama.cpp is not installed on this node")
        try:
            line = await verify(inst.directory, inst.binary)
        except InstallError as exc:
            (inst.directory / MARKER).unlink(missing_ok=True)
            raise InstallError(f"the installed llama-server no longer works ({exc}); it will be installed again") from None
        _, devices = await _run([str(inst.binary), "--list-devices"], VERIFY_TIMEOUT, cwd=inst.directory)
        return f"{line}\nbinary: {inst.binary}\n{devices.strip()}"


def installers(settings: Any) -> list[LlamaCppInstaller]:
    """Returns the llama.cpp installer for the agent's ``settings`` (InstallSettings).

    Installs under ``settings.install_dir/llama.cpp``, caches under ``settings.cache_dir/llama.cpp``;
    ``settings.url_templates["llama.cpp"]`` (or ``["llamacpp"]``) overrides the archive URL.
    Registers the install root so the engine adapter finds what is installed there.
    """
    register_install_dir(Path(settings.install_dir))
    root = Path(settings.install_dir) / ENGINE_NAME
    templates = dict(getattr(settings, "url_templates", {}) or {})
    template = templates.get(ENGINE_NAME) or templates.get("llamacpp") or ARCHIVE_URL_TEMPLATE
    return [LlamaCppInstaller(root, Path(settings.cache_dir) / ENGINE_NAME, url_template=template,
                              search=[default_root()])]


# -- command line ---------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m llmgw.node.install.llamacpp``: ensures llama-server is installed; prints its path.

    Exit status 0 with the binary's path on stdout; 1 with the reason on stderr.
    """
    import argparse

    parser = argparse.ArgumentParser(description="Install llama-server (cached) and print its path.")
    parser.add_argument("--root", type=Path, default=None, help="install root (default: %(default)s -> ~/.cache/llmgw/engines/llama.cpp)")
    parser.add_argument("--no-archive", action="store_true", help="skip release archives; build from the sdist")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    opts = parser.parse_args(argv)
    root = opts.root or default_root()
    existing = find_installed([root])
    if existing is not None:  # the fast path `make test` takes every time after the first
        print(existing.binary)
        return 0

    def say(message: str) -> None:
        if not opts.quiet:
            print(f"llama.cpp: {message}", file=sys.stderr, flush=True)

    try:
        inst = trio.run(lambda: install(root, say, try_archive=not opts.no_archive))
    except InstallError as exc:
        print(f"llama.cpp: {exc}", file=sys.stderr)
        return 1
    print(inst.binary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
