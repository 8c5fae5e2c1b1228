"""The SGLang adapter: argv/env and the one-line import probe (its exit status decides)."""

from __future__ import annotations

import re

import sys
from pathlib import Path

from llmgw.node.engine_secret import secret_env
from llmgw.node.engines import ENGINE_PATH
from llmgw.node.engines.sglang import LAUNCHER_MODULE, SglangEngine, import_check, sglang_argv, sglang_env
from llmgw.node.engines.vllm import MultiNode
from llmgw.node.install import python_env
from llmgw.spec import ShardSpec


def spec(*args: str, gpus: tuple[int, ...] = ()) -> ShardSpec:
    return ShardSpec(id="s-1", model="qwen", engine="sglang", source="/w/qwen", args=args, gpus=gpus)


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_argv_and_env() -> None:
    argv = sglang_argv("/e/bin/python", spec("--mem-fraction-static", "0.8", gpus=(1, 2)), "127.0.0.1", 9000)
    assert argv[:3] == ["/e/bin/python", "-m", "sglang.launch_server"]
    assert value(argv, "--model-path") == "/w/qwen" and value(argv, "--served-model-name") == "qwen"
    assert value(argv, "--port") == "9000" and value(argv, "--tp-size") == "2"
    assert argv[-2:] == ["--mem-fraction-static", "0.8"]
    env = sglang_env(spec(gpus=(1, 2)))
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_a_keyed_shard_runs_the_launcher_with_the_secret_in_its_environment_only() -> None:
    key = "sk-shard-secret"
    keyed = ShardSpec(id="s-1", model="qwen", engine="sglang", source="/w/qwen", api_key=key, gpus=(0,))
    argv = sglang_argv("/e/bin/python", keyed, "127.0.0.1", 9000)
    assert argv[:3] == ["/e/bin/python", "-m", LAUNCHER_MODULE]
    assert argv[3:] == sglang_argv("/e/bin/python", spec(gpus=(0,)), "127.0.0.1", 9000)[3:]  # the same args
    assert "--api-key" not in argv and not any(key in a for a in argv)
    env = {**sglang_env(keyed), **secret_env(keyed)}
    assert env["LLMGW_SGLANG_API_KEY"] == key and env["PYTHONPATH"] == ENGINE_PATH
    launcher = Path(ENGINE_PATH, f"{LAUNCHER_MODULE}.py").read_text()
    assert not re.search(r"(import|from) llmgw\b(?!_)", launcher)  # SGLang's Python: no llmgw package
    unkeyed = spec(gpus=(0,))
    assert "PYTHONPATH" not in sglang_env(unkeyed) and secret_env(unkeyed) == {}


def test_multi_node_flags() -> None:
    argv = sglang_argv("py", spec(gpus=(0,)), "h", 1, multinode=MultiNode(2, 1, "10.0.0.1", 5000))
    assert value(argv, "--nnodes") == "2" and value(argv, "--node-rank") == "1"
    assert value(argv, "--dist-init-addr") == "10.0.0.1:5000"


def test_import_check_exit_status_decides(tmp_path: Path) -> None:
    ok = import_check(sys.executable, "json")
    assert ok.ok
    missing = import_check(sys.executable, "no_such_module_llmgw")
    assert not missing.ok and "No module named" in missing.output
    gone = import_check(str(tmp_path / "nope" / "python"))
    assert not gone.ok


def fake_sglang_env(root: Path, importable: bool) -> Path:
    directory = root / "sglang" / "cuda-0.5.6"
    (directory / "bin").mkdir(parents=True)
    site = root / "site"
    site.mkdir()
    if importable:
        (site / "sglang").mkdir()
        (site / "sglang" / "__init__.py").write_text("__version__ = '0.5.6'\n")
    python = directory / "bin" / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    lock = root / "lock.txt"
    lock.write_text("x\n")
    python_env.write_marker(directory, python_env.SGLANG, "0.5.6", True, lock, module_version="")
    return directory


def test_verify_runs_the_import_in_the_environment(tmp_path: Path) -> None:
    assert not SglangEngine(roots=[tmp_path]).probe().installed
    fake_sglang_env(tmp_path, importable=True)
    engine = SglangEngine(roots=[tmp_path])
    assert engine.probe().installed
    info = engine.verify()
    assert info.installed and info.version == "0.5.6"


def test_verify_says_not_installed_when_the_import_fails(tmp_path: Path) -> None:
    fake_sglang_env(tmp_path, importable=False)
    info = SglangEngine(roots=[tmp_path]).verify()
    assert not info.installed and "import sglang failed" in info.detail
