"""The control plane process, wired in one place: store, election, live registry, reconciler, RPC port, gateway.

The gateway is given (:func:`llmgw.router.build.build_gateway` makes it) and driven only
through :class:`~llmgw.router.interface.GatewayInterface`, whether it serves in this
process or through worker processes. Every handler gets its collaborators explicitly
(:class:`~llmgw.control.cluster.ClusterServices`, :class:`~llmgw.control.admin.AdminServices`).

Any number of control planes may share one store; one leads (:mod:`llmgw.control.leader`).
What only the leader does runs in a :class:`Term`, made each time this control plane
takes the lead and cancelled, with every node session of it, the moment the lead is lost.
A standby feeds its gateway from the leader's stream (:mod:`llmgw.control.peers`) and
passes admin calls to the leader.

Nursery tree::

    run_control_plane
    ├── access sync (keys, tenants, serving.stopped, routing -> the gateway; usage -> the store)
    ├── admission shares (the gateway's share of the tenant limits: 1/N without a leader)
    ├── gateway (GatewayInterface.serve; its last usage is stored when it stops)
    ├── rpc listener ── per connection: Cluster bootstrap ── node session / admin / peer stream
    ├── follower (while a standby: the peer session with the leader, into the gateway)
    └── election ── while leading: Term
                     ├── registry watchdog (marks silent nodes LOST)
                     ├── reconciler (once the known nodes are back: catalog vs fleet, one pass at a time)
                     ├── route feed (catalog x ready replicas -> the gateway and the standbys)
                     ├── admission shares (every second: demand -> each gateway's share of the tenant limits)
                     └── settings push (agents.* settings -> every node, a second after a change)
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import ssl
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import attrs
import trio

from llmgw import __version__
from llmgw.config import AuthConfig, ServingConfig
from llmgw.config.defaults import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_NODE_LOST_AFTER, DEFAULT_REPLACE_GRACE
from llmgw.config.values import is_loopback_host
from llmgw.control.admin import AdminServices, make_admin
from llmgw.control.admission_shares import LocalShares, ShareBook, lead_shares
from llmgw.control.cluster import ClusterServices, handle_connection
from llmgw.control.firewall_file import keep_firewall_file
from llmgw.control.settings import FIREWALL
from llmgw.control.joining import JoinService
from llmgw.control.http_api import HttpAdminApi
from llmgw.control.keys import SERVING_STOPPED, AccessSync
from llmgw.control.leader import LEADER_LEASE_S, LeaderElection
from llmgw.control.peers import FeedTee, Follower
from llmgw.control.reconciler import Reconciler
from llmgw.control.fleet_metrics import FleetMetrics
from llmgw.control.registry import Registry
from llmgw.control.training import JobScheduler
from llmgw.control.routes import NOT_READY_REASON, RouteFeed
from llmgw.control.sessions import NodeSessions
from llmgw.control.settings_push import SettingsPush
from llmgw.control.store import Store, open_store
from llmgw.router.interface import GatewayInterface
from llmgw.rpc import net
from llmgw.rpc.tls import ClusterCA, Identity
from llmgw.spec import ModelSpec, not_leader_message
from llmgw.trioutil import unwrap_single_group

log = logging.getLogger(__name__)

#: A restart asked for over RPC waits this long, so the call's answer is on the wire first.
REPLY_GRACE_S = 0.2


@attrs.frozen
class Term:
    """What this control plane runs while it leads, at one epoch."""

    epoch: int
    registry: Registry
    sessions: NodeSessions
    reconciler: Reconciler
    tee: FeedTee
    admin: AdminServices
    #: Tells the reconciler and the route feed that the catalog changed.
    catalog_changed: Callable[[], None]
    #: The gateways' shares of the tenant limits (llmgw/control/admission_shares.py).
    shares: ShareBook | None = None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@attrs.define
class ControlPlane:
    """A running control plane, as the program that started it sees it."""

    store: Store
    election: LeaderElection
    #: Keys, tenants, ``serving.stopped`` and ``routing`` into the gateway (``reload`` after a direct store change).
    access: AccessSync
    rpc_port: int
    http_port: int
    #: The gateway's base URL (``http://host:port``).
    gateway_url: str
    #: The current term while this control plane leads, else None.
    term: Term | None = None

    @property
    def registry(self) -> Registry:
        """The live registry of the current term; raises RuntimeError while not leading."""
        if self.term is None:
            raise RuntimeError("this control plane does not lead: it has no registry of the nodes")
        return self.term.registry

    def catalog_changed(self) -> None:
        """Call after changing the catalog in the store directly: the reconciler and the
        gateway see it (a standby's gateway through the leader, which must be told there)."""
        if self.term is not None:
            self.term.catalog_changed()


async def run_control_plane(
    *,
    store_url: str,
    rpc_host: str,
    rpc_port: int,
    http_host: str,
    http_port: int,
    server_context: ssl.SSLContext,
    gateway: GatewayInterface,
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
    lost_after: float = DEFAULT_NODE_LOST_AFTER,
    replace_grace: float = DEFAULT_REPLACE_GRACE,
    auth: AuthConfig = AuthConfig(),
    serving: ServingConfig = ServingConfig(),
    engines: Mapping[str, str] | None = None,
    usage_journal: Path | None = None,
    releases_dir: Path | None = None,
    firewall_file: Path | None = None,
    firewall_ports: Sequence[int] = (),
    name: str = "",
    advertise_host: str = "",
    peer_context: ssl.SSLContext | None = None,
    leader_lease: float = LEADER_LEASE_S,
    request_restart: Callable[[str, int | None], None] | None = None,
    join_ca: ClusterCA | None = None,
    serial: str = "",
    task_status: trio.TaskStatus[ControlPlane] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a control plane, and serve ``gateway``, until cancelled.

    Signals the :class:`ControlPlane` as started value once the store is open, the
    gateway and the RPC port are listening (``rpc_port``/``http_port`` of the returned
    object are the bound ports; 0 asks for free ones) and the first election attempt is
    made (a lone control plane leads by then). Raises the store's error if the
    database cannot be opened, and ``OSError`` if a port is taken. Cancellation closes
    every connection, stops the gateway and stores its last usage, gives up the lead,
    then closes the store; engines on the nodes are not touched. ``auth`` is the gateway's
    API-key switch (read only to warn when keys are off beyond loopback: the gateway was
    built with it), ``serving`` gives the usage flush interval (``server.yaml`` sections);
    ``usage_journal`` is the directory the gateway journals its usage in (replayed into the
    store before the gateway serves: :mod:`llmgw.control.usage_replay`). ``engines``
    (name -> version, "" = the installer's default) is what every node is told to install.

    Several control planes: ``name`` is this one's (its certificate's), ``advertise_host``
    the address others reach its ports at (default: the listening host), ``peer_context``
    the client TLS context (its own certificate) a standby dials the leader with (None:
    this one never streams from a leader), ``leader_lease`` the lease in seconds.
    ``join_ca`` (the cluster CA with its key) lets this control plane answer joins with a
    token on connections without a certificate (``server_context`` must allow them);
    ``serial`` is its own certificate's serial, recorded in the store (a revoked one
    raises :class:`~llmgw.control.store.base.CertificateRevokedError`).
    ``request_restart(reason, exit_status)`` asks the program to stop this control plane
    gracefully and run it again (``llmgw ctl restart``; with an exit status, by exiting with it
    so the service manager starts the release ``llmgw ctl upgrade`` installed; None: it cannot,
    and says so). ``releases_dir`` keeps uploaded releases; ``firewall_file`` is where this
    control plane writes its machine's firewall (``firewall_ports`` protected besides RPC).
    """
    with unwrap_single_group():
        async with open_store(store_url) as store, trio.open_nursery() as nursery:
            # Not ready until a term's route feed (or, on a standby, the leader's first table) says so.
            gateway.set_readiness(NOT_READY_REASON)
            access = AccessSync(store, gateway, usage_flush_interval=serving.usage_flush_interval,
                                usage_journal=usage_journal)
            await nursery.start(access.run)
            # Each gateway's share of every tenant limit: 1/N until a leader says otherwise.
            listed = {record.name for record in await store.list_control_planes()}
            shares = LocalShares(gateway, len(listed | {name}) if name else len(listed))
            await nursery.start(shares.run)
            if not auth.enabled and not is_loopback_host(http_host):
                log.warning(
                    "API KEYS ARE OFF (auth.enabled: false) AND THE GATEWAY LISTENS ON %s, NOT LOOPBACK: "
                    "ANYONE WHO CAN REACH IT CAN USE EVERY MODEL. Turn auth on for anything but a "
                    "loopback demo.", http_host,
                )
            bound_http = await nursery.start(access.serve, http_host, http_port)
            gateway_url = f"http://{_url_host(http_host)}:{bound_http}"
            plane_ref: list[ControlPlane] = []

            def restart_self(reason: str, exit_status: int | None = None) -> None:
                if request_restart is None:
                    raise RuntimeError("this control plane cannot restart itself (llmgw up): restart it by hand")

                async def later() -> None:
                    await trio.sleep(REPLY_GRACE_S)  # the call that asked gets its answer first
                    request_restart(reason, exit_status)

                nursery.start_soon(later)

            follower = Follower(gateway, access.reload, restart_self, releases_dir)
            follower.shares = shares

            def current_term() -> Term | None:
                return plane_ref[0].term if plane_ref else None

            async def admin_for(actor: str, via: str) -> Any:
                term = current_term()
                if term is not None:
                    return make_admin(term.admin, actor, via=via)
                return await follower.admin(actor)

            def not_leader() -> str:
                leader = plane_ref[0].election.leader if plane_ref else None
                if leader is None or current_term() is not None or leader.name == name:
                    return f"control plane {name or '(unnamed)'} does not lead yet: try again in a few seconds"
                return not_leader_message(name or "(unnamed)", leader.name, leader.rpc_address, leader.epoch)

            async def control_planes() -> list[str]:
                me = plane_ref[0].election.rpc_address if plane_ref else ""
                others = [r.rpc_address for r in await store.list_control_planes() if r.rpc_address != me]
                return [me, *others] if me else others

            # /api/v1/* on the gateway port: admin tokens, through the same Admin as ctl.
            gateway.set_admin_api(HttpAdminApi(store, admin_for))
            joins = None if join_ca is None else JoinService(store, join_ca, store_url, leader_lease, control_planes)
            cluster = ClusterServices(
                store=store, heartbeat_interval=heartbeat_interval, term=current_term, not_leader=not_leader,
                make_admin=admin_for, control_planes=control_planes, joins=joins,
            )

            async def handler(stream: trio.SSLStream, identity: Identity | None) -> None:
                await handle_connection(cluster, stream, identity)

            bound_rpc = await nursery.start(net.listen, handler, rpc_host, rpc_port, server_context)
            host = _url_host(advertise_host or rpc_host)
            rpc_address = f"{host}:{bound_rpc}"
            http_address = f"http://{host}:{bound_http}"
            name = name or rpc_address
            election = LeaderElection(store_url, store, name=name, rpc_address=rpc_address,
                                      http_address=http_address, lease=leader_lease)
            await store.record_control_plane(name, rpc_address, http_address, serial)
            plane = ControlPlane(store=store, election=election, access=access, rpc_port=bound_rpc,
                                 http_port=bound_http, gateway_url=gateway_url)
            plane_ref.append(plane)
            # The fleet's telemetry on the gateway's /metrics, from the leader's registry.
            gateway.set_extra_metrics(FleetMetrics(
                lambda: plane.term.registry.snapshot() if plane.term is not None else None, trio.current_time,
                lambda: plane.term.admin.jobs.running() if plane.term is not None else ()).render)

            async def leadership() -> dict[str, Any]:
                return await _leadership_fields(store, election, plane.term, follower)

            async def lead(epoch: int, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                registry = Registry(lost_after=lost_after, replace_grace=replace_grace)
                sessions = NodeSessions(registry, wanted_engines=dict(engines or {}))
                inherited = follower.routes
                tee = FeedTee(gateway, inherited)
                sessions.on_kv_update = tee.kv_update
                registry.on_shard_gone = tee.kv_forget
                access.on_change = tee.access_changed
                try:
                    async with trio.open_nursery() as term_nursery:
                        await term_nursery.start(registry.watchdog)
                        reconciler = Reconciler(registry, functools.partial(desired_models, store), sessions)
                        routes = RouteFeed(store, registry, tee, heartbeat_interval=heartbeat_interval,
                                           inherited=inherited[0] if inherited else None)
                        await term_nursery.start(routes.run)

                        async def reconcile_once_rejoined() -> None:
                            # Placing before the nodes are back would start replicas that already run.
                            await routes.rejoined.wait()
                            await reconciler.run()

                        term_nursery.start_soon(reconcile_once_rejoined)

                        def catalog_changed() -> None:
                            reconciler.catalog_changed()
                            routes.catalog_changed()

                        push = SettingsPush(store, sessions)
                        await term_nursery.start(push.run)
                        jobs = JobScheduler(store, registry, sessions, catalog_changed)
                        sessions.job_results = jobs.result_piece
                        await term_nursery.start(jobs.run)
                        admin = AdminServices(
                            store=store, registry=registry, sessions=sessions, reconciler=reconciler,
                            gateway=gateway, access=access, catalog_changed=catalog_changed,
                            gateway_url=gateway_url, agent_settings_changed=push.changed, leadership=leadership,
                            tee=tee, restart_self=restart_self, joins=joins, releases_dir=releases_dir, jobs=jobs,
                        )
                        async def planes() -> list[str]:
                            return [record.name for record in await store.list_control_planes()]

                        book = ShareBook(name)
                        await term_nursery.start(lead_shares, book, shares, lambda: tee.peer_names, tee.send_shares,
                                                 planes)
                        plane.term = Term(epoch=epoch, registry=registry, sessions=sessions, reconciler=reconciler,
                                          tee=tee, admin=admin, catalog_changed=catalog_changed, shares=book)
                        task_status.started()
                        await trio.sleep_forever()
                finally:
                    plane.term = None
                    access.on_change = None
                    follower.routes = tee.routes  # the gateway routes by it until a leader sends another
                    sessions.close_all()

            async def publish_leader() -> None:
                while True:  # no await between reading and waiting: no change is missed
                    leader = election.leader
                    gateway.set_leader(election.leading, leader.name if leader else "", leader.epoch if leader else 0)
                    await election.wait_changed()

            nursery.start_soon(publish_leader)
            if firewall_file is not None:
                async def firewall_setting() -> object:
                    stored = await store.get_setting(FIREWALL)
                    return stored.value if stored is not None else None

                async def firewall_peers() -> list[str]:
                    hosts = [net.split_address(r.rpc_address)[0] for r in await store.list_control_planes()]
                    if plane.term is not None:  # the leader also knows where its nodes are (their addresses)
                        hosts += [n.address for n in plane.term.registry.snapshot().nodes.values()]
                    return [h for h in hosts if _is_ip(h)]

                await nursery.start(keep_firewall_file, firewall_file, firewall_setting, [bound_rpc, *firewall_ports],
                                    firewall_peers)
            await nursery.start(election.run, lead)
            if peer_context is not None:
                nursery.start_soon(follower.follow, election, peer_context)
            log.info("control plane %s: rpc on %s:%d, gateway on %s (%s)", name, rpc_host, bound_rpc, gateway_url,
                     f"leads at epoch {election.epoch}" if election.leading else "standby")
            task_status.started(plane)


async def desired_models(store: Store) -> list[ModelSpec]:
    """Returns the catalog as the reconciler should run it: every model at no replicas while
    the cluster setting ``serving.stopped`` is on (``llmgw ctl stop``), as stored otherwise."""
    models = await store.list_models()
    stopped = await store.get_setting(SERVING_STOPPED)
    if stopped is not None and stopped.value:
        return [attrs.evolve(m, profile=attrs.evolve(m.profile, replicas=0)) for m in models]
    return models


async def _leadership_fields(
    store: Store, election: LeaderElection, term: Term | None, follower: Follower,
) -> dict[str, Any]:
    """Returns who leads and every control plane's role, as ``ClusterStatus`` fields."""
    leader = election.leader
    rows = []
    for record in await store.list_control_planes():
        version = ""
        if leader is not None and record.name == leader.name and term is not None:
            role, version = "leader", __version__
        elif term is not None:
            role = "standby" if record.name in term.tee.peer_names else "down"
            version = term.tee.version_of(record.name)
        else:
            role = "standby" if record.name == election.name and follower.peer is not None else "unknown"
            version = __version__ if record.name == election.name else ""
        rows.append({"name": record.name, "rpcAddress": record.rpc_address, "httpAddress": record.http_address,
                     "role": role, "lastSeen": record.last_seen, "version": version})
    return {
        "leader": leader.name if leader is not None else "",
        "epoch": leader.epoch if leader is not None else 0,
        "leaderSince": leader.since if leader is not None else 0.0,
        "controlPlanes": rows,
    }


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
