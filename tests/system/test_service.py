"""``llmgw service``: this machine's units through systemctl, and a clear error without systemd.

systemd cannot run in this test's machine (a container without it as PID 1), so the second
test puts a stand-in ``systemctl`` first on PATH that answers in systemctl's own formats
(``list-unit-files --no-legend --plain``: unit, state, preset; ``show --property``:
KEY=VALUE lines) and writes down what it was asked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.system.harness import LLMGW

STAND_IN = r"""#!/bin/sh
echo "$*" >> "$CALLS"
case "$1" in
  is-system-running) echo running ;;
  list-unit-files) printf 'llmgw-server.service enabled enabled\nllmgw-agent.service enabled enabled\n' ;;
  show) printf 'ActiveState=active\nSubState=running\nMainPID=4242\nActiveEnterTimestamp=Fri 2026-12-04 09:00:00 UTC\n' ;;
  start|stop|restart|daemon-reload|enable) ;;
  *) echo "unknown command $1" >&2; exit 1 ;;
esac
"""


def llmgw_service(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMGW, "service", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_without_systemd_it_says_so_and_what_to_do() -> None:
    systemctl = shutil.which("systemctl")
    if systemctl is not None:
        state = subprocess.run([systemctl, "is-system-running"], capture_output=True, text=True, timeout=30)
        if state.stdout.strip() not in ("offline", ""):
            pytest.skip(f"systemd runs on this machine ({state.stdout.strip()}): the error cannot be seen here")
    out = llmgw_service("status")
    assert out.returncode == 1
    assert "systemd is not running on this machine" in out.stderr and "llmgw server" in out.stderr


def test_it_drives_the_installed_units_in_order(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(STAND_IN)
    (bin_dir / "systemctl").chmod(0o755)
    calls = tmp_path / "calls"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls)}

    status = llmgw_service("status", env=env)
    assert status.returncode == 0, status.stderr
    assert "llmgw-server.service: active (running), pid 4242" in status.stdout
    for action in ("start", "stop", "restart"):
        calls.write_text("")
        out = llmgw_service(action, env=env)
        assert out.returncode == 0, out.stderr
        acted = [line for line in calls.read_text().splitlines() if line.split()[0] == action]
        units = ["llmgw-server.service", "llmgw-agent.service"]
        assert acted == [f"{action} {u}" for u in (reversed(units) if action == "stop" else units)]
    out = llmgw_service("restart", "--unit", "agent", env=env)
    assert out.returncode == 0 and out.stdout == "llmgw-agent.service: restart done\n"
    missing = llmgw_service("start", "--unit", "gateway", env=env)
    assert missing.returncode == 1 and "llmgw-gateway.service is not installed here" in missing.stderr
