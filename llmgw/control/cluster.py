"""The bootstrap ``Cluster`` capability of the RPC port, one per connection.

The TLS client certificate says who is calling: ``join`` is for the node named
in the certificate, ``admin`` for admin certificates, ``peer`` for the control planes the
store lists. Only the leader takes node sessions and peer streams; a standby refuses a
join saying who leads (the agent tries its next control plane), and answers ``admin``
with the leader's Admin, reached over its own peer session. A refused call raises
``PermissionError`` with a message naming both sides, and is logged and audited with
the certificate's name (:mod:`llmgw.control.refusals`). A connection without a
certificate gets only the ``JoinDesk`` (:mod:`llmgw.control.joining`), and one whose
certificate was revoked nothing. The handlers act on the :class:`ClusterServices` the
control plane's wiring gives them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import attrs
import trio

from llmgw import __version__, labels
from llmgw.control import refusals
from llmgw.control.admission_shares import demand_from
from llmgw.control.joining import JoinService, make_join_desk
from llmgw.control.peers import pump
from llmgw.control.settings_push import push_to, stored_settings
from llmgw.control.reports import endpoint_hosts, screen_shards
from llmgw.control.sessions import NodeSession, NodeSessions, SessionConflict, watch_heartbeats
from llmgw.control.store import Store
from llmgw.logthrottle import LogThrottle
from llmgw.nodeprotocol import refusal
from llmgw.rpc import convert, schema
from llmgw.rpc.connection import serve_stream
from llmgw.rpc.tls import Identity, Role

if TYPE_CHECKING:
    from llmgw.control.plane import Term

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
    #: Seconds between a node's heartbeats, told to every node that joins.
    heartbeat_interval: float
    #: Returns the current term while this control plane leads, else None.
    term: Callable[[], Term | None]
    #: Why this control plane takes no node sessions now, naming the leader.
    not_leader: Callable[[], str]
    #: ``make_admin(actor, via)``: the ``Admin`` capability for an admin certificate's name
    #: (on a standby, the leader's), ``via`` the standby a call came through ("" for none);
    #: raises ConnectionError when there is none to give.
    make_admin: Callable[[str, str], Awaitable[Any]]
    #: Returns the RPC addresses of every control plane, this one (the leader) first.
    control_planes: Callable[[], Awaitable[list[str]]]
    #: Answers connections without a certificate (joining with a token); None: refuse them.
    joins: JoinService | None = None


class NotLeaderError(RuntimeError):
    """A call only the leader answers reached a standby; the message names the leader."""


async def handle_connection(services: ClusterServices, stream: trio.abc.Stream, identity: Identity | None) -> None:
    """Serve the RPC port's bootstrap on one connection until it closes.

    A connection without a certificate (``identity`` None) gets only the ``JoinDesk``; one
    whose certificate was revoked is refused (logged, audited) and closed. A node session
    started on this connection ends with it: the registry is told (the node becomes LOST)
    and the session's tasks are cancelled.
    """
    if identity is None:
        if services.joins is None:
            return  # the listener admits no anonymous connection then; nothing to serve
        await serve_stream(stream, make_join_desk(services.joins, _peer_host(stream)))
        return
    if identity.serial and await services.store.is_certificate_revoked(identity.serial):
        try:
            await refusals.refuse(services.store, identity, call="connect", target=identity.name,
                                  reason="its certificate was revoked (the control plane or node was removed)")
        except PermissionError:
            return
    state: dict[str, Any] = {}
    try:
        async with trio.open_nursery() as nursery:
            bootstrap = _make_cluster(services, identity, nursery, state, _peer_host(stream))
            await serve_stream(stream, bootstrap)
            nursery.cancel_scope.cancel()
    finally:
        session = state.get("session")
        if session is not None:
            state["sessions"].detach(session)


def _peer_host(stream: trio.abc.Stream) -> str | None:
    """Returns the address ``stream``'s peer connects from (None when it is not a socket)."""
    transport = getattr(stream, "transport_stream", stream)
    try:
        return str(transport.socket.getpeername()[0])  # type: ignore[attr-defined]
    except (AttributeError, OSError, IndexError):
        return None


def _make_cluster(
    services: ClusterServices, identity: Identity, nursery: trio.Nursery, state: dict[str, Any],
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
            features = frozenset(str(f) for f in registration.features)
            job_ids = frozenset(str(j) for j in registration.jobs)
            try:
                node_labels = labels.parse_pairs(str(pair) for pair in registration.labels)
            except ValueError as exc:
                raise ValueError(f"node {node_id}'s labels: {exc}") from None
            refused = refusal(node_id, version, features, __version__)
            if refused is not None:
                _conflicts.failure(("protocol", node_id), logging.WARNING, "refused a join: %s", refused)
                raise RuntimeError(refused)
            term = services.term()
            if term is None:
                raise NotLeaderError(services.not_leader())
            sessions = term.sessions
            try:
                await sessions.check_replaceable(node_id)
            except SessionConflict as exc:
                _conflicts.failure(("conflict", node_id), logging.WARNING,
                                   "refused a join of node %s from %s: %s", node_id, address, exc)
                raise
            if "session" in state:  # a second join on this connection while the ping was out
                raise RuntimeError("this connection has joined already")

            if services.term() is not term:  # the lead was lost during the ping
                raise NotLeaderError(services.not_leader())
            registry = term.registry
            hosts = endpoint_hosts(address, peer)
            shards = screen_shards(node_id, hosts, shards, registry.shard_owner)
            epoch = registry.node_joined(node_id, address, hardware, engines, shards, labels=node_labels)
            session = NodeSession(registry, node_id, epoch, agent, nursery.cancel_scope.cancel, hosts)
            session.features = features
            session.jobs = job_ids
            state["session"] = session
            state["sessions"] = sessions
            sessions.attach(session)
            sessions.agent_versions[node_id] = version
            nursery.start_soon(watch_heartbeats, session, registry.lost_after)
            nursery.start_soon(_adopt_all, session, [spec.id for spec, _ in shards])
            nursery.start_soon(_push_engines, session, dict(sessions.wanted_engines))
            nursery.start_soon(_push_planes, services, [session])
            nursery.start_soon(_push_settings, services, session)
            nursery.start_soon(_record_seen, services, node_id, address, identity.serial)
            log.info("node %s joined from %s (%d shards, agent %s)", node_id, address, len(shards), version)
            _context.results.desk = session.desk()
            _context.results.heartbeatIntervalMs = int(services.heartbeat_interval * 1000)

        async def admin(self, _context: Any, **_: Any) -> None:
            await refusals.require(services.store, identity, Role.ADMIN, call="admin", target="cluster")
            _context.results.admin = await services.make_admin(identity.name, "")

        async def peer(self, feed: Any, version: str, _context: Any, **_: Any) -> None:
            await refusals.require(services.store, identity, Role.CONTROL, call="peer", target="cluster")
            known = {record.name for record in await services.store.list_control_planes()}
            if identity.name not in known:
                await refusals.refuse(services.store, identity, call="peer", target="cluster",
                                      reason=f"control plane {identity.name!r} is not listed in the store")
            term = services.term()
            if term is None:
                raise NotLeaderError(services.not_leader())
            if "peer" in state:
                raise RuntimeError("this connection streams to a standby already")
            state["peer"] = True
            queue = term.tee.attach(identity.name, feed, str(version))
            nursery.start_soon(_push_planes, services, term.sessions.all())  # it may be new to them
            nursery.start_soon(_stream_then_close, term, queue, feed, identity.name, nursery.cancel_scope)
            log.info("standby %s attached: streaming routes and KV state to it (epoch %d)", identity.name, term.epoch)
            _context.results.peer = _make_control_peer(services, term, identity.name)
            _context.results.epoch = term.epoch

    return ClusterServer()


def _make_control_peer(services: ClusterServices, term: Term, standby: str) -> Any:
    """The leader's ``ControlPeer`` for the standby named ``standby``: answers while ``term`` is current."""

    def current() -> Term:
        if services.term() is not term:
            raise NotLeaderError(f"the term of epoch {term.epoch} is over: {services.not_leader()}")
        return term

    class ControlPeerServer(schema.load().ControlPeer.Server):  # type: ignore[misc]
        async def ping(self, _context: Any, **_: Any) -> None:
            _context.results.epoch = current().epoch

        async def admin(self, actor: str, _context: Any, **_: Any) -> None:
            _context.results.admin = await services.make_admin(f"{actor} (via {standby})", standby)

        async def reportDemand(self, tenants: Any, **_: Any) -> None:
            book = current().shares
            if book is not None:  # this session (self) tells the book when the standby reconnected
                book.report(standby, demand_from(tenants), trio.current_time(), session=self)

    return ControlPeerServer()


async def _stream_then_close(term: Term, queue: Any, feed: Any, name: str, connection: trio.CancelScope) -> None:
    """Stream to standby ``name`` until its session fails, then close its connection (it
    reconnects and starts from a full copy)."""
    await pump(term.tee, queue, feed, name)
    connection.cancel()


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


async def _push_planes(services: ClusterServices, sessions: list[NodeSession]) -> None:
    """Tell the agents of ``sessions`` every control plane's address (the leader first)."""
    try:
        with trio.fail_after(STORE_WRITE_TIMEOUT):
            addresses = await services.control_planes()
    except Exception as exc:  # noqa: BLE001 - the agents keep the list they have
        log.warning("could not read the control planes to tell the nodes: %s", exc)
        return

    async def tell(session: NodeSession) -> None:
        try:
            await session.tell_control_planes(addresses)
        except Exception as exc:  # noqa: BLE001 - an older agent without controlPlanes still serves
            log.warning("node %s: could not send it the control planes: %s", session.node_id, exc)

    async with trio.open_nursery() as nursery:  # at once: one hung agent must not hold up the rest
        for session in sessions:
            nursery.start_soon(tell, session)


async def _push_settings(services: ClusterServices, session: NodeSession) -> None:
    """Send a node that joined its layer of the cluster settings."""
    try:
        settings = await stored_settings(services.store)
    except Exception as exc:  # noqa: BLE001 - it runs on what it has; the next change is pushed
        log.warning("could not read the cluster settings for node %s: %s", session.node_id, exc)
        return
    await push_to(session, settings)


async def _record_seen(services: ClusterServices, node_id: str, address: str, serial: str) -> None:
    try:
        with trio.fail_after(STORE_WRITE_TIMEOUT):
            await services.store.record_node_seen(node_id, address)
            if serial:  # so that `ctl nodes remove` revokes the certificate it connects with
                await services.store.record_node_certificate(node_id, serial)
    except Exception as exc:  # noqa: BLE001 - the live view does not depend on this record
        log.warning("could not record node %s in the store: %s", node_id, exc)
