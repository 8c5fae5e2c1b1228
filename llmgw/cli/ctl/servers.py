"""``llmgw ctl servers add|list|remove`` and ``llmgw ctl nodes add|remove``: machines joining
and leaving the cluster.

``add NAME`` mints a one-time join token that expires (default 1 h) and prints the one
command to run on the new machine (``llmgw server join``, ``llmgw agent join``); ``servers
list`` shows every control plane, its role, and the tokens not yet used; ``remove NAME``
revokes its certificates and any pending token for it, and ends its session with the leader.
"""

from __future__ import annotations

from typing import Any

import click

from llmgw.cli.ctl.common import call, json_option, target_of
from llmgw.cli.output import fail, local_time, print_json, print_table
from llmgw.config.agent import parse_engine_name
from llmgw.config.values import parse_duration
from llmgw.jointoken import DEFAULT_TTL_S, NodeOverrides
from llmgw.labels import parse_pairs


@click.group()
def servers() -> None:
    """Control planes: add one with a join token, list them, remove one."""


@servers.command("add")
@click.argument("name")
@click.option("--ttl", default=f"{DEFAULT_TTL_S:g}s", show_default=True,
              help="How long the token stays valid (30m, 2h, ...).")
@json_option
@click.pass_context
def servers_add(ctx: click.Context, name: str, ttl: str, as_json: bool) -> None:
    """Mint a one-time join token for a new control plane NAME and print the command to run on it."""
    seconds = _seconds(ttl)
    new = call(ctx, as_json, lambda c: c.create_join_token("control", name, seconds),
               as_data=lambda t: {"name": t.name, "token": t.token, "expires_at": t.expires_at,
                                  "control_planes": list(t.control_planes),
                                  "command": _join_command(t.control_planes, t.token)})
    click.echo(f"join token for control plane {name}, valid until {local_time(new.expires_at)} (once):")
    click.echo(f"  {new.token}")
    click.echo("On the new machine, run:")
    click.echo(f"  {_join_command(new.control_planes, new.token)}")
    click.echo("(add --advertise ADDRESS if others reach it at another address than its route to the cluster, "
               "--vip ADDRESS for a floating address on the leader)")


def _join_command(control_planes: Any, token: str, daemon: str = "server") -> str:
    return f"sudo llmgw {daemon} join --server {','.join(control_planes)} --token {token}"


def _seconds(ttl: str) -> float:
    try:
        return parse_duration(ttl)
    except ValueError as exc:
        fail(f"--ttl: {exc}")


# -- nodes (attached to `ctl nodes` in llmgw/cli/ctl/__init__.py) ----------------------------


@click.command("add")
@click.argument("name", required=False, default="")
@click.option("--ttl", default=f"{DEFAULT_TTL_S:g}s", show_default=True,
              help="How long the token stays valid (30m, 2h, ...).")
@click.option("--labels", "label_args", multiple=True, metavar="KEY=VALUE[,...]",
              help="Labels the node gets in its agent.yaml (profiles' node_labels select nodes by them).")
@click.option("--disable-engine", "disabled", multiple=True, metavar="ENGINE",
              help="An engine the node never installs or runs (repeat for more): vllm, sglang, llama.cpp, sim.")
@json_option
@click.pass_context
def nodes_add(ctx: click.Context, name: str, ttl: str, label_args: tuple[str, ...], disabled: tuple[str, ...],
              as_json: bool) -> None:
    """Mint a one-time join token for a new node and print the command to run on it.

    NAME is the node's name; without it the node takes its host name (or `agent join --name`).
    The node writes --labels and --disable-engine into its agent.yaml when it joins.
    """
    seconds = _seconds(ttl)
    try:
        node_labels = parse_pairs(label_args)
    except ValueError as exc:
        fail(f"--labels: {exc}")
    try:
        overrides = NodeOverrides(node_labels, [parse_engine_name(e) for e in disabled])
    except ValueError as exc:
        fail(f"--disable-engine: {exc}")
    new = call(ctx, as_json, lambda c: c.create_join_token("node", name, seconds, overrides),
               as_data=lambda t: {"name": name, "token": t.token, "expires_at": t.expires_at,
                                  "control_planes": list(t.control_planes),
                                  "labels": dict(overrides.labels),
                                  "disabled_engines": list(overrides.disabled_engines),
                                  "command": _join_command(t.control_planes, t.token, "agent")})
    who = f"node {name}" if name else "a node (named by its host name)"
    if overrides:
        who += f" with {overrides.describe()}"
    click.echo(f"join token for {who}, valid until {local_time(new.expires_at)} (once):")
    click.echo(f"  {new.token}")
    click.echo("On the new machine, run:")
    click.echo(f"  {_join_command(new.control_planes, new.token, 'agent')}")


@click.command("remove")
@click.argument("name")
@json_option
@click.pass_context
def nodes_remove(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove node NAME: its certificates and pending tokens are revoked, nothing is placed there any more."""
    removal = call(ctx, as_json, lambda c: c.remove_node(name))
    if not removal.removed:
        fail(f"no node or pending join token named {name} (see `llmgw ctl nodes` and `llmgw ctl servers list`)")
    click.echo(f"removed node {name}: {removal.certificates_revoked} certificate(s) refused from now on; its replicas "
               "are placed elsewhere (stop its agent and engines there: `llmgw service stop` on the machine)")


@servers.command("list")
@click.option("--all", "show_all", is_flag=True, help="Also list used, expired and revoked tokens.")
@json_option
@click.pass_context
def servers_list(ctx: click.Context, show_all: bool, as_json: bool) -> None:
    """Every control plane (leader, standby, down) and the join tokens still pending."""

    async def fetch(client: Any) -> tuple[Any, Any]:
        return await client.status(), await client.join_tokens()

    target = target_of(ctx, as_json)
    status, tokens = target.run(fetch)
    shown = [t for t in tokens if show_all or t.state == "pending"]
    if target.json:
        print_json({"leader": status.leader, "epoch": status.epoch,
                    "control_planes": [_plane_data(p) for p in status.control_planes],
                    "join_tokens": [_token_data(t) for t in shown]})
        return
    print_table(["NAME", "ROLE", "RPC", "HTTP", "LAST STARTED"],
                [[p.name, p.role, p.rpc_address, p.http_address, local_time(p.last_seen)] for p in status.control_planes])
    if shown:
        click.echo()
        print_table(["TOKEN", "FOR", "STATE", "EXPIRES", "BY", "USED FROM"],
                    [[t.id, " ".join(filter(None, (t.role, t.name, t.overrides.describe() and
                                                   f"({t.overrides.describe()})"))), t.state, local_time(t.expires_at), t.created_by, t.used_by or "-"]
                     for t in shown])


def _plane_data(p: Any) -> dict[str, Any]:
    return {"name": p.name, "role": p.role, "rpc_address": p.rpc_address, "http_address": p.http_address,
            "last_seen": p.last_seen}


def _token_data(t: Any) -> dict[str, Any]:
    return {"id": t.id, "role": t.role, "name": t.name, "state": t.state, "created_at": t.created_at,
            "created_by": t.created_by, "expires_at": t.expires_at, "used_by": t.used_by,
            "labels": dict(t.overrides.labels), "disabled_engines": list(t.overrides.disabled_engines)}


@servers.command("remove")
@click.argument("name")
@json_option
@click.pass_context
def servers_remove(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove control plane NAME: its certificate and pending tokens are revoked (stop it first)."""
    removed = call(ctx, as_json, lambda c: c.remove_control_plane(name),
                   as_data=lambda r: {"name": name, "removed": r})
    if not removed:
        fail(f"no control plane or pending join token named {name} (see `llmgw ctl servers list`)")
    click.echo(f"removed control plane {name}: its certificate is refused from now on")
