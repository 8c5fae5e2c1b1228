"""Where `llmgw ctl` finds its cluster, and what it says when that cluster is gone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from llmgw.cli.pki import ADMIN_DIR, ensure_cluster_pki


def ctl(*args: str, data_home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LLMGW_SERVER", "LLMGW_TLS_DIR")}
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", *args], capture_output=True, text=True, timeout=60,
                          env={**env, "XDG_DATA_HOME": str(data_home)})


def test_without_a_cluster_ctl_says_what_to_pass(tmp_path: Path) -> None:
    out = ctl("nodes", data_home=tmp_path)
    assert out.returncode == 1 and "which cluster? pass --server HOST:PORT and --tls-dir DIR" in out.stderr


def test_a_stale_up_json_is_named_with_how_to_start_the_cluster(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    up = tmp_path / "llmgw" / "up" / "up.json"
    up.parent.mkdir(parents=True)
    ensure_cluster_pki(tmp_path / "pki", server_name="gone")  # an admin certificate that would be let in
    up.write_text(json.dumps({"rpc": f"127.0.0.1:{port}", "tls_dir": str(tmp_path / "pki" / ADMIN_DIR)}))
    out = ctl("nodes", data_home=tmp_path)
    assert out.returncode == 1
    assert f"cannot reach 127.0.0.1:{port}" in out.stderr
    assert f"the local cluster {up} names is not running: start it with `llmgw up`" in out.stderr
