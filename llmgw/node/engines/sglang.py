"""Adapter for SGLang: ``python -m sglang.launch_server`` from its own environment.

Whether SGLang works here is decided by llmgw's own one-line check run with the
environment's interpreter (``import sglang``; the exit status decides, the printed
version is reported): :func:`import_check`. The agent sets ``--model-path``,
``--served-model-name``, ``--host``/``--port``, ``--tp-size`` from the shard's GPUs
and, for a multi-node launch, ``--nnodes --node-rank --dist-init-addr``; GPUs are
chosen with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``CUDA_VISIBLE_DEVICES``.

SGLang takes its key only as ``--api-key``, and the command line is world-readable in
``/proc/PID/cmdline``. A shard with a secret (``ShardSpec.api_key``) is therefore started as
``python -m llmgw_sglang_launch`` (:data:`LAUNCHER_MODULE`, found through ``PYTHONPATH`` =
:data:`~llmgw.node.engines.ENGINE_PATH`) with the same arguments; the agent puts the secret in
``LLMGW_SGLANG_API_KEY`` (:func:`llmgw.node.engine_secret.secret_env`), and the launcher moves it
to SGLang's ``sys.argv`` inside the process before running ``sglang.launch_server``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Sequence

import attrs

from llmgw.node.engines import (
    DEFAULT_HEALTH_PATH,
    DEFAULT_STARTUP_TIMEOUT,
    ENGINE_PATH,
    check_refused,
    configured_probe,
    cuda_env,
)
from llmgw.node.engines.vllm import MultiNode
from llmgw.node.install import python_env
from llmgw.spec import ENGINE_INSTALLED, EngineInfo, ShardSpec

__all__ = ["ImportCheck", "SglangEngine", "import_check", "sglang_argv", "sglang_env"]

#: SGLang's server entry point.
LAUNCH_MODULE = "sglang.launch_server"
#: What a keyed shard runs instead: llmgw's stdlib-only launcher in :data:`LAUNCHER_PATH`, which
#: appends ``--api-key`` with the secret from its environment to ``sys.argv`` in-process and runs
#: :data:`LAUNCH_MODULE` as ``__main__``.
LAUNCHER_MODULE = "llmgw_sglang_launch"
#: The directory put on a keyed shard's PYTHONPATH (it holds :data:`LAUNCHER_MODULE`).
LAUNCHER_PATH = ENGINE_PATH
#: Importing sglang loads torch and CUDA libraries: tens of seconds on a busy node.
IMPORT_CHECK_TIMEOUT = 300.0


@attrs.frozen
class ImportCheck:
    """The result of the one-line import check: ``ok`` (exit status 0), ``version``, ``output``."""

    ok: bool
    version: str
    output: str


def import_check(python: str, module: str = "sglang", *, timeout: float = IMPORT_CHECK_TIMEOUT) -> ImportCheck:
    """Runs ``python -c "import MODULE; print(version)"``; returns whether it exited 0 (blocking).

    A missing interpreter, a timeout or any failure is ``ok=False`` with the reason in
    ``output``; never raises for those.
    """
    code = python_env.import_check(python_env.PythonEngine(module, module, module, "", ""))
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ImportCheck(False, "", f"{python}: {exc}")
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        return ImportCheck(False, "", output[-2000:] or f"exit status {done.returncode}")
    lines = done.stdout.strip().splitlines()
    return ImportCheck(True, lines[-1] if lines else "", output)


def sglang_argv(python: str, spec: ShardSpec, host: str, port: int, *, multinode: MultiNode | None = None) -> list[str]:
    """Returns the command line that serves ``spec`` with SGLang on ``host:port``: through
    :data:`LAUNCHER_MODULE` when ``spec`` has a secret (which is never on it)."""
    argv = [
        python, "-m", LAUNCHER_MODULE if spec.api_key else LAUNCH_MODULE,
        "--model-path", spec.source,
        "--served-model-name", spec.model,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(max(1, len(spec.gpus))),
    ]
    if multinode is not None:
        argv += [
            "--nnodes", str(multinode.nnodes),
            "--node-rank", str(multinode.node_rank),
            "--dist-init-addr", f"{multinode.master_addr}:{multinode.master_port}",
        ]
    return [*argv, *spec.args]


def sglang_env(spec: ShardSpec) -> dict[str, str]:
    """Returns the variables the agent adds for an SGLang shard (the profile's env last); the
    secret itself comes from :func:`llmgw.node.engine_secret.secret_env`."""
    env = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if spec.api_key:
        env["PYTHONPATH"] = LAUNCHER_PATH  # finds LAUNCHER_MODULE, nothing else
    if spec.gpus:
        env.update(cuda_env(spec))
    return {**env, **spec.env}


class SglangEngine:
    """Adapter for SGLang (see :class:`llmgw.node.engines.Engine`).

    ``roots``: where to look for installed SGLang environments (default: the agent's install
    dirs, then the installer's root). ``python``: the interpreter agent.yaml names
    (``engines.sglang.python``): always used when given, never replaced by an installed one.
    """

    name = "sglang"
    health_path = DEFAULT_HEALTH_PATH
    startup_timeout = DEFAULT_STARTUP_TIMEOUT

    def __init__(self, roots: Sequence[Path] | None = None, *, python: Path | None = None) -> None:
        self.roots = list(roots) if roots is not None else None
        self.configured_python = python

    def _installed(self) -> tuple[Path, dict[str, Any]] | None:
        return python_env.find_installed(python_env.SGLANG, self.roots)

    def python(self) -> str:
        """Returns the SGLang interpreter: agent.yaml's, else the installed environment's.

        Raises FileNotFoundError if agent.yaml names none and SGLang is not installed.
        """
        if self.configured_python is not None:
            return str(self.configured_python)
        found = self._installed()
        if found is None:
            raise FileNotFoundError(
                "SGLang is not installed on this node; it needs a node with an NVIDIA GPU "
                "(`python -m llmgw.node.install.python_env install sglang --gpu`)"
            )
        return str(python_env.engine_python(found[0]))

    def probe(self) -> EngineInfo:
        """Returns installed/version from the environment's marker (cheap: no import); for a
        python agent.yaml names, only whether it is there (the agent's installers prove it runs)."""
        if self.configured_python is not None:
            return configured_probe(self.name, self.configured_python)
        found = self._installed()
        if found is None:
            return EngineInfo(name=self.name, installed=False, installable=False,
                              detail="no SGLang environment installed")
        directory, marker = found
        return EngineInfo(name=self.name, installed=True, version=str(marker.get("version", "")),
                          detail=f"sglang in {directory}", path=str(python_env.engine_python(directory)),
                          origin=ENGINE_INSTALLED)

    def verify(self) -> EngineInfo:
        """Returns what the import check says (blocking; run it in a thread): installed only if it exits 0."""
        if self.configured_python is not None:
            result = import_check(str(self.configured_python))
            if not result.ok:
                return attrs.evolve(self.probe(), installed=False,
                                    detail=f"import sglang failed: {result.output[-300:]}")
            return attrs.evolve(self.probe(), installed=True, version=result.version)
        found = self._installed()
        if found is None:
            return self.probe()
        result = import_check(str(python_env.engine_python(found[0])))
        if not result.ok:
            return EngineInfo(name=self.name, installed=False, detail=f"import sglang failed: {result.output[-300:]}")
        return EngineInfo(name=self.name, installed=True, version=result.version, detail=f"sglang in {found[0]}")

    def argv(self, spec: ShardSpec, host: str, port: int) -> list[str]:
        """Returns the SGLang command line; raises FileNotFoundError if SGLang is not installed."""
        return sglang_argv(self.python(), spec, host, port)

    def env(self, spec: ShardSpec) -> dict[str, str]:
        """Returns the variables added for this shard (see :func:`sglang_env`)."""
        return sglang_env(spec)

    def check_args(self, spec: ShardSpec) -> None:
        """Raises EngineRefused naming refused args/env."""
        check_refused(spec)
