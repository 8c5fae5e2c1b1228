"""The control plane process, wired in one place: store, live registry, reconciler, RPC port, gateway.

The gateway is given (:func:`llmgw.router.build.build_gateway` makes it) and driven only
through :class:`~llmgw.router.interface.GatewayInterface`, whether it serves in this
process or through worker processes. Every handler gets its collaborators explicitly
(:class:`~llmgw.control.cluster.ClusterServices`, :class:`~llmgw.control.admin.AdminServices`).

Nursery tree::

    run_control_plane
    ├── registry watchdog (marks silent nodes LOST)
    ├── reconciler (catalog vs fleet, one placement pass at a time)
    ├── route feed (catalog x ready replicas -> the gateway, and its readiness: routes.py)
    ├── access sync (keys, tenants, serving.stopped -> the gateway; usage -> the store)
    ├── gateway (GatewayInterface.serve; its last usage is stored when it stops)
    └── rpc listener ── per connection: Cluster bootstrap ── node session / admin
"""

from __future__ import annotations

import functools
import logging
import ssl
from pathlib import Path
from typing import Callable, Mapping

import attrs
import trio

from llmgw.config import AuthConfig, ServingConfig
from llmgw.config.defaults import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_NODE_LOST_AFTER, DEFAULT_REPLACE_GRACE
from llmgw.config.values import is_loopback_host
from llmgw.control.admin import AdminServices, make_admin
from llmgw.control.cluster import ClusterServices, handle_connection
from llmgw.control.keys import AccessSync
from llmgw.control.reconciler import Reconciler
from llmgw.control.registry import Registry
from llmgw.control.routes import RouteFeed
from llmgw.control.sessions import NodeSessions
from llmgw.control.store import Store, open_store
from llmgw.router.interface import GatewayInterface
from llmgw.rpc import net
from llmgw.rpc.tls import Identity
from llmgw.trioutil import unwrap_single_group

log = logging.getLogger(__name__)


@attrs.frozen
class ControlPlane:
    """A running control plane, as the program that started it sees it."""

    store: Store
    registry: Registry
    #: Keys, tenants and ``serving.stopped`` into the gateway (``reload`` after a direct store change).
    access: AccessSync
    #: Call after changing the catalog in the store directly: the reconciler and the gateway see it.
    catalog_changed: Callable[[], None]
    rpc_port: int
    http_port: int
    #: The gateway's base URL (``http://host:port``).
    gateway_url: str


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
    task_status: trio.TaskStatus[ControlPlane] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a control plane, and serve ``gateway``, until cancelled.

    Signals the :class:`ControlPlane` as started value once the store is open, the
    gateway and the RPC port are listening (``rpc_port``/``http_port`` of the returned
    object are the bound ports; 0 asks for free ones). Raises the store's error if the
    database cannot be opened, and ``OSError`` if a port is taken. Cancellation closes
    every connection, stops the gateway and stores its last usage, then closes the store;
    engines on the nodes are not touched. ``auth`` is the gateway's API-key switch (read
    only to warn when keys are off beyond loopback: the gateway was built with it),
    ``serving`` gives the usage flush interval (``server.yaml`` sections); ``usage_journal``
    is the directory the gateway journals its usage in (replayed into the store before the
    gateway serves: :mod:`llmgw.control.usage_replay`). ``engines``
    (name -> version, "" = the installer's default) is what every node is told to install.
    """
    with unwrap_single_group():
        async with open_store(store_url) as store, trio.open_nursery() as nursery:
            registry = Registry(lost_after=lost_after, replace_grace=replace_grace)
            sessions = NodeSessions(registry, wanted_engines=dict(engines or {}))
            sessions.on_kv_update = gateway.kv_update
            registry.on_shard_gone = gateway.kv_forget
            await nursery.start(registry.watchdog)
            reconciler = Reconciler(registry, store.list_models, sessions)
            await nursery.start(reconciler.run)
            routes = RouteFeed(store, registry, gateway, heartbeat_interval=heartbeat_interval)
            await nursery.start(routes.run)

            def catalog_changed() -> None:
                reconciler.catalog_changed()
                routes.catalog_changed()

            access = AccessSync(store, gateway, usage_flush_interval=serving.usage_flush_interval,
                                usage_journal=usage_journal)
            await nursery.start(access.run)
            if not auth.enabled and not is_loopback_host(http_host):
                log.warning(
                    "API KEYS ARE OFF (auth.enabled: false) AND THE GATEWAY LISTENS ON %s, NOT LOOPBACK: "
                    "ANYONE WHO CAN REACH IT CAN USE EVERY MODEL. Turn auth on for anything but a "
                    "loopback demo.", http_host,
                )
            bound_http = await nursery.start(access.serve, http_host, http_port)
            gateway_url = f"http://{_url_host(http_host)}:{bound_http}"
            admin = AdminServices(
                store=store, registry=registry, sessions=sessions, reconciler=reconciler, gateway=gateway,
                access=access, catalog_changed=catalog_changed, gateway_url=gateway_url,
            )
            cluster = ClusterServices(
                store=store, registry=registry, sessions=sessions, heartbeat_interval=heartbeat_interval,
                make_admin=functools.partial(make_admin, admin),
            )

            async def handler(stream: trio.SSLStream, identity: Identity) -> None:
                await handle_connection(cluster, stream, identity)

            bound_rpc = await nursery.start(net.listen, handler, rpc_host, rpc_port, server_context)
            log.info("control plane: rpc on %s:%d, gateway on %s", rpc_host, bound_rpc, gateway_url)
            task_status.started(ControlPlane(
                store=store, registry=registry, access=access, catalog_changed=catalog_changed,
                rpc_port=bound_rpc, http_port=bound_http, gateway_url=gateway_url,
            ))


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
