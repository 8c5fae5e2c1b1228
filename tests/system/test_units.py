"""The systemd units llmgw ships, as `server join`/`agent join` install them, pass `systemd-analyze verify`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.cli.units import render_unit
from llmgw.config.defaults import DEFAULT_AGENT_STATE_DIR

UNITS = {
    "llmgw-server.service": dict(daemon="server", config=Path("/etc/llmgw/server.yaml"), user="root",
                                 state_dir=Path("/var/lib/llmgw")),
    "llmgw-agent.service": dict(daemon="agent", config=Path("/etc/llmgw/agent.yaml"), user="root",
                                state_dir=DEFAULT_AGENT_STATE_DIR, default_state_dir=DEFAULT_AGENT_STATE_DIR),
}


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_each_unit_as_installed_passes_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (Debian's systemd package has it)")
    path = tmp_path / unit
    path.write_text(render_unit(unit, **UNITS[unit]))  # type: ignore[arg-type]
    out = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{unit}:" not in out.stderr, out.stderr  # no warning about the unit itself
    text = path.read_text()
    assert f"ExecStart={Path(sys.executable).parent / 'llmgw'} {UNITS[unit]['daemon']} --config " in text or \
        f"ExecStart={sys.executable} -m llmgw {UNITS[unit]['daemon']} --config " in text
    if unit == "llmgw-agent.service":  # engines outlive the agent; they pin memory
        assert "KillMode=process\n" in text and "LimitMEMLOCK=infinity\n" in text
