"""Engines the operator installed by hand and named in agent.yaml ``engines:``.

A path named there (``engines.vllm.python``, ``engines.sglang.python``,
``engines.llama.cpp.server``) wins over anything installed: the engine adapter runs it,
and the agent never installs that engine nor falls back to an installed one, even when the
path does not run. What the agent does instead is prove that it runs, with a deadline,
and report the result:

- llama.cpp: ``<server> --version`` must exit 0 and print a ``version: ...`` line
  (``version: 0.5.0-dev (build 11312, commit 0c1e570)`` is reported as ``b11312``);
- vLLM and SGLang: ``<python> -c "import vllm as m; print(PREFIX, m.__version__)"`` must
  exit 0 and print that line (:data:`VERSION_PREFIX`: vLLM logs at import, on stdout too).

:class:`ConfiguredInstaller` keeps the :mod:`llmgw.node.install` installer contract for
such an engine: ``probe()`` is cheap (it answers from the last proof while the file is
unchanged, and "checking" before the first), ``watch()`` runs the check at start, at every
recheck interval and when the file changes (the :class:`~llmgw.node.install.Converger` runs
it in the background, since importing vLLM can take a minute), ``install()`` refuses, ``check()`` runs the check and
returns its output. The reported :class:`~llmgw.spec.EngineInfo` has ``path`` and
``origin`` "agent.yaml"; ``installed`` is True only once the path ran, and ``detail`` says
why it is not usable otherwise.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Callable, Mapping

import attrs
import trio

from llmgw.config.agent import ENGINE_PATH_KEYS
from llmgw.node.install import InstallError
from llmgw.spec import ENGINE_FROM_CONFIG, EngineInfo

__all__ = ["PROVE_TIMEOUTS", "ConfiguredInstaller", "Proof", "configured_installers", "last_proof", "prove",
           "version_argv"]

log = logging.getLogger(__name__)

#: Seconds a path named in agent.yaml has to prove it runs. llama-server prints its version
#: in milliseconds; importing vLLM or SGLang loads torch, tens of seconds on a busy 2-core
#: machine, so ten minutes (as for the installer's own import check) means it hangs.
PROVE_TIMEOUTS: Mapping[str, float] = {"llama.cpp": 60.0, "vllm": 600.0, "sglang": 600.0}
#: How often a watched path's file is looked at (one stat) for a change, e.g. the operator
#: upgrading vLLM in place or fixing a broken path: noticed within seconds, not at the next recheck.
CHANGE_POLL = 5.0
#: Characters of a failed check's output kept in the reason (its last lines say why).
REASON_CHARS = 400
#: The Python module that must import, per Python engine.
_MODULES = {"vllm": "vllm", "sglang": "sglang"}

#: Starts the line a Python engine's check prints its version on: vLLM logs at import (on
#: stdout too), so the version is the line llmgw marked, not merely the last one.
VERSION_PREFIX = "llmgw-engine-version:"
_VERSION_LINE = re.compile(r"^version: (?P<text>.*)$", re.MULTILINE)
_BUILD = re.compile(r"\(build (?P<build>\d+)")


@attrs.frozen
class Proof:
    """What running a named path showed: ``ok`` with the engine's ``version``, or not ``ok``
    with ``reason`` (a sentence); ``output`` is what the check printed."""

    ok: bool
    version: str = ""
    reason: str = ""
    output: str = ""


def version_argv(engine: str, path: Path) -> list[str]:
    """Returns the command that proves ``engine`` runs from ``path`` and prints its version.

    Raises KeyError for an engine no path can be named for.
    """
    if engine == "llama.cpp":
        return [str(path), "--version"]
    module = _MODULES[engine]
    return [str(path), "-c", f"import {module} as m; print({VERSION_PREFIX!r}, getattr(m, '__version__', 'unknown'))"]


def _version_of(engine: str, output: str) -> str | None:
    """Returns the version in a successful check's ``output``, or None if it printed none."""
    if engine == "llama.cpp":
        line = _VERSION_LINE.search(output)
        if line is None:
            return None
        build = _BUILD.search(line.group("text"))
        return f"b{build.group('build')}" if build else line.group("text").strip()
    for line in reversed(output.splitlines()):
        if line.startswith(VERSION_PREFIX + " "):
            return line[len(VERSION_PREFIX) + 1:].strip() or None
    return None


def _tail(output: str) -> str:
    text = " | ".join(line.strip() for line in output.strip().splitlines()[-4:] if line.strip())
    return text[-REASON_CHARS:] or "no output"


async def prove(engine: str, path: Path, timeout: float | None = None) -> Proof:
    """Runs ``engine``'s version check on ``path`` (see :func:`version_argv`) within ``timeout``
    seconds (default :data:`PROVE_TIMEOUTS`); returns the :class:`Proof`. Never raises for a
    path that does not run: the reason is in the proof.
    """
    timeout = PROVE_TIMEOUTS[engine] if timeout is None else timeout
    if not path.exists():
        return Proof(False, reason=f"{path} does not exist")
    if path.is_dir():
        return Proof(False, reason=f"{path} is a directory, not a program")
    if not os.access(path, os.X_OK):
        return Proof(False, reason=f"{path} is not executable by this user (uid {os.getuid()})")
    argv = version_argv(engine, path)
    shown = " ".join(argv[:2]) if engine == "llama.cpp" else f"{path} -c 'import {_MODULES[engine]}'"
    try:
        with trio.fail_after(timeout):
            done = await trio.run_process(argv, capture_stdout=True, stderr=subprocess.STDOUT, check=False,
                                          stdin=subprocess.DEVNULL)
    except trio.TooSlowError:
        return Proof(False, reason=f"`{shown}` did not finish within {timeout:g} s")
    except OSError as exc:
        return Proof(False, reason=f"{path} cannot be run: {exc.strerror or exc}")
    output = (done.stdout or b"").decode(errors="replace")
    if done.returncode != 0:
        return Proof(False, reason=f"`{shown}` failed (exit status {done.returncode}): {_tail(output)}", output=output)
    version = _version_of(engine, output)
    if version is None:
        return Proof(False, reason=f"`{shown}` printed no version: {_tail(output)}", output=output)
    return Proof(True, version=version, output=output)


#: The last proof of each (engine, path), with the file's signature then (shared by the installer that
#: proves and the engine adapter that runs the path, see :func:`last_proof`). Written and read
#: in the agent's trio thread; a reader in a worker thread sees a whole tuple or the previous one.
#: Keyed by engine too: one interpreter named for vLLM and SGLang proves each separately.
_PROOFS: dict[tuple[str, Path], tuple[tuple[int, int, int, int] | None, Proof]] = {}


def last_proof(engine: str, path: Path) -> Proof | None:
    """Returns the last proof that ``path`` runs ``engine`` while its file is unchanged
    since, else None (cheap: one stat).

    The engine adapters ask it for the version of an engine whose path agent.yaml names.
    """
    entry = _PROOFS.get((engine, path))
    if entry is None or _signature(path) != entry[0]:
        return None
    return entry[1]


def _signature(path: Path) -> tuple[int, int, int, int] | None:
    """Returns what identifies the file at ``path`` now (inode, size, mtime, mode), or None if absent.

    The path itself is resolved first: a symlink switched to another target counts as a change.
    """
    try:
        st = path.resolve().stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)


class ConfiguredInstaller:
    """The installer of an engine whose path agent.yaml names (see the module docstring).

    ``engine``: "vllm", "sglang" or "llama.cpp"; ``path``: what the operator named.
    """

    def __init__(self, engine: str, path: Path, *, timeout: float | None = None) -> None:
        if engine not in PROVE_TIMEOUTS:
            raise ValueError(f"no path can be named for engine {engine!r}")
        self.name = engine
        self.path = path
        self.timeout = PROVE_TIMEOUTS[engine] if timeout is None else timeout
        #: The converger's target version when server.yaml names none; nothing is installed anyway.
        self.default_version = ""
        self._proof: Proof | None = None
        self._proved_signature: tuple[int, int, int, int] | None = None

    @property
    def setting(self) -> str:
        """The agent.yaml key that names the path, e.g. ``engines.vllm.python``."""
        key, _ = ENGINE_PATH_KEYS[self.name]
        return f"engines.{self.name}.{key}"

    def _info(self, proof: Proof | None) -> EngineInfo:
        path = str(self.path)
        if proof is None:
            return EngineInfo(self.name, installed=False, detail=f"checking that {path} ({self.setting}) runs",
                              path=path, origin=ENGINE_FROM_CONFIG)
        if proof.ok:
            return EngineInfo(self.name, installed=True, version=proof.version,
                              detail=f"{path}, named in agent.yaml ({self.setting})",
                              path=path, origin=ENGINE_FROM_CONFIG)
        return EngineInfo(self.name, installed=False,
                          detail=f"not usable: {proof.reason}; fix {self.setting} in agent.yaml (llmgw does not "
                                 "replace a path named there)",
                          path=path, origin=ENGINE_FROM_CONFIG)

    async def probe(self) -> EngineInfo:
        """Returns the last proof's result while the file is unchanged; "checking" before the
        first proof or after the file changed (cheap: one stat)."""
        if self._proof is not None and _signature(self.path) == self._proved_signature:
            return self._info(self._proof)
        return self._info(None)

    async def prove(self) -> EngineInfo:
        """Runs the version check (bounded by ``timeout``), remembers it, logs the outcome and
        returns what :meth:`probe` will answer until the file changes."""
        signature = _signature(self.path)
        proof = await prove(self.name, self.path, self.timeout)
        if proof != self._proof:
            if proof.ok:
                log.info("engines: %s %s from agent.yaml (%s) runs", self.name, proof.version, self.path)
            else:
                log.warning("engines: %s from agent.yaml (%s = %s) is not usable: %s",
                            self.name, self.setting, self.path, proof.reason)
        self._proof, self._proved_signature = proof, signature
        _PROOFS[(self.name, self.path)] = (signature, proof)
        return self._info(proof)

    async def watch(self, report: Callable[[EngineInfo], None], interval: float) -> None:
        """Proves the path now, again every ``interval`` seconds and as soon as the file changes
        (checked every :data:`CHANGE_POLL` seconds: one stat); calls ``report`` with each result.
        Runs until cancelled (the converger runs it for its whole life)."""
        while True:
            report(await self.prove())
            with trio.move_on_after(interval):
                while _signature(self.path) == self._proved_signature:
                    await trio.sleep(CHANGE_POLL)
                report(self._info(None))  # changed: "checking" until proved again

    async def install(self, version: str, progress: object) -> None:
        """Refuses: llmgw never installs over (or beside) a path the operator named. Raises InstallError."""
        raise InstallError(f"{self.name}: agent.yaml names {self.path} ({self.setting}); llmgw does not install "
                           "an engine whose path is named there: install it there yourself, or remove the setting")

    async def check(self) -> str:
        """Runs the version check and returns its output with the path; raises InstallError with the reason."""
        proof = await prove(self.name, self.path, self.timeout)
        if not proof.ok:
            raise InstallError(f"{self.name} at {self.path} ({self.setting} in agent.yaml) is not usable: {proof.reason}")
        return f"{self.name} {proof.version} at {self.path} (named in agent.yaml, {self.setting})\n{proof.output.strip()}"


def configured_installers(paths: Mapping[str, Path]) -> dict[str, ConfiguredInstaller]:
    """Returns ``{engine: ConfiguredInstaller}`` for agent.yaml's ``engines:`` paths."""
    return {engine: ConfiguredInstaller(engine, Path(path)) for engine, path in paths.items()}
