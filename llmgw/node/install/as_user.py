"""Engine installs, engine checks and the training toolkit's installs run as the engines' user.

An agent running as root never installs an engine as root: whatever an install downloads,
unpacks, builds or runs (pip resolving packages, a package's build hooks, cmake, the
engine's own ``--version``) runs as the engines' user (:mod:`llmgw.node.engine_user`), in a
child process of its own: ``python -m llmgw.node.install.as_user``, with the request in
:data:`REQUEST_ENV` (an environment variable, readable by that user and root only; a mirror
URL may hold credentials), its home and caches in the engines' home, and only the
directories it writes handed to that user first (:func:`~llmgw.node.engine_user.hand_over`:
the engine's own directory under the agent's ``install_dir`` and ``cache_dir``, such as
``<install_dir>/llama.cpp``; never those directories themselves, which an operator may share
with other software). It prints one JSON object per line:
``{"progress": "..."}`` per step, then ``{"result": "..."}`` (exit status 0) or
``{"error": "..."}`` (exit status 1).

:func:`as_engine_user` wraps an agent's installers so that :class:`~llmgw.node.install.Converger`
drives them unchanged: probes (cheap marker reads) stay in the agent; ``install`` and
``check`` go to the child. The user is looked up for every call, so one created after the
agent started is used at once, and one that does not exist fails the install with that
reason: nothing falls back to root. Cancelling a call stops the child's whole process group
(SIGTERM, which cancels the install so it removes its scratch directory, then SIGKILL after
:data:`STOP_GRACE`).

Engines named by path in agent.yaml (:mod:`llmgw.node.install.configured`) are not wrapped:
the agent never installs them, and their checks run the operator's own files.
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

import trio

from llmgw.node.child import run_reporting_child
from llmgw.node.engine_user import EngineUserError, hand_over, home_env, prepare_home, resolve
from llmgw.node.engines import base_environment, llmgw_pythonpath
from llmgw.node.install import InstallError, Installer, InstallSettings, Progress
from llmgw.spec import EngineInfo
from llmgw.trioutil import unwrap_single_group

__all__ = ["INSTALL_ENV", "REQUEST_ENV", "STOP_GRACE", "UserInstaller", "as_engine_user", "run_as_engine_user"]

#: Where the child finds its request (JSON): the environment, not argv, since /proc/PID/cmdline
#: is readable by every user and a mirror URL or index may carry credentials.
REQUEST_ENV = "LLMGW_INSTALL_REQUEST"
#: Seconds a stopped install has between SIGTERM and SIGKILL: it removes its scratch
#: directory (a half-built environment of tens of thousands of files) before it exits.
STOP_GRACE = 60.0
#: What an install needs of the agent's environment beyond what engines inherit: proxies,
#: CA bundles, pip's own settings, the engines root override. Nothing else of the agent's
#: (its secrets, HF_TOKEN) reaches the child.
INSTALL_ENV = ("http_proxy", "https_proxy", "no_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
               "ALL_PROXY", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "PIP_*", "LLMGW_ENGINES_DIR")


def settings_to_json(settings: InstallSettings) -> dict[str, Any]:
    """Returns ``settings`` as JSON-able data (:func:`settings_from_json` reads it back)."""
    return {"install_dir": str(settings.install_dir), "cache_dir": str(settings.cache_dir),
            "url_templates": dict(settings.url_templates), "pypi_index": settings.pypi_index,
            "has_nvidia_gpu": settings.has_nvidia_gpu,
            "engine_paths": {name: str(path) for name, path in settings.engine_paths.items()}}


def settings_from_json(data: Mapping[str, Any]) -> InstallSettings:
    """Returns the :class:`InstallSettings` :func:`settings_to_json` wrote."""
    return InstallSettings(install_dir=Path(data["install_dir"]), cache_dir=Path(data["cache_dir"]),
                           url_templates=data["url_templates"], pypi_index=data["pypi_index"],
                           has_nvidia_gpu=bool(data["has_nvidia_gpu"]),
                           engine_paths={name: Path(path) for name, path in data["engine_paths"].items()})


def child_environment(home: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Returns the child's environment: what engines inherit of ``environ`` (default: the
    agent's), what installs need of it (:data:`INSTALL_ENV`), the engines' home and caches
    (:func:`~llmgw.node.engine_user.home_env`), and a PYTHONPATH that finds this llmgw."""
    environ = os.environ if environ is None else environ
    env = base_environment(environ)
    env.update({key: value for key, value in environ.items()
                if any(fnmatch.fnmatchcase(key, pattern) for pattern in INSTALL_ENV)})
    env.update(home_env(home))
    env["PYTHONPATH"] = llmgw_pythonpath(environ=environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def run_as_engine_user(request: Mapping[str, Any], *, user_name: str, home: Path, writes: Sequence[Path],
                             progress: Progress, what: str) -> str:
    """Runs ``request`` (an action of :data:`ACTIONS` and its fields) in the child as the
    engines' user ``user_name`` and returns its result text.

    First hands ``writes`` (the directories the action writes into) and ``home`` to that
    user. ``progress`` gets each step the child reports. ``what`` names the work in errors
    ("installing vllm 0.32.0"). Raises :class:`InstallError`: the user does not exist (or is
    root), a directory cannot be handed over, the child cannot start, or it failed (its own
    sentence, else its exit status and last stderr lines). Cancellation stops the child's
    process group and waits for it.
    """
    try:
        user = await trio.to_thread.run_sync(resolve, user_name)
    except EngineUserError as exc:
        raise InstallError(f"{what} as the engines' user: {exc}") from None
    if user is None:
        raise InstallError(f"{what}: no engines' user is configured to run it as")
    try:
        await trio.to_thread.run_sync(prepare_home, home, user)
        for directory in writes:
            await trio.to_thread.run_sync(hand_over, directory, user)
    except OSError as exc:
        raise InstallError(f"{what}: cannot hand {exc.filename or 'a directory'} to the engines' user "
                           f"{user.name}: {exc.strerror or exc}") from None
    outcome: dict[str, Any] = {}

    def on_stdout(raw: bytes) -> None:
        try:
            line = json.loads(raw)
        except ValueError:
            return  # a library's own print: not a report
        if not isinstance(line, dict):
            return
        if "progress" in line:
            progress(str(line["progress"]))
        elif "result" in line or "error" in line:
            outcome.update(line)

    env = child_environment(home)
    env[REQUEST_ENV] = json.dumps(dict(request))
    try:
        ended = await run_reporting_child([sys.executable, "-m", __name__], env=env, cwd=home, on_stdout=on_stdout,
                                          stop_grace=STOP_GRACE, user=user)
    except PermissionError:
        raise InstallError(f"{what}: the engines' user {user.name} cannot run llmgw's Python ({sys.executable}): "
                           "install llmgw where other users can read it (`llmgw agent join --release-root "
                           "/opt/llmgw` lays it out so), or set engine_user: \"\" in agent.yaml") from None
    except OSError as exc:
        raise InstallError(f"{what}: cannot start {sys.executable} as {user.name}: {exc}") from None
    if ended.code == 0 and "result" in outcome:
        return str(outcome["result"])
    if "error" in outcome:
        raise InstallError(str(outcome["error"]))
    tail = "\n".join(ended.stderr[-12:]) or "(nothing on stderr)"
    raise InstallError(f"{what} as {user.name} ended with exit status {ended.code}; its last output:\n{tail}")


class UserInstaller:
    """An :class:`~llmgw.node.install.Installer` whose ``install`` and ``check`` run as the
    engines' user (:func:`run_as_engine_user`); ``probe`` runs in the agent."""

    def __init__(self, inner: Installer, settings: InstallSettings, user_name: str, home: Path) -> None:
        self.inner = inner
        self.name = inner.name
        self.default_version = inner.default_version
        self.settings = settings
        self.user_name = user_name
        self.home = home

    async def probe(self) -> EngineInfo:
        """Returns the inner installer's probe (it reads markers; nothing runs)."""
        return await self.inner.probe()

    async def install(self, version: str, progress: Progress) -> None:
        """Installs ``version`` as the engines' user; raises :class:`InstallError`."""
        await self._run("install", version, progress, f"installing {self.name} {version}")

    async def check(self) -> str:
        """Returns the engine's check output, run as the engines' user; raises :class:`InstallError`."""
        return await self._run("check", "", lambda _: None, f"checking {self.name}")

    async def _run(self, action: str, version: str, progress: Progress, what: str) -> str:
        request = {"action": action, "engine": self.name, "version": version,
                   "settings": settings_to_json(self.settings)}
        return await run_as_engine_user(request, user_name=self.user_name, home=self.home,
                                        writes=(self.settings.install_dir / self.name, self.settings.cache_dir / self.name),
                                        progress=progress, what=what)


def as_engine_user(installers: Mapping[str, Installer], settings: InstallSettings, user_name: str,
                   home: Path) -> dict[str, Installer]:
    """Returns ``installers`` with those that install into ``settings``' directories wrapped in
    :class:`UserInstaller` (the simulator, built in, and engines agent.yaml names by path are
    kept as they are); unchanged when ``user_name`` is "" (engines run as the agent)."""
    if not user_name:
        return dict(installers)
    return {name: installer if name == "sim" or name in settings.engine_paths
            else UserInstaller(installer, settings, user_name, home)
            for name, installer in installers.items()}


# -- the child ---------------------------------------------------------------------------------


def _report(**line: Any) -> None:
    print(json.dumps(line), flush=True)


def _installer(request: Mapping[str, Any]) -> Installer:
    from llmgw.node.install import build_installers

    found = build_installers(settings_from_json(request["settings"]))
    try:
        return found[request["engine"]]
    except KeyError:
        raise InstallError(f"this llmgw has no installer for {request['engine']!r}") from None


async def _install(request: Mapping[str, Any], progress: Progress) -> str:
    installer = _installer(request)
    await installer.install(request["version"], progress)
    return f"{installer.name} {request['version']} installed"


async def _check(request: Mapping[str, Any], progress: Progress) -> str:
    return await _installer(request).check()


async def _overlay(request: Mapping[str, Any], progress: Progress) -> str:
    from llmgw.node.training.overlay import install_overlay

    try:
        overlay = await trio.to_thread.run_sync(
            lambda: install_overlay(Path(request["python"]), Path(request["root"]), progress,
                                    index_url=request.get("index_url", "")))
    except (RuntimeError, OSError) as exc:
        raise InstallError(f"the training overlay cannot be installed: {exc}") from None
    return str(overlay)


async def _sdist(request: Mapping[str, Any], progress: Progress) -> str:
    from llmgw.node.install.llamacpp import fetch_sdist

    return str(await fetch_sdist(Path(request["cache"]), progress))


#: What the child can be asked to do: the request's ``action`` -> its handler, which returns
#: the result text or raises InstallError.
ACTIONS: dict[str, Callable[[Mapping[str, Any], Progress], Awaitable[str]]] = {
    "install": _install, "check": _check, "overlay": _overlay, "sdist": _sdist,
}


async def _child(request: Mapping[str, Any]) -> str:
    """Runs ``request``; a SIGTERM cancels it (so it cleans up) and raises KeyboardInterrupt."""
    handler = ACTIONS[request["action"]]
    stopped = False
    result = ""
    with unwrap_single_group():  # the handler's InstallError reaches main() as itself
        async with trio.open_nursery() as nursery:

            async def stop_on_sigterm() -> None:
                nonlocal stopped
                with trio.open_signal_receiver(signal.SIGTERM) as signals:
                    async for _ in signals:
                        stopped = True
                        nursery.cancel_scope.cancel()

            async def work() -> None:
                nonlocal result
                result = await handler(request, lambda message: _report(progress=message))
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_sigterm)
            nursery.start_soon(work)
    if stopped:
        raise KeyboardInterrupt
    return result


def main() -> int:
    """The child's entry point; returns its exit status (see the module docstring)."""
    try:
        request = json.loads(os.environ[REQUEST_ENV])
        if request.get("action") not in ACTIONS:
            raise ValueError(f"unknown action {request.get('action')!r}")
    except (KeyError, ValueError) as exc:
        _report(error=f"a bad request to {__name__}: {exc}")
        return 2
    try:
        _report(result=trio.run(_child, request))
        return 0
    except InstallError as exc:
        _report(error=str(exc))
    except KeyboardInterrupt:
        _report(error="stopped before it finished")
    except Exception as exc:  # noqa: BLE001 - reported as the bug it is, with its type
        _report(error=f"{type(exc).__name__}: {exc} (a bug in llmgw's installer)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
