"""``llmgw ctl``: operate a cluster over the Cap'n Proto client library (``llmgw.client``).

Where to connect: ``--server`` / ``$LLMGW_SERVER`` (host:port of a control plane's RPC
port, several comma-separated for failover) and ``--tls-dir`` / ``$LLMGW_TLS_DIR``
(an admin certificate: ca.pem, cert.pem, key.pem). Without either, the cluster
of a local ``llmgw up`` is used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Awaitable, Callable

import click
import yaml

from llmgw.cli.common import default_up_dir, run_trio
from llmgw.cli.output import fail, print_json, print_table
from llmgw.client import ClientError, ClusterClient, connect
from llmgw.control.catalog import CatalogError, model_to_dict, validate_model
from llmgw.spec import ModelSpec


class Target:
    def __init__(self, servers: list[str], tls_dir: Path, as_json: bool) -> None:
        self.servers = servers
        self.tls_dir = tls_dir
        self.json = as_json

    def run(self, action: Callable[[ClusterClient], Awaitable[Any]]) -> Any:
        async def main() -> Any:
            async with connect(self.servers, tls_dir=self.tls_dir) as client:
                return await action(client)

        try:
            return run_trio(main)
        except ClientError as exc:
            fail(str(exc))


def _resolve_target(server: str | None, tls_dir: str | None) -> tuple[list[str], Path]:
    up_file = default_up_dir() / "up.json"
    up: dict[str, Any] = {}
    if (server is None or tls_dir is None) and up_file.exists():
        try:
            up = json.loads(up_file.read_text())
        except (OSError, ValueError):
            up = {}
    server = server or up.get("rpc")
    tls = tls_dir or up.get("tls_dir")
    if not server or not tls:
        fail("which cluster? pass --server HOST:PORT and --tls-dir DIR (an admin certificate), "
             "set LLMGW_SERVER and LLMGW_TLS_DIR, or start a local cluster with `llmgw up`")
    return [s.strip() for s in server.split(",") if s.strip()], Path(tls)


@click.group()
@click.option("--server", "-s", envvar="LLMGW_SERVER", help="Control plane RPC address(es), host:port[,host:port].")
@click.option("--tls-dir", envvar="LLMGW_TLS_DIR", help="Admin certificate directory (ca.pem, cert.pem, key.pem).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.pass_context
def ctl(ctx: click.Context, server: str | None, tls_dir: str | None, as_json: bool) -> None:
    """Operate a cluster: nodes, replicas, models, logs."""
    ctx.meta["llmgw.ctl"] = (server, tls_dir, as_json)


def _target(ctx: click.Context, as_json: bool = False) -> Target:
    server, tls_dir, group_json = ctx.meta.get("llmgw.ctl", (None, None, False))
    servers, tls = _resolve_target(server, tls_dir)
    return Target(servers, tls, group_json or as_json)


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def _mb(value: int) -> str:
    return f"{value / 1024:.1f}G" if value >= 1024 else f"{value}M"


@ctl.command()
@json_option
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Cluster summary: nodes, replicas, models, what could not be placed."""
    target = _target(ctx, as_json)
    st = target.run(lambda c: c.status())
    if target.json:
        return print_json(st)
    click.echo(f"llmgw {st.version}  gateway {st.gateway_url}")
    click.echo(f"nodes: {st.nodes_online} online, {st.nodes_lost} lost")
    click.echo(f"replicas: {st.replicas_ready}/{st.replicas_total} ready   models: {st.models}")
    for reason in st.unplaceable:
        click.echo(f"not placed: {reason}")
    for alarm in st.kv_alarms:
        click.echo(f"KV routing alarm: {alarm}")
    if st.serving_stopped:
        click.echo("serving: STOPPED (every request is answered 503; `llmgw ctl start` resumes)")
    if st.admission:
        click.echo("")
        print_table(["TENANT", "ADMITTED", "QUEUED", "SHED", "IN FLIGHT"],
                    [[a.tenant, a.admitted, a.queued, a.shed, a.in_flight] for a in st.admission])


@ctl.command()
@json_option
@click.pass_context
def nodes(ctx: click.Context, as_json: bool) -> None:
    """Nodes of the cluster with their hardware and engines."""
    target = _target(ctx, as_json)
    rows = target.run(lambda c: c.nodes())
    if target.json:
        return print_json(rows)
    table = []
    for n in rows:
        hw = n.hardware
        gpus = f"{len(hw.gpus)}x {hw.gpus[0].name}" if hw.gpus else (hw.gpu_note or "none")
        engines = ",".join(_engine_cell(e) for e in n.engines if e.installed or e.state) or "-"
        table.append([n.id, n.state, n.address, hw.cpu_count, f"{_mb(hw.memory_available_mb)}/{_mb(hw.memory_total_mb)}",
                      gpus, engines, n.shards, f"{n.seconds_since_heartbeat:.1f}s"])
    print_table(["NODE", "STATE", "ADDRESS", "CPUS", "MEM FREE/TOTAL", "GPUS", "ENGINES", "REPLICAS", "HEARTBEAT"],
                table, empty="no nodes have joined")


@ctl.command()
@json_option
@click.option("--model", "-m", help="Only replicas of this model.")
@click.pass_context
def replicas(ctx: click.Context, as_json: bool, model: str | None) -> None:
    """Replicas (one engine process each) and their state."""
    target = _target(ctx, as_json)
    rows, unplaceable = target.run(lambda c: c.replicas())
    if model:
        rows = [r for r in rows if r.model == model]
    if target.json:
        return print_json({"replicas": rows, "unplaceable": unplaceable})
    print_table(["REPLICA", "MODEL", "NODE", "STATE", "ENDPOINT", "PID", "RESTARTS", "COMPUTE", "MESSAGE"],
                [[r.id, r.model, r.node_id, r.state, r.endpoint or "-", r.pid or "-", r.restarts,
                  r.compute_summary or "-", r.message[:60]] for r in rows], empty="no replicas")
    for r in rows:
        if r.last_output and r.state.split()[0] in ("failed", "restarting"):
            click.echo(f"\n{r.id} ({r.state}): {r.message}\n  last output:")
            for line in r.last_output[-10:]:
                click.echo(f"    {line}")
    for reason in unplaceable:
        click.echo(f"not placed: {reason}")


def _engine_cell(e: Any) -> str:
    """An engine in `ctl nodes`: "sim", or "llamacpp (installing: downloading X (16 MB))"."""
    return f"{e.name} ({e.state})" if e.state else e.name


@ctl.command("engine-check")
@click.argument("node")
@click.argument("engine")
@click.pass_context
def engine_check(ctx: click.Context, node: str, engine: str) -> None:
    """Run ENGINE's version and device check on NODE and print its output."""
    click.echo(_target(ctx).run(lambda c: c.engine_check(node, engine)).rstrip("\n"))


@ctl.command()
@click.argument("replica")
@click.option("--lines", "-n", type=int, default=100, show_default=True)
@click.pass_context
def logs(ctx: click.Context, replica: str, lines: int) -> None:
    """Last lines an engine printed."""
    for line in _target(ctx).run(lambda c: c.replica_logs(replica, lines)):
        click.echo(line)


@ctl.group()
def models() -> None:
    """The model catalog: list, add, remove."""


@models.command("list")
@json_option
@click.pass_context
def models_list(ctx: click.Context, as_json: bool) -> None:
    """Catalog models and their profiles."""
    target = _target(ctx, as_json)
    specs = target.run(lambda c: c.models())
    if target.json:
        return print_json([model_to_dict(m) for m in specs])
    print_table(["MODEL", "ENGINE", "REPLICAS", "MEMORY", "CPU CORES", "GPUS", "ADAPTERS", "SOURCE"],
                [[m.name, m.engine, m.profile.replicas, _mb(m.profile.memory_mb) if m.profile.memory_mb else "-",
                  m.profile.cpu_cores or "-", m.profile.gpus or "-", _adapters_cell(m), m.source or "-"]
                 for m in specs],
                empty="the catalog is empty: add a model with `llmgw ctl models add`")


def _adapters_cell(model: ModelSpec) -> str:
    """Returns the adapters column: "a, b" (all loaded at start), "a, b (1 loaded at a time)" or "-"."""
    if not model.adapters:
        return "-"
    names = ", ".join(a.name for a in model.adapters)
    if model.max_loaded_adapters:
        return f"{names} ({model.max_loaded_adapters} loaded at a time)"
    return names


def _adapter_options(items: tuple[str, ...]) -> list[dict[str, str]]:
    """Returns ``--adapter NAME=SOURCE`` values as catalog data; exits with a message on a malformed one."""
    adapters = []
    for item in items:
        name, sep, source = item.partition("=")
        if not sep or not name:
            fail(f"--adapter {item!r}: expected NAME=SOURCE (a local path, http(s) URL or hf://org/repo)")
        adapters.append({"name": name, "source": source})
    return adapters


@models.command("add")
@click.argument("name", required=False)
@click.option("--file", "-f", "file", type=click.File(), help="A model as YAML or JSON (fields as in `models list --json`).")
@click.option("--engine", "-e", help="sim, llama.cpp, vllm or sglang.")
@click.option("--source", default="", help="Where the weights are (a local path for now).")
@click.option("--replicas", type=int, help="Replicas to run [1].")
@click.option("--memory-mb", type=int, help="Memory each replica reserves on its node.")
@click.option("--cpu-cores", type=float, help="CPU cores each replica reserves.")
@click.option("--gpus", type=int, help="Whole GPUs per replica.")
@click.option("--arg", "args", multiple=True, help="Engine argument (repeat for several).")
@click.option("--env", "envs", multiple=True, help="Engine environment variable KEY=VALUE (repeat).")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=SOURCE",
              help="A LoRA adapter: its name (requests name it as their model) and where its files are (repeat).")
@click.option("--max-loaded-adapters", type=int,
              help="vllm/sim: at most N adapters loaded per replica, loaded on first use [0: all at start].")
@click.option("--replace", is_flag=True, help="Replace the model if it exists.")
@json_option
@click.pass_context
def models_add(ctx: click.Context, name: str | None, file: Any, engine: str | None, source: str,
               replicas: int | None, memory_mb: int | None, cpu_cores: float | None, gpus: int | None,
               args: tuple[str, ...], envs: tuple[str, ...], adapters: tuple[str, ...],
               max_loaded_adapters: int | None, replace: bool, as_json: bool) -> None:
    """Add a model to the catalog; the cluster places its replicas."""
    data: dict[str, Any] = {}
    if file is not None:
        try:
            loaded = yaml.safe_load(file)
        except yaml.YAMLError as exc:
            fail(f"{file.name}: not valid YAML/JSON: {exc}")
        if not isinstance(loaded, dict):
            fail(f"{file.name}: expected a mapping with name, engine, source, profile")
        data = loaded
    if name:
        data["name"] = name
    if engine:
        data["engine"] = engine
    if source:
        data["source"] = source
    profile = dict(data.get("profile") or {})
    for key, value in (("replicas", replicas), ("memory_mb", memory_mb), ("cpu_cores", cpu_cores), ("gpus", gpus)):
        if value is not None:
            profile[key] = value
    if args:
        profile["engine_args"] = list(args)
    if envs:
        env = {}
        for item in envs:
            key, sep, value = item.partition("=")
            if not sep:
                fail(f"--env {item!r}: expected KEY=VALUE")
            env[key] = value
        profile["engine_env"] = env
    if profile:
        data["profile"] = profile
    if adapters:
        data["adapters"] = list(data.get("adapters") or []) + _adapter_options(adapters)
    if max_loaded_adapters is not None:
        data["max_loaded_adapters"] = max_loaded_adapters
    try:
        spec = validate_model(data)
    except CatalogError as exc:
        fail(str(exc))
    target = _target(ctx, as_json)
    saved = target.run(lambda c: c.add_model(spec, replace=replace))
    if target.json:
        return print_json(model_to_dict(saved))
    click.echo(f"model {saved.name!r} {'saved' if replace else 'added'}: {saved.profile.replicas} replica(s) "
               f"on {saved.engine}; watch them with `llmgw ctl replicas -m {saved.name}`")


@models.command("remove")
@click.argument("name")
@json_option
@click.pass_context
def models_remove(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove a model from the catalog; its replicas are stopped."""
    target = _target(ctx, as_json)
    removed = target.run(lambda c: c.remove_model(name))
    if target.json:
        return print_json({"removed": removed, "name": name})
    if not removed:
        fail(f"no model {name!r} in the catalog (see `llmgw ctl models list`)")
    click.echo(f"model {name!r} removed; its replicas are being stopped")


@ctl.group()
def certs() -> None:
    """Certificates of the cluster CA (run on a control plane host: needs the CA key)."""


@certs.command("issue")
@click.option("--role", type=click.Choice(["node", "admin", "control"]), required=True)
@click.option("--name", required=True, help="Node id, admin name or control plane name.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Directory for ca.pem, cert.pem, key.pem.")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None,
              help="The control plane's state directory holding ca/ [the local `llmgw up` cluster].")
@click.option("--san", "sans", multiple=True, help="Address or DNS name (control certificates).")
def certs_issue(role: str, name: str, out: Path, state_dir: Path | None, sans: tuple[str, ...]) -> None:
    """Issue a certificate from the cluster CA into a directory."""
    from llmgw.cli.pki import CA_DIR, issue_to
    from llmgw.rpc.tls import ClusterCA, TLSFileError

    state_dir = state_dir or default_up_dir()
    try:
        ca = ClusterCA.load(state_dir / CA_DIR)
        creds = issue_to(ca, role, name, out, sans)
    except (TLSFileError, ValueError, OSError) as exc:
        fail(str(exc))
    click.echo(f"issued {creds.identity} into {out} (ca.pem, cert.pem, key.pem)")


# Tenants, API keys, usage, stop/start live in their own module; importing it registers them.
from llmgw.cli import ctl_keys  # noqa: E402,F401  (after `ctl` is defined: it imports it)
