"""What ``llmgw server join`` and ``llmgw agent join`` share: finding this machine's address,
writing private files, handing the state to the unit's user, installing and starting a unit."""

from __future__ import annotations

import os
import pwd
import shutil
import time
from pathlib import Path

import click

from llmgw.cli.output import fail
from llmgw.cli.units import render_unit
from llmgw.jointoken import JoinToken, parse_token
from llmgw.rpc import net
from llmgw.rpc.tls import CA_CERT_FILE, CERT_FILE, ca_sha256, identity_of


def join_arguments(token: str, servers: str) -> tuple[JoinToken, list[str]]:
    """Returns ``--token`` parsed and ``--server``'s addresses; exits saying which is wrong."""
    try:
        parsed = parse_token(token)
    except ValueError as exc:
        fail(f"--token: {exc}")
    addresses = [a.strip() for a in servers.split(",") if a.strip()]
    if not addresses:
        fail("--server: give at least one control plane address (host:port)")
    return parsed, addresses


def joined_as(tls_dir: Path, pin: str, role: str) -> str | None:
    """Returns this machine's name when the credentials in ``tls_dir`` are of the cluster
    whose CA hashes to ``pin`` (it joined already); None when there are none; exits when
    they are another cluster's or cannot be read. ``role`` words the message ("node")."""
    cert = tls_dir / CERT_FILE
    if not cert.exists():
        return None
    ca = tls_dir / CA_CERT_FILE
    try:
        same = ca.exists() and ca_sha256(ca.read_bytes()) == pin
        name = identity_of(cert.read_bytes()).name
    except (ValueError, PermissionError, OSError) as exc:
        fail(f"{cert} exists but cannot be read ({exc}): move {tls_dir} away to join afresh")
    if not same:
        fail(f"this machine is a {role} of another cluster already ({tls_dir}): move that directory away first "
             "if it should join this one")
    return name


def route_address(server: str) -> str:
    """Returns this machine's address on its route to ``server`` (host:port): a UDP
    "connect" picks it; nothing is sent. Raises OSError (or ValueError for a malformed
    address) when there is none."""
    from llmgw.node.discovery import route_address as address_towards

    host, port = net.split_address(server)
    return address_towards(host, port)


def unit_user(given: str | None) -> str:
    """Returns the user a unit runs as: ``given``, else ``llmgw`` where it exists, else the caller."""
    if given:
        return given
    try:
        pwd.getpwnam("llmgw")
        return "llmgw"
    except KeyError:
        return pwd.getpwuid(os.getuid()).pw_name


def bracket(host: str) -> str:
    """Returns ``host`` as it goes before ``:port`` (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def write_private(path: Path, text: str, *, hint: str) -> None:
    """Write ``text`` to ``path`` (mode 0600), keeping any file there as ``.bak``; exits with
    the reason and ``hint`` (what to do instead) when it cannot."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            backup = path.with_name(f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}.bak")
            shutil.copy2(path, backup)
            click.echo(f"  kept the previous {path.name} as {backup}")
        temporary = path.with_name(f".{path.name}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(temporary, path)
    except OSError as exc:
        fail(f"cannot write {path}: {exc} ({hint})")


def chown_tree(root: Path, user: str) -> None:
    """Give ``root`` and everything below it to ``user`` (and its group); a symbolic link itself
    changes owner, never what it points at (a virtual environment links to the system's Python)."""
    entry = pwd.getpwnam(user)
    for directory, dirs, files in os.walk(root):
        os.chown(directory, entry.pw_uid, entry.pw_gid, follow_symlinks=False)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
            os.chown(os.path.join(directory, name), entry.pw_uid, entry.pw_gid, follow_symlinks=False)


def lay_out_release_root(root: Path | None) -> Path | None:
    """Lay ``root`` out as this machine's release root (``--release-root``), saying what was
    done; returns ``root``. Exits with the reason when it cannot."""
    if root is None:
        return None
    from llmgw.releases import lay_out
    from llmgw.releasefiles import ReleaseError

    try:
        release = lay_out(root)
    except (ReleaseError, OSError) as exc:
        fail(f"cannot lay out the release root {root}: {exc}")
    click.echo(f"  release root {root}: {release} (this llmgw), current -> it: `llmgw ctl upgrade` can upgrade "
               "this machine")
    return root


release_root_option = click.option(
    "--release-root", type=click.Path(path_type=Path, file_okay=False), default=None, metavar="DIR",
    help="Copy this llmgw's environment to DIR/releases/VERSION, point DIR/current at it and run the unit from "
         "there, so `llmgw ctl upgrade` can upgrade this machine (e.g. /opt/llmgw).")


def install_and_start(unit_name: str, *, daemon: str, config_path: Path, user: str, state_dir: Path,
                      unit_dir: Path, default_state_dir: Path, root: Path | None = None) -> None:
    """Install the shipped ``unit_name`` running ``llmgw DAEMON --config CONFIG_PATH`` in
    ``unit_dir`` and start it (``systemctl daemon-reload``, ``enable --now``); exits with
    the reason where systemd does not run, or a step fails."""
    from llmgw.cli.service import require_systemd, systemctl_or_fail

    require_systemd()  # everything else is written: without systemd, it says how to start by hand
    unit = unit_dir / unit_name
    try:
        unit_dir.mkdir(parents=True, exist_ok=True)
        unit.write_text(render_unit(unit_name, daemon=daemon, config=config_path, user=user, state_dir=state_dir,
                                    default_state_dir=default_state_dir, root=root))
    except OSError as exc:
        fail(f"cannot write {unit}: {exc} (run as root)")
    systemctl_or_fail("daemon-reload")
    systemctl_or_fail("enable", "--now", unit_name)
    click.echo(f"  installed {unit} and started it (as {user})")
