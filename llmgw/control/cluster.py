"""The bootstrap ``Cluster`` capability of the RPC port, one per connection.

The TLS client certificate says who is calling: ``join`` is for the node named
in the certificate, ``admin`` for admin certificates. A refused call raises
``PermissionError`` with a message naming both sides, and is logged and audited with
the certificate's name (:mod:`llmgw.control.refusals`). The handlers act on the
:class:`ClusterServices` the control plane's wiring gives them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import attrs
import trio

from llmgw.control import refusals
from llmgw.control.registry import Registry
from llmgw.control.reports import endpoint_hosts, screen_shards
from llmgw.control.sessions import NodeSession, NodeSessions, SessionConflict, watch_heartbeats
from llmgw.control.store import Store
from llmgw.logthrottle import LogThrottle
from llmgw.rpc import convert, schema
from llmgw.rpc.connection import serve_stream
from llmgw.rpc.tls import Identity, Role

log = logging.getLogger(__name__)
#: A refused second agent retries every second or so: one line per node, then one per interval.
_conflicts = LogThrottle(log)

#: Recording a join in the store is one small write; a store that cannot take it in this
#: time is reported in the log, and the node joins anyway (the live view does not need it).
STORE_WRITE_TIMEOUT = 5.0


@attrs.frozen
class ClusterServices:
    """What the ``Cluster`` bootstrap acts on, for one running control plane."""

    store: Store
    registry: Registry
    sessions: NodeSessions
    #: Seconds between a node's heartbeats, told to every node that joins.
    heartbeat_interval: float
    #: Returns the ``Admin`` capability for an admin certificate's name.
    make_admin: Callable[[str], Any]


async def handle_connection(services: ClusterServices, stream: trio.abc.Stream, identity: Identity) -> None:
    """Serve the RPC port's bootstrap on one connection until it closes.

    A node session started on this connection ends with it: the registry is told
    (the node becomes LOST) and the session's tasks are cancelled.
    """
    state: dict[str, NodeSession] = {}
    try:
        async with trio.open_nursery() as nursery:
            bootstrap = _make_cluster(services, identity, nursery, state, _peer_host(stream))
            await serve_stream(stream, bootstrap)
            nursery.cancel_scope.cancel()
    finally:
        session = state.get("session")
        if session is not None:
            services.sessions.detach(session)


def _peer_host(stream: trio.abc.Stream) -> str | None:
    """Returns the address ``stream``'s peer connects from (None when it is not a socket)."""
    transport = getattr(stream, "transport_stream", stream)
    try:
        return str(transport.socket.getpeername()[0])  # type: ignore[attr-defined]
    except (AttributeError, OSError, IndexError):
        return None


def _make_cluster(
    services: ClusterServices, identity: Identity, nursery: trio.Nursery, state: dict[str, NodeSession],
    peer: str | None,
) -> Any:
    s = schema.load()

    class ClusterServer(s.Cluster.Server):
        async def join(self, registration: Any, _context: Any, **_: Any) -> None:
            node_id = str(registration.nodeId)
            await refusals.require(services.store, identity, Role.NODE, call="join", name=node_id)
            if "session" in state:
                raise RuntimeError("this connection has joined already")
            address = str(registration.address)
            hardware = convert.hardware_from(registration.hardware)
            engines = [convert.engine_from(e) for e in registration.engines]
            shards = [
                (convert.shard_spec_from(r.spec), convert.shard_status_from(r.status)) for r in registration.shards
            ]
            agent = registration.agent
            version = str(registration.version)
            try:
                await services.sessions.check_replaceable(node_id)
            except SessionConflict as exc:
                _conflicts.failure(("conflict", node_id), logging.WARNING,
                                   "refused a join of node %s from %s: %s", node_id, address, exc)
                raise
            if "session" in state:  # a second join on this connection while the ping was out
                raise RuntimeError("this connection has joined already")

            hosts = endpoint_hosts(address, peer)
            shards = screen_shards(node_id, hosts, shards, services.registry.shard_owner)
            epoch = services.registry.node_joined(node_id, address, hardware, engines, shards)
            session = NodeSession(services.registry, node_id, epoch, agent, nursery.cancel_scope.cancel, hosts)
            state["session"] = session
            services.sessions.attach(session)
            services.sessions.agent_versions[node_id] = version
            nursery.start_soon(watch_heartbeats, session, services.registry.lost_after)
            nursery.start_soon(_adopt_all, session, [spec.id for spec, _ in shards])
            nursery.start_soon(_push_engines, session, dict(services.sessions.wanted_engines))
            nursery.start_soon(_record_seen, services, node_id, address)
            log.info("node %s joined from %s (%d shards, agent %s)", node_id, address, len(shards), version)
            _context.results.desk = session.desk()
            _context.results.heartbeatIntervalMs = int(services.heartbeat_interval * 1000)

        async def admin(self, _context: Any, **_: Any) -> None:
            await refusals.require(services.store, identity, Role.ADMIN, call="admin", target="cluster")
            _context.results.admin = services.make_admin(identity.name)

    return ClusterServer()


async def _adopt_all(session: NodeSession, shard_ids: list[str]) -> None:
    for shard_id in shard_ids:
        try:
            await session.adopt(shard_id)
        except Exception as exc:  # noqa: BLE001 - one shard must not stop the others being re-bound
            log.warning("node %s: could not re-bind shard %s: %s", session.node_id, shard_id, exc)


async def _push_engines(session: NodeSession, wanted: dict[str, str]) -> None:
    """Tell a node which engines it should have (server.yaml ``engines:``)."""
    if not wanted:
        return
    try:
        await session.want_engines(wanted)
    except Exception as exc:  # noqa: BLE001 - an older agent without wantEngines still serves
        log.warning("node %s: could not send its wanted engines: %s", session.node_id, exc)


async def _record_seen(services: ClusterServices, node_id: str, address: str) -> None:
    try:
        with trio.fail_after(STORE_WRITE_TIMEOUT):
            await services.store.record_node_seen(node_id, address)
    except Exception as exc:  # noqa: BLE001 - the live view does not depend on this record
        log.warning("could not record node %s in the store: %s", node_id, exc)
