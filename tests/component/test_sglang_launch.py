"""llmgw's SGLang launcher, run for real: a keyed shard's secret reaches SGLang's argument parser
(``sys.argv``) but neither the kernel's command line (``/proc/PID/cmdline``, world-readable) nor
the environment SGLang's own processes inherit.

SGLang is not installed here: a fake ``sglang.launch_server`` on the interpreter's path records,
when run as ``__main__``, what the real one would parse (``sys.argv[1:]``), its own
``/proc/self/cmdline``, its environment and a child process's environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.catalog.engine_options import API_KEY_ENV
from llmgw.node.engine_secret import secret_env
from llmgw.node.engines.sglang import LAUNCHER_MODULE, sglang_argv, sglang_env
from llmgw.spec import ShardSpec

pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc")

KEY = "sk-shard-0123456789abcdef"
#: A start of Python and an import of two small modules; minutes means it hangs.
RUN_TIMEOUT = 120.0

FAKE_LAUNCH_SERVER = """\
import json, os, subprocess, sys
if __name__ == "__main__":
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = [a.decode() for a in f.read().split(b"\\0") if a]
    child = subprocess.run([sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"],
                           capture_output=True, text=True, check=True)
    with open("launch.json", "w") as out:
        json.dump({"argv": sys.argv, "cmdline": cmdline, "env": dict(os.environ),
                   "child_env": json.loads(child.stdout), "main": sys.modules["__main__"].__spec__.name}, out)
"""


def fake_sglang_python(tmp_path: Path) -> Path:
    """A python, as in an SGLang environment, whose path also holds the fake ``sglang`` package."""
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("__version__ = '0.5.6'\n")
    (site / "sglang" / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH="$PYTHONPATH:{site}" exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def run_as_the_agent_does(tmp_path: Path, spec: ShardSpec) -> subprocess.CompletedProcess[str]:
    """Runs the adapter's argv with its env and the secret's (as the supervisor composes them)."""
    argv = sglang_argv(str(fake_sglang_python(tmp_path)), spec, "127.0.0.1", 30000)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **sglang_env(spec), **secret_env(spec)}
    return subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT)


def test_the_secret_reaches_sglangs_argv_but_not_the_command_line_or_the_environment(tmp_path: Path) -> None:
    spec = ShardSpec(id="s", model="qwen", engine="sglang", source="/w/qwen", args=("--mem-fraction-static", "0.8"),
                     api_key=KEY)
    done = run_as_the_agent_does(tmp_path, spec)
    assert done.returncode == 0, done.stderr
    seen = json.loads((tmp_path / "launch.json").read_text())
    assert seen["main"] == "sglang.launch_server"  # run as `python -m sglang.launch_server` would be
    assert seen["argv"][-2:] == ["--api-key", KEY] and seen["argv"].count("--api-key") == 1
    assert seen["argv"][seen["argv"].index("--model-path") + 1] == "/w/qwen"
    assert "--mem-fraction-static" in seen["argv"]
    assert LAUNCHER_MODULE in seen["cmdline"] and "--model-path" in seen["cmdline"]  # it is the process's own
    assert not any(KEY in arg for arg in seen["cmdline"])
    assert API_KEY_ENV["sglang"] not in seen["env"] and API_KEY_ENV["sglang"] not in seen["child_env"]
    assert KEY not in json.dumps(seen["env"]) and KEY not in json.dumps(seen["child_env"])


def test_the_launcher_refuses_to_start_without_a_secret(tmp_path: Path) -> None:
    spec = ShardSpec(id="s", model="qwen", engine="sglang", source="/w/qwen", api_key=KEY)
    argv = sglang_argv(str(fake_sglang_python(tmp_path)), spec, "127.0.0.1", 30000)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **sglang_env(spec)}  # the secret left out
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert done.returncode == 2 and API_KEY_ENV["sglang"] in done.stderr
    assert not (tmp_path / "launch.json").exists()


def test_an_unkeyed_shard_runs_sglang_directly(tmp_path: Path) -> None:
    done = run_as_the_agent_does(tmp_path, ShardSpec(id="s", model="qwen", engine="sglang", source="/w/qwen"))
    assert done.returncode == 0, done.stderr
    seen = json.loads((tmp_path / "launch.json").read_text())
    assert "--api-key" not in seen["argv"] and LAUNCHER_MODULE not in seen["cmdline"]
