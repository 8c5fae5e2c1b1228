"""Which installed engine a node runs: install_dir before the default root, markers checked."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from llmgw.node import install as install_framework
from llmgw.node.engines import node_engines
from llmgw.node.engines.vllm import VllmEngine
from llmgw.node.install import llamacpp, python_env, search_roots
from llmgw.node.install.python_env import SGLANG, VLLM
from llmgw.spec import ENGINE_FROM_CONFIG, ENGINE_INSTALLED


@pytest.fixture(autouse=True)
def no_registered_dirs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install_framework, "INSTALL_DIRS", [])
    monkeypatch.setattr(install_framework, "_ignored_logged", set())


def python_env_at(root: Path, version: str = "0.32.0", *, installed_at: float = 1.0, engine=VLLM) -> Path:  # type: ignore[no-untyped-def]
    """A fake environment as the installer leaves it: bin/python, the lock copy, the marker."""
    gpu = not engine.cpu_package  # SGLang has only a CUDA build
    directory = root / engine.name / f"{engine.variant(gpu)}-{version}"
    (directory / "bin").mkdir(parents=True)
    (directory / "bin" / "python").symlink_to(sys.executable)
    lock = root / f"lock-{version}.txt"
    lock.write_text(f"x=={version} --hash=sha256:00\n")
    python_env.write_marker(directory, engine, version, gpu, lock, module_version=version)
    marker = json.loads((directory / python_env.MARKER).read_text())
    marker["installed_at"] = installed_at
    (directory / python_env.MARKER).write_text(json.dumps(marker))
    return directory


def rewrite_marker(directory: Path, name: str, **changes: object) -> None:
    data = json.loads((directory / name).read_text())
    data.update(changes)
    (directory / name).write_text(json.dumps(data))


# -- the order of roots -------------------------------------------------------------------


def test_search_roots_put_the_agents_install_dirs_before_the_default(tmp_path: Path) -> None:
    default, mine = tmp_path / "default", tmp_path / "mine"
    assert search_roots(default) == [default]
    install_framework.register_install_dir(mine)
    assert search_roots(default) == [mine, default]
    assert search_roots(default, "llama.cpp") == [mine / "llama.cpp", default]
    install_framework.register_install_dir(default)
    assert search_roots(default) == [mine, default], "a root given twice is searched once"


def test_install_dir_wins_over_a_newer_environment_in_the_default_root(tmp_path: Path) -> None:
    mine, default = tmp_path / "mine", tmp_path / "default"
    old = python_env_at(mine, "0.31.0", installed_at=100.0)
    python_env_at(default, "0.32.0", installed_at=200.0)
    assert python_env.find_installed(VLLM, [mine, default])[0] == old  # type: ignore[index]
    # The default root counts only when install_dir has none.
    assert python_env.find_installed(VLLM, [tmp_path / "empty", default])[0].parent.parent == default  # type: ignore[index]


def test_within_one_root_the_most_recently_installed_wins(tmp_path: Path) -> None:
    python_env_at(tmp_path, "0.31.0", installed_at=300.0)
    python_env_at(tmp_path, "0.32.0", installed_at=200.0)
    found = python_env.find_installed(VLLM, [tmp_path])
    assert found is not None and found[1]["version"] == "0.31.0"


def test_the_adapter_reports_the_python_it_runs_and_where_it_came_from(tmp_path: Path) -> None:
    directory = python_env_at(tmp_path)
    info = VllmEngine(roots=[tmp_path]).probe()
    assert info.installed and info.origin == ENGINE_INSTALLED
    assert info.path == str(directory / "bin" / "python")


# -- markers that do not match their directory --------------------------------------------


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"engine": "sglang"}, "its marker is for engine 'sglang', not 'vllm'"),
        ({"version": ""}, "its marker names no version"),
        ({"version": "0.33.0"}, "its marker says cpu-0.33.0, but the directory is named cpu-0.32.0"),
        ({"variant": "tpu"}, "its marker says tpu-0.32.0, but the directory is named cpu-0.32.0"),
        ({"lock_sha256": "0" * 64}, "does not match the marker's lock_sha256 (changed after the install)"),
    ],
)
def test_a_marker_that_does_not_match_is_ignored_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: dict, reason: str
) -> None:
    directory = python_env_at(tmp_path)
    rewrite_marker(directory, python_env.MARKER, **change)
    with caplog.at_level(logging.WARNING, logger="llmgw.node.install"):
        assert python_env.find_installed(VLLM, [tmp_path]) is None
        assert python_env.find_installed(VLLM, [tmp_path]) is None
    lines = [r.getMessage() for r in caplog.records if str(directory) in r.getMessage()]
    assert len(lines) == 1, "one line per directory and reason, not one per probe"
    assert reason in lines[0] and "reinstall it" in lines[0]


def test_a_changed_lock_copy_and_a_missing_python_are_ignored(tmp_path: Path) -> None:
    directory = python_env_at(tmp_path)
    assert python_env.find_installed(VLLM, [tmp_path]) is not None
    (directory / python_env.ENV_LOCK_COPY).write_text("tampered\n")
    assert python_env.find_installed(VLLM, [tmp_path]) is None
    other = python_env_at(tmp_path / "b")
    (other / "bin" / "python").unlink()
    assert python_env.marker_problem(other, VLLM, json.loads((other / python_env.MARKER).read_text())) == (
        f"{other / 'bin' / 'python'} is missing")


def test_an_environment_of_another_engine_does_not_count(tmp_path: Path) -> None:
    python_env_at(tmp_path, engine=SGLANG)
    (tmp_path / "sglang").rename(tmp_path / "vllm")  # an SGLang environment where vLLM's would be
    assert python_env.find_installed(VLLM, [tmp_path]) is None


# -- llama.cpp ----------------------------------------------------------------------------

VERSION_LINE = "version: 0.5.0-dev (build 11312, commit 0c1e570)"


def llama_at(root: Path, name: str, source: str, *, version_line: str = VERSION_LINE, binary: str = "bin/llama-server",
             version: str = llamacpp.DEFAULT_VERSION, installed_at: float = 1.0) -> Path:
    directory = root / name
    (directory / "bin").mkdir(parents=True)
    server = directory / "bin" / "llama-server"
    server.write_text("#!/bin/sh\necho 'version: 0.5.0-dev (build 11312, commit 0c1e570)'\n")
    server.chmod(0o755)
    (directory / llamacpp.MARKER).write_text(json.dumps({
        "version": version, "version_line": version_line, "binary": binary,
        "source": source, "installed_at": installed_at,
    }))
    return directory


def test_llamacpp_install_dir_wins_even_over_a_source_build_in_the_default_root(tmp_path: Path) -> None:
    mine, default = tmp_path / "mine", tmp_path / "default"
    archive = llama_at(mine, "b11312-ubuntu-x64", "https://mirror/x.tar.gz")
    llama_at(default, "b11312-cpu-615fe45f", "sdist")
    found = llamacpp.find_installed([mine, default])
    assert found is not None and found.directory == archive
    # Within one root a source build wins over an archive.
    sdist = llama_at(mine, "b11312-cpu-615fe45f", "sdist")
    found = llamacpp.find_installed([mine, default])
    assert found is not None and found.directory == sdist


async def test_llamacpp_the_version_installed_last_is_the_one_probed_and_run(tmp_path: Path) -> None:
    # server.yaml asked for b12000 after b11312 was built: the probe must report it (or the
    # converger installs it again forever) and the adapter must run it.
    llama_at(tmp_path, "b11312-cpu-615fe45f", "sdist")
    newer = llama_at(tmp_path, "b12000-ubuntu-x64", "https://mirror/x.tar.gz", version="b12000",
                     version_line="version: 1.0 (build 12000, commit abc)", installed_at=2.0)
    found = llamacpp.find_installed([tmp_path])
    assert found is not None and found.directory == newer and found.version == "b12000"
    assert (await llamacpp.LlamaCppInstaller(tmp_path).probe()).version == "b12000"
    pinned = llamacpp.find_installed([tmp_path], llamacpp.DEFAULT_VERSION)  # what an install of b11312 finds
    assert pinned is not None and pinned.source == "sdist"


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"version_line": "version: 0.5.0-dev (build 9999, commit abc)"},
         "its marker says b11312 but the binary said 'version: 0.5.0-dev (build 9999, commit abc)' at install"),
        ({"binary": "../../elsewhere/llama-server"}, "its marker names a binary outside the directory"),
        ({"binary": "bin/missing"}, "is missing or not executable"),
        ({"version_line": ""}, "its marker lacks version_line"),
    ],
)
def test_llamacpp_marker_that_does_not_match_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kwargs: dict, reason: str
) -> None:
    directory = llama_at(tmp_path, "b11312-cpu-615fe45f", "sdist", **kwargs)
    with caplog.at_level(logging.WARNING, logger="llmgw.node.install"):
        assert llamacpp.find_installed([tmp_path]) is None
    assert any(reason in r.getMessage() and str(directory) in r.getMessage() for r in caplog.records)


def test_a_named_path_is_what_the_adapters_run_even_with_an_install_present(tmp_path: Path) -> None:
    install_framework.register_install_dir(tmp_path)
    python_env_at(tmp_path)
    llama_at(tmp_path / "llama.cpp", "b11312-cpu-615fe45f", "sdist")
    named = {"vllm": Path("/opt/vllm/bin/python"), "llama.cpp": Path("/opt/llama/llama-server"),
             "sglang": Path("/opt/sglang/bin/python")}
    engines = node_engines(None, named)
    assert engines["vllm"].python() == "/opt/vllm/bin/python"  # type: ignore[attr-defined]
    assert engines["sglang"].python() == "/opt/sglang/bin/python"  # type: ignore[attr-defined]
    assert engines["llama.cpp"].argv(_llama_spec(), "h", 1)[0] == "/opt/llama/llama-server"
    info = engines["vllm"].probe()
    assert not info.installed and info.origin == ENGINE_FROM_CONFIG and "not usable" in info.detail
    # Without a named path the installed ones run.
    plain = node_engines(None, {})
    assert plain["llama.cpp"].argv(_llama_spec(), "h", 1)[0].startswith(str(tmp_path))


def _llama_spec():  # type: ignore[no-untyped-def]
    from llmgw.spec import ShardSpec

    return ShardSpec(id="s1", model="m", engine="llama.cpp", source="/models/m.gguf")
