"""Install and locate the gateways ``bench/gateway.py`` compares llmgw with.

``python -m bench.gateway_setup`` installs whatever is missing and prints one JSON
object (peer -> ``{"ok", "path" or "reason"}``) on its last stdout line:

* ``nginx`` and ``wrk`` from Debian (``apt-get install``; needs root),
* ``sglang-router``, ``vllm-router`` and ``litellm[proxy]`` from PyPI, each into its own
  virtual environment under :data:`CACHE_DIR` so their dependencies never touch the
  project's venv.

Only the package registries are contacted, and only here; the benchmark itself talks to
127.0.0.1 only. Every step is allowed to fail: a peer that cannot be installed is
reported with the reason, and the benchmark reports it as unavailable instead of
crashing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

#: Where the peers' virtual environments live (outside the repo; reused between runs).
CACHE_DIR = Path(os.environ.get("LLMGW_BENCH_CACHE", Path.home() / ".cache" / "llmgw-bench"))

#: PyPI peers: name -> (pip requirement, executable inside the venv's bin/ that proves it installed).
PYPI_PEERS: dict[str, tuple[str, str]] = {
    "sglang-router": ("sglang-router", "python"),
    "vllm-router": ("vllm-router", "vllm-router"),
    "litellm": ("litellm[proxy]", "litellm"),
}

#: Debian packages: executable -> package.
DEBIAN_TOOLS: dict[str, str] = {"nginx": "nginx-light", "wrk": "wrk"}

#: Seconds allowed for one install step (litellm[proxy] pulls in a lot).
INSTALL_TIMEOUT_S = 900


def venv_dir(peer: str) -> Path:
    """Return the virtual environment directory of a PyPI peer (it may not exist)."""
    return CACHE_DIR / peer


def _pypi_installed(peer: str) -> bool:
    requirement, exe = PYPI_PEERS[peer]
    base = venv_dir(peer)
    if not (base / "bin" / exe).exists():
        return False
    module = {"sglang-router": "sglang_router", "vllm-router": "vllm_router", "litellm": "litellm"}[peer]
    # A cheap check that the package itself is there (the venv may hold a half install).
    probe = subprocess.run(
        [str(base / "bin" / "python"), "-c", f"import importlib.util,sys; sys.exit(importlib.util.find_spec({module!r}) is None)"],
        capture_output=True,
        timeout=60,
    )
    return probe.returncode == 0


def locate() -> dict[str, dict[str, object]]:
    """Return what is installed: peer -> ``{"ok": True, "path": ...}`` or ``{"ok": False, "reason": ...}``.

    Installs nothing. For PyPI peers ``path`` is the venv directory; for Debian tools the
    executable.
    """
    found: dict[str, dict[str, object]] = {}
    for exe in DEBIAN_TOOLS:
        path = shutil.which(exe)
        found[exe] = {"ok": True, "path": path} if path else {
            "ok": False, "reason": f"{exe} not on PATH (run: python -m bench.gateway_setup)"}
    for peer in PYPI_PEERS:
        try:
            ok = _pypi_installed(peer)
        except (OSError, subprocess.SubprocessError) as error:
            ok, why = False, f"cannot run its venv's python: {error}"
        else:
            why = f"not installed in {venv_dir(peer)} (run: python -m bench.gateway_setup)"
        found[peer] = {"ok": True, "path": str(venv_dir(peer))} if ok else {"ok": False, "reason": why}
    return found


def _run(cmd: list[str], log: Path) -> str | None:
    """Run ``cmd`` with output to ``log``; return None on success, else a one-line reason."""
    try:
        with log.open("ab") as out:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S,
                                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}).returncode
    except (OSError, subprocess.SubprocessError) as error:
        return f"{' '.join(cmd[:3])}...: {error}"
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        return f"{' '.join(cmd[:4])} exited with {rc} (log {log}): {tail[0][:300]}"
    return None


def install() -> dict[str, dict[str, object]]:
    """Install every missing peer; return :func:`locate`'s answer afterwards, with install errors as reasons."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}
    missing_debs = [pkg for exe, pkg in DEBIAN_TOOLS.items() if shutil.which(exe) is None]
    if missing_debs:
        log = CACHE_DIR / "apt.log"
        why = _run(["apt-get", "update", "-qq"], log) or _run(["apt-get", "install", "-y", "-qq", *missing_debs], log)
        if why:
            for exe, pkg in DEBIAN_TOOLS.items():
                if pkg in missing_debs:
                    errors[exe] = why
    for peer, (requirement, _) in PYPI_PEERS.items():
        if _pypi_installed(peer):
            continue
        print(f"installing {requirement} into {venv_dir(peer)} ...", file=sys.stderr)
        log = CACHE_DIR / f"{peer}.log"
        why = _run([sys.executable, "-m", "venv", str(venv_dir(peer))], log) or _run(
            [str(venv_dir(peer) / "bin" / "pip"), "install", "-q", requirement], log)
        if why:
            errors[peer] = why
    found = locate()
    for peer, why in errors.items():
        if not found[peer]["ok"]:
            found[peer]["reason"] = why
    return found


def main(argv: list[str] | None = None) -> None:
    """Install the peers (``--check``: only locate them) and print the result as JSON on
    the last stdout line. ``--help`` says so and installs nothing."""
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_setup", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="locate the peers only; install nothing")
    args = parser.parse_args(argv)
    print(json.dumps(locate() if args.check else install()))


if __name__ == "__main__":
    main()
