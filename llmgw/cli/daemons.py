"""``llmgw server`` and ``llmgw agent``: the two long-running daemons (see systemd/)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import click
import trio

from llmgw.cli.common import setup_logging
from llmgw.control.firewall_file import FIREWALL_FILE
from llmgw.cli.output import fail
from llmgw.cli.pki import ADMIN_DIR, CA_DIR, SERVER_DIR, ensure_cluster_pki
from llmgw.cli.agent_join import agent_join
from llmgw.cli.server_join import server_join
from llmgw.cli.signals import run_daemon
from llmgw.config import ConfigError, load_agent_config, load_server_config
from llmgw.config.values import is_loopback_host
from llmgw.control.store import STORE_DIR_MODE, StoreError
from llmgw.rpc.tls import CA_KEY_FILE, ClusterCA, TLSFileError, client_ssl_context, read_credentials, server_ssl_context

log = logging.getLogger(__name__)


#: Where the daemons look for their config file when --config is not given.
ETC_DIR = Path("/etc/llmgw")


def _metrics_ports(config: Any) -> list[int]:
    """The metrics port, when /metrics has a listener of its own reachable beyond loopback
    (the control plane's firewall protects it; llmgw/control/firewall_file.py)."""
    listen = config.metrics.listen
    return [listen.port] if listen is not None and not is_loopback_host(listen.host) else []


def exec_again(message: str) -> None:
    """Log ``message`` and run this same command again in this process (exec: a service
    manager sees no exit, the pid stays). Does not return."""
    log.warning("%s", message)
    logging.shutdown()
    os.execv(sys.executable, [sys.executable, "-m", "llmgw", *sys.argv[1:]])


def _config_path(given: Path | None, name: str) -> Path | None:
    if given is not None:
        return given
    default = ETC_DIR / name
    return default if default.exists() else None


def _server_config(path: Path | None):  # type: ignore[no-untyped-def]
    try:
        return load_server_config(_config_path(path, "server.yaml"))
    except ConfigError as exc:
        fail(str(exc))


@click.group(invoke_without_command=True)
@click.option("--config", "-c", "config_path", type=click.Path(path_type=Path), default=None,
              help="server.yaml [/etc/llmgw/server.yaml when present, else defaults].")
@click.pass_context
def server(ctx: click.Context, config_path: Path | None) -> None:
    """Run the control plane and gateway (`llmgw server init` first).

    SIGTERM or SIGINT drains it: no new connections, in-flight requests get
    ``gateway.shutdown_grace`` seconds (streams still open then end with an SSE error
    event), the usage counted is stored, node sessions close, exit status 0. A second
    signal exits at once.
    """
    ctx.ensure_object(dict)
    ctx.obj["config_path"] = config_path
    if ctx.invoked_subcommand is not None:
        return
    config = _server_config(config_path)
    setup_logging(config.log_level)
    try:
        creds = read_credentials(config.state_dir / SERVER_DIR)
    except TLSFileError as exc:
        fail(f"{exc}\n(first run? create the cluster CA and certificates with `llmgw server init`)")
    join_ca = _join_ca(config.state_dir)
    from llmgw.control.plane import run_control_plane
    from llmgw.gctune import tune_for_serving
    from llmgw.router.build import build_gateway
    from llmgw.router.metrics_access import metrics_listener
    from llmgw.router.settings import GatewaySettings
    from llmgw.rpc.kjtrio import capnp_runtime

    restart: list[tuple[str, int | None]] = []  # why this control plane restarts itself, and how

    async def main() -> None:
        async with capnp_runtime(), trio.open_nursery() as nursery:
            restarting = trio.Event()

            def request_restart(reason: str, exit_status: int | None = None) -> None:
                restart.append((reason, exit_status))
                restarting.set()

            settings = GatewaySettings.of(config)
            gateway = build_gateway(settings)
            tune_for_serving()  # set up: what is alive now is never garbage (llmgw/gctune.py)
            await nursery.start(metrics_listener, gateway.scrape, config.metrics)
            plane = await nursery.start(
                lambda task_status: run_control_plane(
                    store_url=config.store.url,
                    rpc_host=config.rpc_listen.host,
                    rpc_port=config.rpc_listen.port,
                    http_host=config.http_listen.host,
                    http_port=config.http_listen.port,
                    server_context=server_ssl_context(creds.ca_pem, creds.cert_pem, creds.key_pem,
                                                      allow_anonymous=join_ca is not None),
                    heartbeat_interval=config.heartbeat_interval,
                    lost_after=config.node_lost_after,
                    replace_grace=config.replace_grace,
                    gateway=gateway,
                    engines=config.engines,
                    auth=config.auth,
                    serving=config.serving,
                    usage_journal=settings.usage_journal,
                    releases_dir=config.state_dir / "releases",
                    firewall_file=config.state_dir / FIREWALL_FILE,
                    firewall_ports=_metrics_ports(config),
                    name=creds.identity.name,
                    advertise_host=config.advertise_hosts[0] if config.advertise_hosts else "",
                    peer_context=client_ssl_context(creds.ca_pem, creds.cert_pem, creds.key_pem),
                    leader_lease=config.leader_lease,
                    request_restart=request_restart,
                    join_ca=join_ca,
                    serial=creds.identity.serial,
                    task_status=task_status,
                )
            )
            click.echo(f"llmgw server: rpc {config.rpc_listen.host}:{plane.rpc_port}, "
                       f"gateway {plane.gateway_url}/v1", err=True)
            await restarting.wait()
            nursery.cancel_scope.cancel()  # as a stop signal would: drained, usage stored

    try:
        run_daemon(main, "llmgw server")
    except StoreError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot start: {exc}")
    if restart:
        reason, exit_status = restart[0]
        if exit_status is not None:  # an upgrade: the service manager starts the new release
            logging.getLogger("llmgw.server").warning("llmgw server: %s: exiting with status %d for the service "
                                                      "manager to start it", reason, exit_status)
            sys.exit(exit_status)
        exec_again(f"llmgw server: restarting ({reason})")


def _join_ca(state_dir: Path) -> ClusterCA | None:
    """Returns the cluster CA in ``state_dir`` when this control plane holds its key (it then
    answers joins with a token), else None; an unusable CA directory is a clear exit."""
    if not (state_dir / CA_DIR / CA_KEY_FILE).exists():
        return None
    try:
        return ClusterCA.load(state_dir / CA_DIR)
    except TLSFileError as exc:
        fail(str(exc))


@server.command("init")
@click.option("--name", default=None, help="This control plane's name in its certificate [hostname].")
@click.pass_context
def server_init(ctx: click.Context, name: str | None) -> None:
    """Create the cluster CA, this server's certificate and a local admin certificate."""
    config = _server_config(ctx.obj["config_path"])
    state = config.state_dir
    try:
        state.mkdir(mode=STORE_DIR_MODE, parents=True, exist_ok=True)  # it holds the SQLite store
        ca, created = ensure_cluster_pki(
            state, server_name=name or socket.gethostname(),
            sans=[*config.advertise_hosts, config.rpc_listen.host],
        )
    except (TLSFileError, ValueError, OSError) as exc:
        fail(str(exc))
    click.echo(("created" if created else "kept existing") + f" cluster CA in {state / CA_DIR}")
    click.echo(f"  CA fingerprint: {ca.fingerprint}")
    click.echo(f"  server certificate: {state / SERVER_DIR}")
    click.echo(f"  admin certificate for `llmgw ctl --tls-dir`: {state / ADMIN_DIR}")
    click.echo("For each node: llmgw ctl certs issue --state-dir "
               f"{state} --role node --name NODE_ID --out DIR, then copy DIR to the node's tls directory.")


server.add_command(server_join)


@click.group(invoke_without_command=True)
@click.option("--config", "-c", "config_path", type=click.Path(path_type=Path), default=None,
              help="agent.yaml [/etc/llmgw/agent.yaml when present, else defaults].")
@click.pass_context
def agent(ctx: click.Context, config_path: Path | None) -> None:
    """Run the node agent: join the control plane and supervise engines.

    On a new node, `llmgw agent join` (with a token from `llmgw ctl nodes add`) first.

    SIGTERM or SIGINT closes the session and exits 0, leaving the engines running: the
    next agent adopts them (restart and upgrade cost no request). Only an explicit stop
    from the control plane ends an engine.
    """
    ctx.ensure_object(dict)
    ctx.obj["config_path"] = config_path
    if ctx.invoked_subcommand is not None:
        return
    config_file = _config_path(config_path, "agent.yaml")
    try:
        config = load_agent_config(config_file)
    except ConfigError as exc:
        fail(str(exc))
    from llmgw.node.cluster_settings import ClusterSettings, read_layer

    layer = read_layer(config.state_dir)
    refused = ""
    if layer:
        try:
            config = load_agent_config(config_file, overrides=layer)
        except ConfigError as exc:
            refused, layer = str(exc), {}
    setup_logging(config.log_level)
    from llmgw.logbook import keep_in_memory

    keep_in_memory()  # the last lines, for `llmgw ctl logs NODE` over the session
    if refused:
        log.error("the cluster settings kept in %s do not load with agent.yaml (%s): running on agent.yaml alone",
                  config.state_dir, refused)
    settings = ClusterSettings(config.state_dir, layer, config,
                               lambda layer: load_agent_config(config_file, overrides=layer), config_file)
    try:
        creds = read_credentials(config.tls.ca, config.tls.cert, config.tls.key)
    except TLSFileError as exc:
        fail(str(exc))
    if creds.identity.name != config.node_id:
        fail(f"the certificate in {config.tls.cert} is for {creds.identity}, but node_id is {config.node_id!r}: "
             "set node_id to match, or issue a certificate for this node id")
    from llmgw.node import discovery
    from llmgw.node.agent import Agent, DeskLink
    from llmgw.node.engine_user import ENGINE_HOME_DIR, wanted_user
    from llmgw.node.engines import node_engines
    from llmgw.node.fetch import FetchSettings
    from llmgw.node.install import Converger, InstallSettings, build_installers
    from llmgw.node.install.as_user import as_engine_user
    from llmgw.node.install.python_env import default_root
    from llmgw.node.job_training import make_train
    from llmgw.node.jobs import JobRunner
    from llmgw.node.statelock import StateDirLocked
    from llmgw.node.supervisor import Supervisor
    from llmgw.rpc.kjtrio import capnp_runtime

    planes = [str(a) for a in config.control_planes]
    engine_host = config.engine_host or discovery.route_address(config.control_planes[0].host)
    try:
        config.state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot create the state directory {config.state_dir}: {exc.strerror or exc}")

    async def main() -> None:
        async with capnp_runtime():
            gpus, _ = discovery.read_gpus()
            install_settings = InstallSettings(
                install_dir=config.install_dir,
                cache_dir=config.cache_dir,
                url_templates=config.engine_urls,
                pypi_index=config.pypi_index,
                has_nvidia_gpu=bool(gpus),
                engine_paths=config.engine_paths,
            )
            engine_user = wanted_user(config.engine_user)
            engine_home = config.state_dir / ENGINE_HOME_DIR
            # Installs and checks run as the engines' user, never as root (llmgw/node/install/as_user.py).
            installers = as_engine_user(build_installers(install_settings), install_settings, engine_user, engine_home)
            desk_link = DeskLink()
            fetch = FetchSettings(weights_dir=config.weights_dir, hf_endpoint=config.hf_endpoint,
                                  hf_token=os.environ.get("HF_TOKEN", ""), job_results=desk_link.piece)
            jobs = JobRunner(config.state_dir / "jobs", make_train(
                engines_root=config.install_dir or default_root(), llamacpp_cache=config.cache_dir / "llama.cpp",
                fetch=fetch, engine_user=engine_user,
                engine_home=engine_home))
            node = Agent(
                node_id=config.node_id,
                control_planes=planes,
                context=client_ssl_context(creds.ca_pem, creds.cert_pem, creds.key_pem),
                supervisor=Supervisor(config.state_dir / "shards", host=engine_host, fetch_settings=fetch,
                                      engines=node_engines(config.llamacpp_threads, config.engine_paths),
                                      disabled_engines=config.disabled_engines,
                                      engine_user=engine_user),
                engine_host=engine_host,
                backoff_max=config.reconnect_backoff_max,
                heartbeat_interval=config.heartbeat_interval,
                converger=Converger(installers, disabled=config.disabled_engines),
                weights_dir=config.weights_dir,
                labels=config.labels,
                cluster_settings=settings,
                manage_firewall=config.firewall,
                jobs=jobs,
                desk_link=desk_link,
            )
            await node.run()

    try:
        run_daemon(main, "llmgw agent")
    except* StateDirLocked as group:  # another agent runs on this state directory
        locked: BaseException = group
        while isinstance(locked, BaseExceptionGroup):
            locked = locked.exceptions[0]
        fail(str(locked))
    if settings.restart.is_set():
        if settings.exit_status is not None:  # an upgrade: the service manager starts the new release
            logging.getLogger("llmgw.agent").warning("agent: %s: exiting with status %d for the service manager "
                                                     "to start it", settings.reason, settings.exit_status)
            sys.exit(settings.exit_status)
        # The new agent reads its configuration afresh and adopts the engines, which kept running.
        exec_again(f"agent: restarting ({settings.reason})")


agent.add_command(agent_join)
