"""``llmgw service status|start|stop|restart``: this machine's llmgw units, through systemd.

The units are the ones ``systemd/`` ships (``llmgw-server.service``, ``llmgw-agent.service``)
that systemd knows on this machine. Each action runs ``systemctl`` on all of them (or the one
``--unit`` names) and says what it did; where systemd is not running (a container, another
init), it says so and what to do instead, with exit status 1.
"""

from __future__ import annotations

import shutil
import subprocess

import click

from llmgw.cli.output import fail

#: The units llmgw ships, in the order they start (a control plane before its agent).
UNITS = ("llmgw-server.service", "llmgw-agent.service")
#: Bound on one systemctl call: a start or stop waits for the unit (the server's drain is
#: 30 s by default, systemd's stop timeout 90 s).
SYSTEMCTL_TIMEOUT_S = 120.0
_NO_SYSTEMD = ("systemd is not running on this machine ({why}): run `llmgw server` / `llmgw agent` "
               "under the service manager it has, or by hand")


def systemctl(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``systemctl ARGS`` (bounded by :data:`SYSTEMCTL_TIMEOUT_S`) and return what it did;
    exits with a clear error where there is no systemctl or it does not finish."""
    path = shutil.which("systemctl")
    if path is None:
        fail(_NO_SYSTEMD.format(why="no systemctl command"))
    try:
        return subprocess.run([path, *args], capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        fail(f"systemctl {' '.join(args)} did not finish within {SYSTEMCTL_TIMEOUT_S:g}s")


def systemctl_or_fail(*args: str, hint: str = "") -> None:
    """Run ``systemctl ARGS`` (:func:`systemctl`); exit with its error (and ``hint``) when it fails."""
    done = systemctl(*args)
    if done.returncode != 0:
        fail(f"systemctl {' '.join(args)} failed: {(done.stderr or done.stdout).strip()}{hint}")


def require_systemd() -> None:
    """Return when systemd runs this machine; exit with a clear error saying what to do otherwise."""
    running = systemctl("is-system-running")
    state = running.stdout.strip() or running.stderr.strip()
    if state in ("offline", "") or "not been booted with systemd" in running.stderr:
        fail(_NO_SYSTEMD.format(why=state or "systemctl answered nothing"))


def _installed_units(only: str | None) -> list[str]:
    """Returns the llmgw units systemd knows here (``only``: just that one, checked)."""
    require_systemd()
    listed = systemctl("list-unit-files", "--no-legend", "--plain", *UNITS)
    known = [u for u in UNITS if any(line.split()[:1] == [u] for line in listed.stdout.splitlines())]
    if only is not None:
        unit = only if only.endswith(".service") else f"llmgw-{only}.service"
        if unit not in known:
            fail(f"{unit} is not installed here (installed: {', '.join(known) or 'none'}); "
                 "copy it from systemd/ in the llmgw source to /etc/systemd/system/ and run `systemctl daemon-reload`")
        return [unit]
    if not known:
        fail("no llmgw unit is installed here: copy systemd/llmgw-server.service or llmgw-agent.service to "
             "/etc/systemd/system/ and run `systemctl daemon-reload`")
    return known


unit_option = click.option("--unit", "only", default=None, help="server or agent [every llmgw unit installed here].")


@click.group()
def service() -> None:
    """This machine's llmgw units (systemd): status, start, stop, restart."""


@service.command("status")
@unit_option
def service_status(only: str | None) -> None:
    """Whether each llmgw unit here is active, and since when."""
    for unit in _installed_units(only):
        shown = systemctl("show", unit, "--property=ActiveState,SubState,MainPID,ActiveEnterTimestamp")
        props = dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)
        click.echo(f"{unit}: {props.get('ActiveState', '?')} ({props.get('SubState', '?')}), "
                   f"pid {props.get('MainPID', '?')}, since {props.get('ActiveEnterTimestamp') or '-'}")


def _act(action: str, only: str | None) -> None:
    units = _installed_units(only)
    ordered = list(reversed(units)) if action == "stop" else units
    for unit in ordered:
        systemctl_or_fail(action, unit, hint=f" (see `journalctl -u {unit}`)")
        click.echo(f"{unit}: {action} done")


@service.command("start")
@unit_option
def service_start(only: str | None) -> None:
    """Start the llmgw units here (the server before the agent)."""
    _act("start", only)


@service.command("stop")
@unit_option
def service_stop(only: str | None) -> None:
    """Stop the llmgw units here (engines keep running: the next agent adopts them)."""
    _act("stop", only)


@service.command("restart")
@unit_option
def service_restart(only: str | None) -> None:
    """Restart the llmgw units here (engines keep serving)."""
    _act("restart", only)
