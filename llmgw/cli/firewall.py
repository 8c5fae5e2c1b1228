"""``llmgw firewall sync``: apply llmgw's nft table on this machine from a control plane's
``firewall.json`` (llmgw/control/firewall_file.py), as root.

``--install`` sets up ``llmgw-firewall-sync.path`` and ``.service`` (shipped in systemd/), so
every rewrite of the file by the control plane is applied from then on; for a machine
installed before they shipped. Agents apply their own table themselves (they run as root).
"""

from __future__ import annotations

from pathlib import Path

import click

from llmgw.cli.output import fail
from llmgw.cli.units import DEFAULT_STATE_DIR, UNIT_DIR, fit_unit, llmgw_command
from llmgw.nftables import FirewallError, apply, read_plan

#: The units --install sets up (the path unit starts the service).
SYNC_UNITS = ("llmgw-firewall-sync.service", "llmgw-firewall-sync.path")
DEFAULT_FILE = DEFAULT_STATE_DIR / "firewall.json"


def render_sync_unit(unit: str, plan_file: Path) -> str:
    """Return the shipped ``unit`` fitted to this machine: this llmgw, ``plan_file``."""
    return fit_unit(unit, {"ExecStart": f"{llmgw_command()} firewall sync --file {plan_file}",
                           "PathChanged": str(plan_file)})


@click.group()
def firewall() -> None:
    """llmgw's nft table on this machine (a control plane's; agents keep their own)."""


@firewall.command()
@click.option("--file", "plan_file", type=click.Path(path_type=Path, dir_okay=False), default=DEFAULT_FILE,
              show_default=True, help="The firewall.json the control plane writes in its state directory.")
@click.option("--install", is_flag=True, help="Also install and start llmgw-firewall-sync.path and .service.")
@click.option("--unit-dir", type=click.Path(path_type=Path, file_okay=False), default=UNIT_DIR, show_default=True,
              help="Where --install writes the units.")
def sync(plan_file: Path, install: bool, unit_dir: Path) -> None:
    """Apply FILE to llmgw's nft table now (as root); with --install, on every change from now on."""
    if install:
        from llmgw.cli.service import require_systemd, systemctl_or_fail

        require_systemd()
        for unit in SYNC_UNITS:
            try:
                unit_dir.mkdir(parents=True, exist_ok=True)
                (unit_dir / unit).write_text(render_sync_unit(unit, plan_file))
            except OSError as exc:
                fail(f"cannot write {unit_dir / unit}: {exc} (run as root)")
        systemctl_or_fail("daemon-reload")
        systemctl_or_fail("enable", "--now", SYNC_UNITS[1])
        click.echo(f"installed {', '.join(SYNC_UNITS)} in {unit_dir}: {plan_file} is applied on every change")
    if not plan_file.exists():
        click.echo(f"nothing to apply yet: {plan_file} does not exist (the control plane writes it when it starts)")
        return
    try:
        plan = read_plan(plan_file)
        apply(plan)
    except (ValueError, OSError, FirewallError) as exc:
        fail(f"firewall not applied: {exc}")
    if not plan.enabled:
        click.echo("llmgw's nft table removed (firewall.enabled is false)")
    elif not plan.ports:
        click.echo("llmgw's nft table applied: no port restricted (firewall.networks is empty)")
    else:
        click.echo(f"llmgw's nft table applied: ports {', '.join(map(str, plan.ports))} reachable from this "
                   f"machine and {', '.join(map(str, plan.peers))}")
