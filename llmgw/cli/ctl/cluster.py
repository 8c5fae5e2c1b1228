"""``llmgw ctl status|nodes|replicas|engine-check|logs``: what the cluster is running, and how."""

from __future__ import annotations

import sys
import time
from typing import Any

import click
import trio

from llmgw.cli.ctl.common import call, json_option, mb, target_of
from llmgw.cli.output import fail, print_table
from llmgw.cli.ctl.node_detail import print_node
from llmgw.client import ClientError, ClusterClient, NodeRow, ReplicaRow
from llmgw.jsonable import to_jsonable
from llmgw.labels import describe as describe_labels
from llmgw.spec import ENGINE_BUILT_IN, ENGINE_FROM_CONFIG, gpu_summary


@click.command()
@json_option
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Cluster summary: who leads, nodes with their devices by class and live CPU and memory,
    replicas, models, what could not be placed."""

    async def both(c: ClusterClient) -> tuple[Any, list[NodeRow]]:
        return await c.status(), await c.nodes()

    st, rows = call(ctx, as_json, both, as_data=lambda found: {**to_jsonable(found[0]), "fleet": fleet_summary(found[1])})
    click.echo(f"llmgw {st.version}  gateway {st.gateway_url}")
    if st.leader:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.leader_since))
        click.echo(f"leader: {st.leader} (epoch {st.epoch}, since {since})")
    if len(st.control_planes) > 1:
        click.echo("control planes: " + ", ".join(f"{p.name} {p.role}" + (f" {p.version}" if p.version else "")
                                                  for p in st.control_planes))
    click.echo(f"nodes: {st.nodes_online} online, {st.nodes_lost} lost")
    fleet = fleet_summary(rows)
    if fleet["devices"]:
        click.echo("devices: " + ", ".join(f"{n}x {kind}" for kind, n in fleet["devices"].items()))
    busy = fleet["cpu_utilization_percent"]
    click.echo(f"CPUs: {fleet['cpus']}" + ("" if busy is None else f", {busy:.0f}% busy")
               + f"   memory: {mb(fleet['memory_available_mb'])} available of {mb(fleet['memory_total_mb'])}")
    click.echo(f"replicas: {st.replicas_ready}/{st.replicas_total} ready   models: {st.models}")
    if st.routing:
        click.echo(f"routing: {st.routing}")
    for reason in st.unplaceable:
        click.echo(f"not placed: {reason}")
    for alarm in st.kv_alarms:
        click.echo(f"KV routing alarm: {alarm}")
    if st.serving_stopped:
        click.echo("serving: STOPPED (every request is answered 503; `llmgw ctl start` resumes)")
    if st.admission:
        click.echo("")
        print_table(["TENANT", "ADMITTED", "QUEUED", "SHED", "IN FLIGHT", "SHARE"],
                    [[a.tenant, a.admitted, a.queued, a.shed, a.in_flight, f"{a.share:.2f}"] for a in st.admission])


class _NodesGroup(click.Group):
    """``ctl nodes``: a word that is no subcommand is a node's name (``ctl nodes NODE`` = ``nodes show NODE``)."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            return "show", self.commands["show"], args
        return super().resolve_command(ctx, args)


@click.group(cls=_NodesGroup, invoke_without_command=True)
@json_option
@click.pass_context
def nodes(ctx: click.Context, as_json: bool) -> None:
    """Nodes of the cluster with their hardware and engines (`nodes list`); `nodes NODE` shows one
    with its cards, replicas and live readings; `nodes add`, `nodes remove`.

    Under the table, per node, each engine's version, the llama-server or Python it runs and
    where that comes from ("agent.yaml" when the operator named it, "installed"), or why an
    engine named in agent.yaml is not usable. ``--json`` has them as ``version``, ``path``,
    ``origin``, ``installed`` and ``detail`` of each engine.
    """
    if ctx.invoked_subcommand is None:
        _list_nodes(ctx, as_json)


@nodes.command("list")
@json_option
@click.pass_context
def nodes_list(ctx: click.Context, as_json: bool) -> None:
    """Nodes of the cluster with their hardware and engines."""
    _list_nodes(ctx, as_json)


@nodes.command("show")
@click.argument("node")
@json_option
@click.pass_context
def nodes_show(ctx: click.Context, node: str, as_json: bool) -> None:
    """One node: its hardware, each card with its live readings, the replicas on it and what
    they use, processes that are not llmgw's on its GPUs, XID errors. Readings older than a
    minute are not shown."""

    async def shown(c: ClusterClient) -> tuple[NodeRow, list[ReplicaRow]]:
        row = next((n for n in await c.nodes() if n.id == node), None)
        if row is None:
            raise ClientError(f"no node {node!r} (see `llmgw ctl nodes`)")
        replicas, _ = await c.replicas()
        return row, [r for r in replicas if r.node_id == node]

    row, on_node = call(ctx, as_json, shown, as_data=lambda found: {"node": found[0], "replicas": found[1]})
    print_node(row, on_node)


def _list_nodes(ctx: click.Context, as_json: bool) -> None:
    rows = call(ctx, as_json, lambda c: c.nodes())
    table = []
    for n in rows:
        hw = n.hardware
        gpus = gpu_summary(hw.gpus) or hw.gpu_note or "none"
        engines = ",".join(_engine_cell(e) for e in n.engines if _shown(e)) or "-"
        busy = n.telemetry.host.get("cpu_utilization_percent")
        table.append([n.id, n.state, n.address, hw.cpu_count, "-" if busy is None else f"{busy:.0f}%",
                      f"{mb(hw.memory_available_mb)}/{mb(hw.memory_total_mb)}",
                      gpus, engines, n.shards, f"{n.seconds_since_heartbeat:.1f}s", describe_labels(n.labels)])
    print_table(["NODE", "STATE", "ADDRESS", "CPUS", "CPU BUSY", "MEM FREE/TOTAL", "GPUS", "ENGINES", "REPLICAS",
                 "HEARTBEAT", "LABELS"],
                table, empty="no nodes have joined")
    for n in rows:
        if n.config_problem:
            click.echo(f"\n{n.id} runs on its previous configuration: {n.config_problem}")
    for n in rows:
        lines = [_engine_line(e) for e in n.engines if _shown(e) and e.origin != ENGINE_BUILT_IN]
        if lines:
            click.echo(f"\n{n.id} engines:")
            for line in lines:
                click.echo(f"  {line}")


@click.command()
@json_option
@click.option("--model", "-m", help="Only replicas of this model.")
@click.pass_context
def replicas(ctx: click.Context, as_json: bool, model: str | None) -> None:
    """Replicas (one engine process each) and their state."""

    async def listed(c: ClusterClient) -> tuple[list[ReplicaRow], list[str]]:
        rows, unplaceable = await c.replicas()
        return [r for r in rows if not model or r.model == model], unplaceable

    rows, unplaceable = call(ctx, as_json, listed,
                             as_data=lambda listed: {"replicas": listed[0], "unplaceable": listed[1]})
    print_table(["REPLICA", "MODEL", "NODE", "STATE", "DEFINITION", "ENDPOINT", "PID", "RESTARTS", "COMPUTE", "MESSAGE"],
                [[r.id, r.model, r.node_id, r.state, _definition_cell(r), r.endpoint or "-", r.pid or "-", r.restarts,
                  r.compute_summary or "-", r.message[:60]] for r in rows], empty="no replicas")
    outdated = sum(r.outdated for r in rows)
    if outdated:
        click.echo(f"\n{outdated} replica(s) run an older definition of their model; "
                   "they are being replaced one at a time")
    for r in rows:
        if r.last_output and r.state.split()[0] in ("failed", "restarting"):
            click.echo(f"\n{r.id} ({r.state}): {r.message}\n  last output:")
            for line in r.last_output[-10:]:
                click.echo(f"    {line}")
    for reason in unplaceable:
        click.echo(f"not placed: {reason}")


def fleet_summary(rows: list[NodeRow]) -> dict[str, Any]:
    """Returns the online nodes' devices by class (GPU classes, and how many nodes have no GPU),
    CPUs and their live use (weighted by CPUs, over nodes that sent a reading; None if none
    did), and memory, for `ctl status`."""
    online = [n for n in rows if n.state == "online"]
    devices: dict[str, int] = {}
    for n in online:
        for gpu in n.hardware.gpus:
            devices[gpu.gpu_class or gpu.name] = devices.get(gpu.gpu_class or gpu.name, 0) + 1
    cpu_only = sum(1 for n in online if not n.hardware.gpus)
    if cpu_only:
        devices["node without GPUs" if cpu_only == 1 else "nodes without GPUs"] = cpu_only
    measured = [(n.hardware.cpu_count, n.telemetry.host["cpu_utilization_percent"]) for n in online
                if "cpu_utilization_percent" in n.telemetry.host]
    cpus = sum(count for count, _ in measured)
    return {
        "devices": dict(sorted(devices.items())),
        "cpus": sum(n.hardware.cpu_count for n in online),
        "cpu_utilization_percent": sum(c * busy for c, busy in measured) / cpus if cpus else None,
        "memory_total_mb": sum(n.hardware.memory_total_mb for n in online),
        "memory_available_mb": sum(n.hardware.memory_available_mb for n in online),
    }


def _definition_cell(r: ReplicaRow) -> str:
    """The definition column: the fingerprint's first 8 digits, marked when a rollout will replace it."""
    short = r.fingerprint[:8] or "-"
    return f"{short} (outdated)" if r.outdated else short


def _shown(e: Any) -> bool:
    """Whether `ctl nodes` lists an engine: installed, being installed, or named in agent.yaml."""
    return bool(e.installed or e.state or e.origin == ENGINE_FROM_CONFIG)


def _engine_cell(e: Any) -> str:
    """An engine in `ctl nodes`' table: "sim", "llama.cpp (installing: downloading X (16 MB))",
    or "vllm (not usable)" for a path agent.yaml names that does not run."""
    if e.state:
        return f"{e.name} ({e.state})"
    return e.name if e.installed else f"{e.name} (not usable)"


def _engine_line(e: Any) -> str:
    """An engine under `ctl nodes`' table: its version, what runs and where that comes from
    ("llama.cpp b11312 /usr/local/bin/llama-server (agent.yaml)"), or why it is not usable."""
    if not e.installed:
        return f"{e.name}: {e.state or e.detail or 'not installed'}"
    where = f"{e.path} ({e.origin})" if e.path else f"({e.origin or e.detail or 'origin unknown'})"
    return f"{e.name} {e.version or '(version unknown)'} {where}"


@click.command("engine-check")
@click.argument("node")
@click.argument("engine")
@click.pass_context
def engine_check(ctx: click.Context, node: str, engine: str) -> None:
    """Run ENGINE's version and device check on NODE and print its output."""
    click.echo(target_of(ctx).run(lambda c: c.engine_check(node, engine)).rstrip("\n"))


#: Seconds between a followed log's reads: fresh enough to watch, one small call per node.
FOLLOW_POLL_S = 0.5


@click.command()
@click.argument("target")
@click.option("--source", default=None, metavar="agent|REPLICA",
              help="With a NODE: its agent's log (the default) or one of its replicas' engine output.")
@click.option("--lines", "-n", type=click.IntRange(1, 2000), default=100, show_default=True,
              help="How many of the last lines to print (then, with -f, every new one).")
@click.option("--follow", "-f", is_flag=True, help="Then print new lines as they are written, until Ctrl-C.")
@json_option
@click.pass_context
def logs(ctx: click.Context, target: str, source: str | None, lines: int, follow: bool, as_json: bool) -> None:
    """Last lines of NODE's agent log (or of its replica named by --source), or of REPLICA's engine output.

    Read over the session the node's agent holds: no ssh. The agent keeps its last 2,000
    lines in memory, every secret redacted. -f asks every half second for what was added
    since (the node holds nothing for a follower; more than -n lines in between are
    skipped, and say so).
    """

    async def located(c: ClusterClient) -> tuple[str, str]:
        if target in {n.id for n in await c.nodes()}:
            return target, source or "agent"
        if source is not None:
            raise ClientError(f"no node {target!r} is connected (see `llmgw ctl nodes`)")
        rows, _ = await c.replicas()
        node = next((r.node_id for r in rows if r.id == target), None)
        if node is None:
            raise ClientError(f"no node or replica {target!r} (see `llmgw ctl nodes` and `llmgw ctl replicas`)")
        return node, target

    async def read(c: ClusterClient) -> list[str]:
        node, where = await located(c)
        return (await c.node_logs(node, where, lines))[0]

    async def follow_log(c: ClusterClient) -> None:
        node, where = await located(c)
        cursor = 0
        while True:
            got, _, cursor = await c.node_logs(node, where, lines, cursor)
            if got:
                click.echo("\n".join(got))
                sys.stdout.flush()  # a pipe or file sees each batch as it comes
            await trio.sleep(FOLLOW_POLL_S)

    if follow:
        if as_json or target_of(ctx).json:
            fail("-f prints lines as they come; --json is for one read")
        target_of(ctx).run(follow_log)
        return

    for line in call(ctx, as_json, read, as_data=lambda got: {"target": target, "source": source or "", "lines": got}):
        click.echo(line)
