"""The systemd units llmgw ships, as `server join`/`agent join`/`firewall sync --install` install them,
pass `systemd-analyze verify`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.cli.firewall import SYNC_UNITS, render_sync_unit
from llmgw.cli.units import render_unit
from llmgw.config.defaults import DEFAULT_AGENT_STATE_DIR

UNITS = {
    "llmgw-server.service": dict(daemon="server", config=Path("/etc/llmgw/server.yaml"), user="root",
                                 state_dir=Path("/var/lib/llmgw")),
    "llmgw-agent.service": dict(daemon="agent", config=Path("/etc/llmgw/agent.yaml"), user="root",
                                state_dir=DEFAULT_AGENT_STATE_DIR, default_state_dir=DEFAULT_AGENT_STATE_DIR),
}


def systemd_analyze() -> str:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (Debian's systemd package has it)")
    return analyze


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_each_unit_as_installed_passes_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    analyze = systemd_analyze()
    path = tmp_path / unit
    path.write_text(render_unit(unit, **UNITS[unit]))  # type: ignore[arg-type]
    out = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{unit}:" not in out.stderr, out.stderr  # no warning about the unit itself
    text = path.read_text()
    assert f"ExecStart={Path(sys.executable).parent / 'llmgw'} {UNITS[unit]['daemon']} --config " in text or \
        f"ExecStart={sys.executable} -m llmgw {UNITS[unit]['daemon']} --config " in text
    if unit == "llmgw-agent.service":  # engines outlive the agent; they pin memory; 75 starts an upgrade
        assert "KillMode=process\n" in text and "LimitMEMLOCK=infinity\n" in text
        assert "RestartForceExitStatus=75\n" in text


def test_the_firewall_sync_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = systemd_analyze()
    plan = Path("/var/lib/llmgw/firewall.json")
    for unit in SYNC_UNITS:
        (tmp_path / unit).write_text(render_sync_unit(unit, plan))
    out = subprocess.run([analyze, "verify", *(str(tmp_path / u) for u in SYNC_UNITS)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "llmgw-firewall-sync" not in out.stderr, out.stderr
    assert f"PathChanged={plan}\n" in (tmp_path / "llmgw-firewall-sync.path").read_text()
    assert f"firewall sync --file {plan}\n" in (tmp_path / "llmgw-firewall-sync.service").read_text()
