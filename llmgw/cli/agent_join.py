"""``llmgw agent join --server ADDR --token T``: make this machine a node of a cluster.

What it does, in order, saying each step:

1. checks the token's form and that this machine is not a node already (a second run on a
   machine that joined this cluster is a no-op that says so);
2. generates this machine's private key (it never leaves the machine) and redeems the token
   at the first control plane that answers, after checking that control plane against the
   CA the token pins (:func:`llmgw.client.join.redeem`); the node's name is the token's, else
   ``--name``, else this machine's host name;
3. writes the CA, its certificate and key under ``<state_dir>/tls`` and an agent.yaml naming
   only the control planes, the TLS files and what differs from the defaults (the node id
   where it is not the host name, the state directory, the labels and disabled engines the
   token carries from ``ctl nodes add``);
4. creates the engines' user (``--engine-user``, default ``llmgw-engine``) where missing,
   noting it beside agent.yaml for ``llmgw wipe``, and runs ``llmgw doctor`` (what needs
   attention is printed; the join goes on);
5. installs and starts ``llmgw-agent.service`` where systemd runs (``--no-start``: not).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import click
import yaml

from llmgw.cli.joining import (install_and_start, join_arguments, joined_as, lay_out_release_root, release_root_option,
                               write_private)
from llmgw.cli.output import fail
from llmgw.cli.units import UNIT_DIR
from llmgw.config.agent import AgentTLS, parse_user_name
from llmgw.config.defaults import DEFAULT_AGENT_STATE_DIR
from llmgw.config.values import parse_node_id
from llmgw.node.engine_user import CREATED_USERS_FILE, DEFAULT_ENGINE_USER
from llmgw.rpc.tls import IssuedCert, TLSFileError, new_private_key, write_credentials

AGENT_UNIT = "llmgw-agent.service"
DEFAULT_AGENT_CONFIG = Path("/etc/llmgw/agent.yaml")
#: Where the node's certificate, key and the CA go, below its state directory (agent.yaml's default).
TLS_SUBDIR = "tls"


def _wanted_name(given: str | None) -> str:
    """Returns the node name to ask for where the token names none: ``given``, else the host name."""
    name = given or socket.gethostname()
    try:
        return parse_node_id(name)
    except ValueError as exc:
        fail(f"{'--name' if given else 'the host name'} {name!r} cannot name a node ({exc}): give --name NAME")


def _hardware_line() -> str:
    """Returns what the agent will report of this machine, in words (CPUs, memory, GPUs or why none)."""
    from llmgw.node.discovery import read_hardware
    from llmgw.spec import gpu_display

    hw = read_hardware()
    gpus = (", ".join(f"GPU {gpu_display(g.index)} {g.gpu_class or g.name} ({g.memory_total_mb / 1024:.0f} GiB)"
                      for g in hw.gpus) if hw.gpus else hw.gpu_note or "no GPUs")
    return (f"{hw.cpu_count} CPUs, {hw.memory_total_mb / 1024:.1f} GiB memory "
            f"({hw.memory_available_mb / 1024:.1f} GiB available); {gpus}")


def _engine_user_line(name: str, record: Path) -> str:
    """Creates the engines' user ``name`` where missing (as root, noted in ``record`` for
    `llmgw wipe`); returns what it did in words. A user that cannot be created is said, not
    fatal: the agent fails each shard with the same reason until it exists."""
    from llmgw.node.engine_user import create_user, user_exists

    if not name:
        return "engines run as the agent's own user (--engine-user \"\")"
    if user_exists(name):
        return f"engines run as {name} (the user exists)"
    if os.geteuid() != 0:
        return f"WARNING: the engines' user {name} does not exist and only root can create it: replicas fail until it does"
    try:
        create_user(name, record=record)
    except OSError as exc:
        return f"WARNING: {exc}: replicas fail until the user exists"
    return f"created the engines' user {name} (no login, no home; engines run as it)"


def _doctor(config_path: Path) -> None:
    """Runs `llmgw doctor` on the agent.yaml just written (engine checks too) and prints what needs
    attention; the join goes on whatever it finds (the operator fixes, then runs it again)."""
    from llmgw.cli.doctor import load_config, print_findings, run_doctor

    click.echo("  llmgw doctor:")
    config, problem = load_config(config_path)
    report = run_doctor(config, config_problem=problem, quiet=True)
    print_findings(report, indent="    ", only_serious=True)
    fails, warns = report.counts()
    verdict = "this node can run engines" if not fails else "fix the failures, then `llmgw doctor` again"
    click.echo(f"    {fails} failure(s), {warns} warning(s): {verdict}")


@click.command("join")
@click.option("--server", "servers", required=True, metavar="ADDR[,ADDR...]",
              help="RPC address(es) of the cluster's control planes, as `ctl nodes add` printed them.")
@click.option("--token", envvar="LLMGW_JOIN_TOKEN", required=True, help="The join token (or $LLMGW_JOIN_TOKEN).")
@click.option("--name", default=None, help="The node's name where the token names none [the host name].")
@click.option("--state-dir", type=click.Path(path_type=Path), default=DEFAULT_AGENT_STATE_DIR, show_default=True)
@click.option("--unit-dir", type=click.Path(path_type=Path, file_okay=False), default=UNIT_DIR, show_default=True,
              help="Where to install llmgw-agent.service.")
@click.option("--no-start", is_flag=True, help="Write everything, but do not install or start the unit.")
@click.option("--engine-user", default=DEFAULT_ENGINE_USER, show_default=True,
              help='The unprivileged user engines run as, created when missing; "" runs them as the agent\'s user.')
@release_root_option
@click.pass_context
def agent_join(ctx: click.Context, servers: str, token: str, name: str | None, state_dir: Path, unit_dir: Path,
               engine_user: str, no_start: bool, release_root: Path | None) -> None:
    """Join this machine to a cluster as a node, with a token from `llmgw ctl nodes add`."""
    from llmgw.cli.common import run_trio
    from llmgw.client.join import JoinError, redeem

    config_path: Path = (ctx.obj or {}).get("config_path") or DEFAULT_AGENT_CONFIG
    try:
        engine_user = parse_user_name(engine_user)
    except ValueError as exc:
        fail(f"--engine-user: {exc}")
    parsed, addresses = join_arguments(token, servers)
    tls_dir = state_dir / TLS_SUBDIR
    joined = joined_as(tls_dir, parsed.ca_sha256, "node")
    if joined is not None:
        click.echo(f"this machine joined this cluster already, as node {joined} ({tls_dir}): nothing to do")
        return
    wanted = _wanted_name(name)
    key_pem = new_private_key()
    click.echo(f"joining through {', '.join(addresses)} ...")
    try:
        grant = run_trio(lambda: redeem(addresses, parsed, key_pem, [], name=wanted, role="node"))
    except JoinError as exc:
        fail(f"join failed: {exc}")
    click.echo(f"  the cluster signed this machine's certificate: node {grant.name}")
    try:
        write_credentials(tls_dir, grant.ca, IssuedCert(grant.certificate, key_pem))
    except (TLSFileError, OSError) as exc:
        fail(f"cannot write the certificates to {tls_dir}: {exc}")
    click.echo(f"  wrote the cluster CA, this node's certificate and key under {tls_dir}")

    tls = AgentTLS.in_dir(tls_dir)
    config: dict[str, object] = {"control_planes": list(grant.control_planes),
                                 "tls": {"ca": str(tls.ca), "cert": str(tls.cert), "key": str(tls.key)}}
    if grant.name != socket.gethostname():
        config["node_id"] = grant.name
    if state_dir != DEFAULT_AGENT_STATE_DIR:
        config["state_dir"] = str(state_dir)
    config.update(grant.overrides.agent_yaml())
    if engine_user != DEFAULT_ENGINE_USER:
        config["engine_user"] = engine_user
    write_private(config_path, "# Written by `llmgw agent join`; see docs/config.md (agent.yaml).\n"
                  + yaml.safe_dump(config, sort_keys=False),
                  hint="run as root, or pass `llmgw agent --config PATH join`")
    given = f"; {grant.overrides.describe()}" if grant.overrides else ""
    click.echo(f"  wrote {config_path} (control planes {', '.join(grant.control_planes)}{given})")
    click.echo(f"  {_engine_user_line(engine_user, config_path.parent / CREATED_USERS_FILE.name)}")
    click.echo(f"  this node has {_hardware_line()}")
    _doctor(config_path)
    root = lay_out_release_root(release_root)
    if no_start:
        click.echo(f"not started (--no-start): run `llmgw agent --config {config_path}`")
        return
    install_and_start(AGENT_UNIT, daemon="agent", config_path=config_path, user="root", state_dir=state_dir,
                      unit_dir=unit_dir, default_state_dir=DEFAULT_AGENT_STATE_DIR, root=root)
    click.echo(f"done: `llmgw ctl nodes` on any control plane shows {grant.name} once its agent has joined")
