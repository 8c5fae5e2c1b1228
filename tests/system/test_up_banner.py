"""`llmgw up` prints `ctl` lines that work as printed (off PATH too), wherever its state directory is."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.system.harness import LLMGW, Proc, engines_under

pytestmark = pytest.mark.system

#: Seconds for one ctl call against a local cluster (a fresh interpreter on a busy 2-core machine).
CTL_TIMEOUT = 60


async def test_banner_ctl_line_reaches_a_cluster_outside_the_default_state_dir(tmp_path: Path) -> None:
    # The default directory (under XDG_DATA_HOME) holds no cluster: ctl must be told where this one is.
    env = {"XDG_DATA_HOME": str(tmp_path / "xdg")}
    state = tmp_path / "elsewhere"
    up = Proc([*LLMGW, "up", "--engine", "sim", "--state-dir", str(state), "--http-port", "0", "--rpc-port", "0"],
              tmp_path / "up.log", env=env)
    try:
        line = await up.wait_for_line(r"(?m)^\s+(\S*llmgw ctl .*) nodes$")
        words = shlex.split(line.group(1))
        assert "--server" in words and "--tls-dir" in words
        # As printed: `llmgw` where that is this llmgw on PATH, else the path of its script.
        assert words[0] == "llmgw" or Path(words[0]).resolve() == (Path(sys.executable).parent / "llmgw").resolve()
        out = subprocess.run([*words, "--json", "nodes"], capture_output=True, text=True,
                             env={**os.environ, **env}, timeout=CTL_TIMEOUT)
        assert out.returncode == 0, out.stderr
        assert [n["state"] for n in json.loads(out.stdout)] == ["online"]
        up.signal(signal.SIGTERM)
        await up.wait_exit()
        assert engines_under(tmp_path) == []
    finally:
        up.kill()
