"""The control plane process: store, live registry, reconciler, RPC port and gateway.

Nursery tree::

    run_control_plane
    ├── registry watchdog (marks silent nodes LOST)
    ├── reconciler (catalog vs fleet, one placement pass at a time)
    ├── gateway feed (registry changes -> the gateway's replica table)
    ├── gateway (hypercorn + quart-trio), or with gateway.workers > 1 the GatewayPool
    │   (worker processes on the same port, fed over a channel each: gateway_pool.py)
    └── rpc listener ── per connection: Cluster bootstrap ── node session / admin
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
from typing import Any, Mapping

import attrs
import trio

from llmgw.config import AuthConfig, GatewayConfig, RoutingConfig, ServingConfig, TracingConfig
from llmgw.control.cluster import handle_connection
from llmgw.control.reconciler import Reconciler
from llmgw.control.registry import Registry
from llmgw.control.sessions import NodeSessions
from llmgw.control.store import Store, open_store
from llmgw.rpc import net
from llmgw.rpc.kjtrio import unwrap_single_group
from llmgw.rpc.tls import Identity
from llmgw.control.keys import AccessSync
from llmgw.control.gateway_pool import (
    GatewayPool, ObservedAuthTable, ObservedTable, PooledAccessSync, PooledAdmission, WorkerSettings,
)
from llmgw.router.admission import Admission, AdmissionLimits
from llmgw.router.app import Gateway, create_app, gateway_of
from llmgw.router.auth import AuthTable
from llmgw.router.kvrouting import make_policy
from llmgw.router.replicas import LoadTracker, ModelInfo, Replica, ReplicaTable
from llmgw.router.serve import serve_gateway
from llmgw.router.tracing import create_tracer
from llmgw.spec import KvDelta, ModelSpec
from llmgw.router.upstream import UpstreamTimeouts

log = logging.getLogger(__name__)

#: Reading the catalog for the gateway's model list; on failure the old list stays.
CATALOG_READ_TIMEOUT = 10.0


@attrs.define
class ControlPlane:
    """Everything the RPC handlers and the admin API need, for one running control plane."""

    store: Store
    registry: Registry
    sessions: NodeSessions
    table: ReplicaTable
    heartbeat_interval: float
    reconciler: Reconciler | None = None
    gateway_url: str = ""
    rpc_port: int = 0
    http_port: int = 0
    node_versions: dict[str, str] = attrs.field(factory=dict)
    gateway: Gateway | None = None
    pool: GatewayPool | None = None  # gateway.workers > 1: the worker processes mirroring ``gateway``
    access: AccessSync | None = None  # keys, tenants, serving.stopped -> gateway; usage -> store
    _catalog_version: int = 0
    _catalog_event: trio.Event = attrs.field(factory=trio.Event)

    def kv_update(self, shard_id: str, delta: KvDelta) -> None:
        """A shard's KV-cache delta arrived through its reporter: into the gateway's KV index
        (and, with gateway workers, queued for each of them: the master applies it first)."""
        if self.gateway is not None:
            self.gateway.kv_update(shard_id, delta)
        if self.pool is not None:
            self.pool.kv_update(shard_id, delta)

    def kv_forget(self, shard_id: str) -> None:
        """A shard stopped, failed or lost its node: the gateway (and every worker) drops its KV-cache state."""
        if self.gateway is not None:
            self.gateway.kv_forget(shard_id)
        if self.pool is not None:
            self.pool.kv_forget(shard_id)

    def catalog_changed(self) -> None:
        """The catalog changed: wake the reconciler and refresh the gateway's model list."""
        if self.reconciler is not None:
            self.reconciler.catalog_changed()
        self._catalog_version += 1
        self._catalog_event.set()
        self._catalog_event = trio.Event()

    def unplaceable_reasons(self) -> list[str]:
        if self.reconciler is None:
            return []
        return [u.reason for u in self.reconciler.last_unplaceable] + [
            w.reason for w in self.reconciler.last_waiting
        ]

    async def _catalog(self) -> list[Any]:
        return await self.store.list_models()

    async def feed_gateway(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the gateway's replica table equal to catalog models x ready replicas.

        Runs until cancelled. A store that cannot be read keeps the previous model
        list (the gateway goes on routing) and is retried on the next change.
        """
        infos: dict[str, ModelInfo] = {}  # catalog models, in catalog order
        seen_registry = -1
        seen_catalog = -1
        started = False
        while True:
            if seen_catalog != self._catalog_version:
                seen_catalog = self._catalog_version
                try:
                    with trio.fail_after(CATALOG_READ_TIMEOUT):
                        specs = await self.store.list_models()
                    infos = {m.name: model_info(m) for m in specs}
                except Exception as exc:  # noqa: BLE001 - keep serving with the last good list
                    log.warning("gateway: could not read the catalog: %s", exc)
            seen_registry = self.registry.version
            self.table.replace_all(
                {
                    model: [Replica(r.id, r.model, r.endpoint, r.node_id, r.engine, r.adapters)
                            for r in self.registry.replicas_of(model)]
                    for model in infos
                },
                infos,
            )
            if not started:
                task_status.started()
                started = True
            async with trio.open_nursery() as waiters:
                catalog_event = self._catalog_event

                async def registry_changed() -> None:
                    await self.registry.wait_changed(seen_registry)
                    waiters.cancel_scope.cancel()

                async def catalog_changed() -> None:
                    await catalog_event.wait()
                    waiters.cancel_scope.cancel()

                waiters.start_soon(registry_changed)
                waiters.start_soon(catalog_changed)


def model_info(spec: ModelSpec) -> ModelInfo:
    """Returns what the gateway needs to know about catalog model ``spec`` beyond its replicas."""
    return ModelInfo(
        engine=spec.engine,
        adapters=tuple(a.name for a in spec.adapters),
        max_loaded_adapters=spec.max_loaded_adapters,
    )


async def run_control_plane(
    *,
    store_url: str,
    rpc_host: str,
    rpc_port: int,
    http_host: str,
    http_port: int,
    server_context: ssl.SSLContext,
    heartbeat_interval: float = 2.0,
    lost_after: float = 10.0,
    replace_grace: float = 30.0,
    gateway: GatewayConfig | None = None,
    tracing: TracingConfig | None = None,
    auth: AuthConfig = AuthConfig(),
    serving: ServingConfig = ServingConfig(),
    routing: RoutingConfig = RoutingConfig(),
    engines: Mapping[str, str] | None = None,
    task_status: trio.TaskStatus[ControlPlane] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a control plane until cancelled.

    Signals the :class:`ControlPlane` as started value once the store is open,
    the gateway and the RPC port are listening (``rpc_port``/``http_port`` of the
    returned object are the bound ports; 0 asks for free ones). Raises the
    store's error if the database cannot be opened, and ``OSError`` if a port
    is taken. Cancellation closes every connection and the store; engines on
    the nodes are not touched. ``gateway`` sets the upstream deadlines and ``tracing``
    the OpenTelemetry export (``server.yaml`` sections; None: defaults, tracing off);
    ``RuntimeError`` if tracing is on but OpenTelemetry is not installed. ``auth`` and
    ``serving`` are the API-key switch and admission limits, ``routing`` the routing policy
    (``server.yaml`` sections; with ``gateway.workers`` > 1 every worker routes by it).
    ``engines`` (name -> version, "" = the installer's default) is what every node is told
    to install.
    """
    with unwrap_single_group():
        async with open_store(store_url) as store, trio.open_nursery() as nursery:
            registry = Registry(lost_after=lost_after, replace_grace=replace_grace)
            sessions = NodeSessions(registry, wanted_engines=dict(engines or {}))
            workers = gateway.workers if gateway is not None else 1
            plane = ControlPlane(
                store=store,
                registry=registry,
                sessions=sessions,
                table=ObservedTable() if workers > 1 else ReplicaTable(),
                heartbeat_interval=heartbeat_interval,
            )
            sessions.on_kv_update = plane.kv_update
            registry.on_shard_gone = plane.kv_forget
            await nursery.start(registry.watchdog)
            plane.reconciler = Reconciler(registry, plane._catalog, sessions)
            await nursery.start(plane.reconciler.run)
            await nursery.start(plane.feed_gateway)
            limits = AdmissionLimits(serving.max_inflight_per_replica, serving.queue_size, serving.queue_timeout)
            pool: GatewayPool | None = None
            if workers > 1:
                # Gateway worker processes serve HTTP; this gateway object is their master
                # state (never served). llmgw/control/gateway_pool.py, docs/gateway.md.
                gateway_app = create_app(
                    plane.table, auth=ObservedAuthTable(enabled=auth.enabled), admission=PooledAdmission(limits),
                    max_request_bytes=serving.max_request_bytes,
                )
                plane.gateway = gateway_of(gateway_app)
                pool = plane.pool = GatewayPool(plane.gateway, http_host, workers, WorkerSettings(
                    timeouts=_upstream_timeouts(gateway), auth_enabled=auth.enabled, limits=limits,
                    max_request_bytes=serving.max_request_bytes, tracing=tracing, routing=routing,
                ))
                plane.access = PooledAccessSync(store, plane.gateway, pool,
                                                usage_flush_interval=serving.usage_flush_interval)
            else:
                load = LoadTracker()
                gateway_app = create_app(
                    plane.table, load=load, policy=make_policy(routing, load),
                    timeouts=_upstream_timeouts(gateway), tracer=create_tracer(tracing),
                    auth=AuthTable(enabled=auth.enabled),
                    admission=Admission(limits),
                    max_request_bytes=serving.max_request_bytes,
                )
                plane.gateway = gateway_of(gateway_app)
                plane.access = AccessSync(store, plane.gateway, usage_flush_interval=serving.usage_flush_interval)
            await nursery.start(plane.access.run)
            if not auth.enabled and not _is_loopback(http_host):
                log.warning(
                    "API KEYS ARE OFF (auth.enabled: false) AND THE GATEWAY LISTENS ON %s, NOT LOOPBACK: "
                    "ANYONE WHO CAN REACH IT CAN USE EVERY MODEL. Turn auth on for anything but a "
                    "loopback demo.", http_host,
                )
            if pool is not None:
                assert isinstance(plane.access, PooledAccessSync)
                plane.http_port = await nursery.start(plane.access.run_pool, http_port)
            else:
                plane.http_port = await nursery.start(serve_gateway, gateway_app, http_host, http_port)
            plane.gateway_url = f"http://{_url_host(http_host)}:{plane.http_port}"

            async def handler(stream: trio.SSLStream, identity: Identity) -> None:
                await handle_connection(plane, stream, identity)

            plane.rpc_port = await nursery.start(net.listen, handler, rpc_host, rpc_port, server_context)
            log.info("control plane: rpc on %s:%d, gateway on %s", rpc_host, plane.rpc_port, plane.gateway_url)
            task_status.started(plane)


def _upstream_timeouts(gateway: GatewayConfig | None) -> UpstreamTimeouts:
    """Return the gateway's upstream deadlines from ``server.yaml``'s ``gateway:`` section."""
    if gateway is None:
        return UpstreamTimeouts()
    return UpstreamTimeouts(
        connect=gateway.connect_timeout, first_byte=gateway.first_byte_timeout, chunk=gateway.chunk_timeout
    )


def _is_loopback(host: str) -> bool:
    """Return whether ``host`` (an address or name to listen on) is loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
