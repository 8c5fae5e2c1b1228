"""``llmgw server join --server ADDR --token T``: make this machine another control plane.

What it does, in order, saying each step:

1. checks the token's form and that this machine is not a control plane already (a second
   run on a machine that joined is a no-op that says so);
2. generates this machine's private key (it never leaves the machine), finds the address
   others reach it at (``--advertise``, else the one on its route to the cluster: a UDP
   connect, nothing sent), and redeems the token at the first control plane that answers,
   after checking that control plane against the CA the token pins
   (:func:`llmgw.client.join.redeem`);
3. writes the CA (with its key, so this control plane can sign joins too), its
   certificate and key, a local admin certificate for ``llmgw ctl``, and server.yaml with
   the shared store's URL, its listen addresses and the lease;
4. with ``--vip``, writes a keepalived configuration whose check follows ``/leader``;
5. installs and starts ``llmgw-server.service`` where systemd runs (``--no-start``: not).
"""

from __future__ import annotations

import os
from pathlib import Path

import click
import yaml

from llmgw.cli.joining import (
    bracket, chown_tree, install_and_start, join_arguments, joined_as, lay_out_release_root, release_root_option,
    route_address, unit_user, write_private,
)
from llmgw.cli.output import fail
from llmgw.cli.pki import ADMIN_DIR, CA_DIR, SERVER_DIR
from llmgw.cli.units import DEFAULT_STATE_DIR, UNIT_DIR
from llmgw.config.defaults import DEFAULT_HTTP_PORT, DEFAULT_RPC_PORT
from llmgw.rpc.tls import CERT_FILE, ClusterCA, IssuedCert, TLSFileError, new_private_key, write_credentials

SERVER_UNIT = "llmgw-server.service"
DEFAULT_CONFIG = Path("/etc/llmgw/server.yaml")
DEFAULT_KEEPALIVED = Path("/etc/keepalived/keepalived.conf")


@click.command("join")
@click.option("--server", "servers", required=True, metavar="ADDR[,ADDR...]",
              help="RPC address(es) of the cluster's control planes, as `ctl servers add` printed them.")
@click.option("--token", envvar="LLMGW_JOIN_TOKEN", required=True, help="The join token (or $LLMGW_JOIN_TOKEN).")
@click.option("--advertise", default=None, help="The address others reach this machine at [its route to --server].")
@click.option("--rpc-port", type=click.IntRange(0, 65535), default=DEFAULT_RPC_PORT, show_default=True,
              help="The RPC port to listen on (0: any free one).")
@click.option("--http-port", type=click.IntRange(0, 65535), default=DEFAULT_HTTP_PORT, show_default=True,
              help="The gateway port to listen on (0: any free one).")
@click.option("--state-dir", type=click.Path(path_type=Path), default=DEFAULT_STATE_DIR, show_default=True)
@click.option("--vip", default=None, metavar="ADDRESS[/PREFIX]",
              help="A floating address for keepalived that always lands on the leader.")
@click.option("--vip-interface", default=None, help="Interface for --vip [the one holding --advertise].")
@click.option("--keepalived-config", type=click.Path(path_type=Path), default=DEFAULT_KEEPALIVED, show_default=True)
@click.option("--user", default=None, help="The unit's user [llmgw where it exists, else the caller].")
@click.option("--unit-dir", type=click.Path(path_type=Path, file_okay=False), default=UNIT_DIR, show_default=True,
              help="Where to install llmgw-server.service.")
@click.option("--no-start", is_flag=True, help="Write everything, but do not install or start the unit.")
@release_root_option
@click.pass_context
def server_join(ctx: click.Context, servers: str, token: str, advertise: str | None, rpc_port: int,
                http_port: int, state_dir: Path, vip: str | None, vip_interface: str | None,
                keepalived_config: Path, user: str | None, unit_dir: Path, no_start: bool,
                release_root: Path | None) -> None:
    """Join this machine to a cluster as another control plane, with a token from `llmgw ctl servers add`."""
    from llmgw.cli.common import run_trio
    from llmgw.client.join import JoinError, redeem

    config_path: Path = (ctx.obj or {}).get("config_path") or DEFAULT_CONFIG
    parsed, addresses = join_arguments(token, servers)
    joined = joined_as(state_dir / SERVER_DIR, parsed.ca_sha256, "control plane")
    if joined is not None:
        click.echo(f"this machine joined this cluster already, as control plane {joined} "
                   f"({state_dir / SERVER_DIR}): nothing to do")
        return
    try:
        host = advertise or route_address(addresses[0])
    except (OSError, ValueError) as exc:
        fail(f"cannot tell which address others reach this machine at ({exc}): give --advertise")
    if vip:  # checked before the token is spent
        vip_interface = _vip_interface(vip, vip_interface, host)
    key_pem = new_private_key()
    click.echo(f"joining through {', '.join(addresses)} as a control plane reached at {host} ...")
    try:
        grant = run_trio(lambda: redeem(addresses, parsed, key_pem, [host], role="control"))
    except JoinError as exc:
        fail(f"join failed: {exc}")
    click.echo(f"  the cluster signed this machine's certificate: control plane {grant.name}")

    try:
        ClusterCA.from_pem(grant.ca, grant.ca_key).save(state_dir / CA_DIR)
        write_credentials(state_dir / SERVER_DIR, grant.ca, IssuedCert(grant.certificate, key_pem))
        ca = ClusterCA.load(state_dir / CA_DIR)
        if not (state_dir / ADMIN_DIR / CERT_FILE).exists():
            write_credentials(state_dir / ADMIN_DIR, ca.cert_pem, ca.issue("admin", "admin"))
    except (TLSFileError, OSError, ValueError) as exc:
        fail(f"cannot write the certificates to {state_dir}: {exc}")
    click.echo(f"  wrote the cluster CA, this control plane's certificate and an admin certificate under {state_dir}")

    rpc_listen, http_listen = f"{bracket(host)}:{rpc_port}", f"{bracket(host)}:{http_port}"
    config = {
        "state_dir": str(state_dir),
        "rpc_listen": rpc_listen,
        "http_listen": http_listen,
        "advertise_hosts": [host],
        "store": {"url": grant.store_url},
        "leader_lease": f"{grant.leader_lease:g}s",
    }
    write_private(config_path, "# Written by `llmgw server join`; see docs/ha.md and docs/config.md.\n"
                  + yaml.safe_dump(config, sort_keys=False),
                  hint="run as root, or pass `llmgw server --config PATH join`")
    click.echo(f"  wrote {config_path} (store and lease as the cluster's; listening on {rpc_listen} and {http_listen})")

    if vip and vip_interface:
        _write_keepalived(vip, vip_interface, http_listen, keepalived_config)

    user_name = unit_user(user)
    root = lay_out_release_root(release_root)
    if os.geteuid() == 0:
        chown_tree(state_dir, user_name)
        if root is not None:  # the control plane (as this user) installs the next release there
            chown_tree(root, user_name)
    if no_start:
        click.echo(f"not started (--no-start): run `llmgw server --config {config_path}`")
        return
    install_and_start(SERVER_UNIT, daemon="server", config_path=config_path, user=user_name, state_dir=state_dir,
                      unit_dir=unit_dir, default_state_dir=DEFAULT_STATE_DIR, root=root)
    click.echo(f"done: `llmgw ctl servers list` on any control plane shows {grant.name} as a standby shortly")


def _vip_interface(vip: str, given: str | None, host: str) -> str:
    """Returns the interface keepalived floats ``vip`` on (``given``, else the one holding
    ``host``); exits with the reason when ``vip`` or the interface will not do."""
    from llmgw.cli.keepalived import check_interface, interface_of, parse_vip

    try:
        parse_vip(vip)
    except ValueError as exc:
        fail(f"--vip: {exc}")
    interface = given or interface_of(host)
    if interface is None:
        fail(f"--vip: no interface here holds {host}: give --vip-interface")
    try:
        check_interface(interface)
    except ValueError as exc:
        fail(f"--vip-interface: {exc}")
    return interface


def _write_keepalived(vip: str, interface: str, http_listen: str, path: Path) -> None:
    from llmgw.cli.keepalived import render

    try:
        text = render(vip, interface, http_listen)
    except ValueError as exc:
        fail(f"--vip: {exc}")
    write_private(path, text, hint="run as root, or pass --keepalived-config PATH")
    click.echo(f"  wrote {path}: {vip} on {interface} follows the leader (`systemctl reload keepalived` to apply)")
