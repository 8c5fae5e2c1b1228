"""Engines named in agent.yaml: proven to run with a deadline, reported with their version, never replaced."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pytest
import trio

from llmgw.node.install import Converger, InstallError, InstallSettings, build_installers, configured
from llmgw.node.install.configured import ConfiguredInstaller, prove
from llmgw.spec import ENGINE_FROM_CONFIG, EngineInfo

#: Seconds a test waits for the converger to report something (a bound, not a timing).
WAIT = 60.0

LLAMA_VERSION = "version: 0.5.0-dev (build 11312, commit 0c1e570)"


def script(path: Path, body: str, mode: int = 0o755) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(mode)
    return path


def not_a_program(path: Path) -> Path:
    """An executable file the kernel cannot run (a truncated ELF header)."""
    path.write_bytes(b"\x7fELF\x00junk")
    path.chmod(0o755)
    return path


def fake_llama_server(tmp_path: Path) -> Path:
    """Prints what llama-server --version prints (on stderr, as llama-server does)."""
    return script(tmp_path / "bin" / "llama-server", f"echo '{LLAMA_VERSION}' >&2\necho 'built with GNU' >&2")


def fake_python(tmp_path: Path, module: str | None, version: str = "9.9.1") -> Path:
    """A python whose path holds ``module`` (with ``__version__``, logging at import and at
    exit as vLLM does), or none."""
    site = tmp_path / "site"
    site.mkdir(parents=True, exist_ok=True)
    if module:
        (site / module).mkdir()
        (site / module / "__init__.py").write_text(
            "import atexit, sys\n"
            "print('INFO 12-03 19:55:15 [importing.py:44] Triton is not installed; falling back')\n"
            "atexit.register(lambda: print('WARNING shutting down', file=sys.stderr))\n"
            f"__version__ = {version!r}\n")
    return script(tmp_path / "env" / "bin" / "python", f'PYTHONPATH={site} exec {sys.executable} "$@"')


# -- the proof ----------------------------------------------------------------------------


async def test_llama_server_version_is_its_build(tmp_path: Path) -> None:
    proof = await prove("llama.cpp", fake_llama_server(tmp_path))
    assert proof.ok and proof.version == "b11312" and LLAMA_VERSION in proof.output


async def test_vllm_version_is_what_the_import_prints(tmp_path: Path) -> None:
    proof = await prove("vllm", fake_python(tmp_path, "vllm"))
    assert proof.ok and proof.version == "9.9.1"


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: p / "nope" / "llama-server", "does not exist"),
        (lambda p: p, "is a directory, not a program"),
        (lambda p: script(p / "ls", "echo hi", mode=0o644), "is not executable by this user"),
        (lambda p: script(p / "ls", "echo 'not llama'"), "`{path} --version` printed no version: not llama"),
        (lambda p: script(p / "ls", "echo 'error while loading shared libraries' >&2; exit 127"),
         "`{path} --version` failed (exit status 127): error while loading shared libraries"),
        (lambda p: not_a_program(p / "llama-server"), "cannot be run: Exec format error"),
    ],
)
async def test_a_llama_server_that_does_not_run_says_why(tmp_path: Path, make: Callable[[Path], Path], reason: str) -> None:
    path = make(tmp_path)
    proof = await prove("llama.cpp", path)
    assert not proof.ok and reason.format(path=path) in proof.reason, proof.reason


async def test_a_python_without_the_engine_says_so(tmp_path: Path) -> None:
    path = fake_python(tmp_path, None)
    proof = await prove("vllm", path)
    assert not proof.ok
    assert proof.reason.startswith(f"`{path} -c 'import vllm'` failed (exit status 1): ")
    assert "No module named 'vllm'" in proof.reason


async def test_a_check_that_hangs_ends_at_the_deadline(tmp_path: Path) -> None:
    path = script(tmp_path / "llama-server", "exec sleep 600")
    proof = await prove("llama.cpp", path, timeout=0.2)
    assert not proof.ok and proof.reason == f"`{path} --version` did not finish within 0.2 s"


# -- the installer and the converger ------------------------------------------------------


async def test_named_engine_replaces_the_installer_and_is_reported_with_its_path(tmp_path: Path) -> None:
    server = fake_llama_server(tmp_path)
    installers = build_installers(InstallSettings(install_dir=tmp_path / "i", cache_dir=tmp_path / "c",
                                                  engine_paths={"llama.cpp": server}))
    named = installers["llama.cpp"]
    assert isinstance(named, ConfiguredInstaller)
    assert not isinstance(installers["vllm"], ConfiguredInstaller), "only the engines named are replaced"
    checking = await named.probe()
    assert not checking.installed and checking.detail.startswith(f"checking that {server}")
    proven = await named.prove()  # type: ignore[attr-defined]
    assert proven == EngineInfo("llama.cpp", installed=True, version="b11312",
                                detail=f"{server}, named in agent.yaml (engines.llama.cpp.server)",
                                path=str(server), origin=ENGINE_FROM_CONFIG)
    assert await named.probe() == proven, "probe answers from the proof while the file is unchanged"
    assert "b11312 at" in await named.check()
    with pytest.raises(InstallError, match="llmgw does not install an engine whose path is named there"):
        await named.install("b11312", lambda _: None)


async def test_converger_proves_in_the_background_and_never_installs_a_named_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(configured, "CHANGE_POLL", 0.05)
    server = tmp_path / "llama-server"  # not there yet: the operator has not installed it
    named = ConfiguredInstaller("llama.cpp", server)
    converger = Converger({"llama.cpp": named}, backoff_min=0.01)

    async def info_until(done: Callable[[EngineInfo], bool]) -> EngineInfo:
        seen = converger.version
        with trio.fail_after(WAIT):
            while True:
                infos = {e.name: e for e in converger.engines()}
                if "llama.cpp" in infos and done(infos["llama.cpp"]):
                    return infos["llama.cpp"]
                seen = await converger.wait_changed(seen)

    async with trio.open_nursery() as nursery:
        await nursery.start(converger.run)
        converger.want({"llama.cpp": "b11312"})  # server.yaml asks for it: still never installed
        broken = await info_until(lambda e: "not usable" in e.detail)
        assert not broken.installed and not broken.installable and broken.origin == ENGINE_FROM_CONFIG
        assert broken.detail == (f"not usable: {server} does not exist; fix engines.llama.cpp.server in agent.yaml "
                                 "(llmgw does not replace a path named there)")
        assert broken.state == "", "nothing is being installed"
        fake_llama_server(tmp_path).rename(server)  # the operator installs it: noticed without a restart
        fixed = await info_until(lambda e: e.installed)
        assert fixed.version == "b11312" and fixed.path == str(server) and fixed.state == ""
        nursery.cancel_scope.cancel()


async def test_the_adapter_runs_the_named_path_and_knows_its_proven_version(tmp_path: Path) -> None:
    from llmgw.node.engines import node_engines

    server = fake_llama_server(tmp_path)
    adapter = node_engines(None, {"llama.cpp": server})["llama.cpp"]
    before = adapter.probe()
    assert (before.installed, before.version, before.origin) == (True, "", ENGINE_FROM_CONFIG)
    await ConfiguredInstaller("llama.cpp", server).prove()
    after = adapter.probe()
    assert (after.installed, after.version, after.path) == (True, "b11312", str(server))
    server.chmod(0o644)  # the file changed since: the proof no longer counts
    assert not adapter.probe().installed


async def test_one_python_named_for_two_engines_is_proven_for_each(tmp_path: Path) -> None:
    """vLLM importable, SGLang not: the proof for one engine never answers for the other."""
    from llmgw.node.engines import node_engines

    python = fake_python(tmp_path, "vllm")
    adapters = node_engines(None, {"vllm": python, "sglang": python})
    await ConfiguredInstaller("vllm", python).prove()
    await ConfiguredInstaller("sglang", python).prove()
    assert adapters["vllm"].probe().version == "9.9.1"
    sglang = adapters["sglang"].probe()
    assert not sglang.installed and "not usable" in sglang.detail
