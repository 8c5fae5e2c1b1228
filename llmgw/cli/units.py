"""The systemd units llmgw ships (``systemd/``, package data ``llmgw.systemd``), fitted to
this machine: the llmgw that runs them, the config file, the user and the state directory."""

from __future__ import annotations

import importlib.resources
import sys
from pathlib import Path
from typing import Mapping

from llmgw.releases import CURRENT, find_root

#: Where the shipped units expect the state directory (their ``StateDirectory=llmgw``).
DEFAULT_STATE_DIR = Path("/var/lib/llmgw")
#: Where units are installed on a systemd machine.
UNIT_DIR = Path("/etc/systemd/system")


def llmgw_command(root: Path | None = None) -> str:
    """Returns how to run this llmgw: from a release root (``root``, else the one this process
    runs from), ``ROOT/current/bin/python -m llmgw`` (so an upgrade that switches ``current``
    takes effect at the next start, llmgw/releases.py); else its console script beside the
    interpreter, else ``python -m llmgw``."""
    root = root or find_root()
    if root is not None:
        return f"{root / CURRENT / 'bin' / 'python'} -m llmgw"
    script = Path(sys.executable).parent / "llmgw"
    return str(script) if script.exists() else f"{sys.executable} -m llmgw"


def fit_unit(unit: str, lines: Mapping[str, str | None]) -> str:
    """Returns the shipped ``unit`` with each line whose key is in ``lines`` replaced by
    ``KEY=VALUE`` (None: the line dropped). Raises FileNotFoundError when the package lacks
    the unit (an llmgw installed without its package data)."""
    text = (importlib.resources.files("llmgw.systemd") / unit).read_text()
    out = []
    for line in text.splitlines():
        key = line.split("=", 1)[0]
        if key in lines:
            value = lines[key]
            if value is None:
                continue
            line = f"{key}={value}"
        out.append(line)
    return "\n".join(out) + "\n"


def render_unit(unit: str, *, daemon: str, config: Path, user: str, state_dir: Path,
                default_state_dir: Path = DEFAULT_STATE_DIR, root: Path | None = None) -> str:
    """Returns the shipped ``unit`` (e.g. ``llmgw-server.service``) running ``llmgw DAEMON
    --config CONFIG`` as ``user`` with ``state_dir`` writable (the unit's ``StateDirectory=``
    makes ``default_state_dir``; another one is made by the join), from the release root
    ``root`` (None: the one this process runs from, if any). Raises FileNotFoundError
    when the package lacks the unit (an llmgw installed without its package data)."""
    root = root or find_root()
    lines: dict[str, str | None] = {
        "ExecStart": f"{llmgw_command(root)} {daemon} --config {config}",
        "User": user,
        "Group": user,
        # and the release root, where `ctl upgrade` installs the next release
        "ReadWritePaths": f"{state_dir}" + (f" {root}" if root is not None else ""),
    }
    if state_dir != default_state_dir:  # systemd makes only /var/lib/NAME; another one is made by the join
        lines["StateDirectory"] = lines["StateDirectoryMode"] = None
    return fit_unit(unit, lines)
