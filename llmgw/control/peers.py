"""The leader's stream to the standbys: every control plane's gateway routes the same way.

On the leader, :class:`FeedTee` stands between the leader's route feed and node sessions
and its own gateway: it applies routes and KV-cache deltas to that gateway, remembers
them (the last route table, and a mirror of each replica's cached blocks), and queues
them for every standby attached to it. A standby that attaches gets a full copy first
(the route table, then one reset per replica), then every change in order. One that falls
:data:`PEER_QUEUE_MAX` messages behind is dropped: it reconnects and starts from a full
copy again, so nothing is ever silently skipped.

On a standby, :func:`follow_leader` holds a peer session with whoever the election says
leads (``Cluster.peer`` over mutual TLS with the control plane's own certificate), feeds
what arrives into the standby's gateway, and pings the leader (Cap'n Proto has no
keepalive) so a dead one is noticed within a few intervals. Its :class:`Follower` also
passes admin calls on (``ControlPeer.admin``), and reports its gateway's demand with every
ping and applies the shares of the tenant limits the leader sends
(:mod:`llmgw.control.admission_shares`).
"""

from __future__ import annotations

import collections
import logging
import ssl
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

import capnp
import trio

from llmgw import __version__
from llmgw.control.admission_shares import LocalShares, Publication, share_rows, shares_from
from llmgw.control.leader import LeaderElection
from llmgw.router.interface import GatewayInterface, ModelInfo, Replica
from llmgw.rpc import convert, net, schema
from llmgw.rpc.connection import open_client
from llmgw.rpc.errors import remote_reason
from llmgw.releasefiles import ReleaseError, ReleaseInbox, send_pieces
from llmgw.releases import UPGRADE_EXIT_STATUS, install_here, release_root
from llmgw.spec import KvDelta, split_delta

log = logging.getLogger(__name__)

#: Messages queued for one standby before it counts as stuck and is dropped (it then
#: resyncs from a full copy). KV deltas are the bulk: this is seconds of a busy fleet.
PEER_QUEUE_MAX = 50_000
#: Deadline of one call into a standby's feed, and of the standby's ping to the leader.
PEER_CALL_TIMEOUT = 10.0
#: Seconds between a standby's pings of the leader; a leader silent for
#: PEER_PING_MISSES of them is taken for dead and the session dropped.
PEER_PING_INTERVAL = 1.0
#: Deadline for a standby to install a release (copying its environment and pip; as an agent's).
RELEASE_INSTALL_TIMEOUT = 960.0
PEER_PING_MISSES = 3
#: Pause before a standby dials the leader again after a session failed.
PEER_RETRY_S = 1.0

RouteTable = tuple[Mapping[str, Sequence[Replica]], Mapping[str, ModelInfo]]


class PeerTooSlow(Exception):
    """A standby fell PEER_QUEUE_MAX messages behind the leader's stream."""


class PeerEnded(Exception):
    """The leader ended its stream to a standby on purpose (the standby was removed)."""


class _PeerQueue:
    """What is still to be sent to one standby, in order."""

    def __init__(self) -> None:
        self.items: collections.deque[tuple[Any, ...]] = collections.deque()
        self.overflowed = False
        self.ended: str | None = None
        self._wakeup = trio.Event()

    def end(self, reason: str) -> None:
        """Make :meth:`get` raise :class:`PeerEnded` with ``reason`` from now on."""
        self.ended = reason
        self._wakeup.set()

    def put(self, item: tuple[Any, ...]) -> None:
        if len(self.items) >= PEER_QUEUE_MAX:
            self.overflowed = True
        else:
            self.items.append(item)
        self._wakeup.set()

    async def get(self) -> tuple[Any, ...]:
        """Returns the next item; raises PeerTooSlow once the queue overflowed, PeerEnded once ended."""
        while not self.items and not self.overflowed and self.ended is None:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
        if self.ended is not None:
            raise PeerEnded(self.ended)
        if self.overflowed:
            raise PeerTooSlow(f"the standby fell {PEER_QUEUE_MAX} messages behind")
        return self.items.popleft()


class FeedTee:
    """The leader's gateway feed, copied to every attached standby (see the module docstring).

    Has the feeding methods of :class:`~llmgw.router.interface.GatewayInterface` that the
    route feed and node sessions call; each is synchronous and never raises.
    """

    def __init__(self, gateway: GatewayInterface, inherited: RouteTable | None = None) -> None:
        self.gateway = gateway
        self._routes: RouteTable = inherited or ({}, {})
        self._kv: dict[str, tuple[set[int], KvDelta]] = {}  # replica -> (blocks held, last delta)
        self._peers: dict[_PeerQueue, tuple[str, Any]] = {}  # queue -> the standby's name and feed
        self._versions: dict[str, str] = {}  # standby name -> the llmgw release it said it runs
        self._attached = trio.Event()  # set at every attach

    @property
    def routes(self) -> RouteTable:
        """The last route table handed to the gateway."""
        return self._routes

    @property
    def peer_names(self) -> set[str]:
        """The names of the standbys attached now."""
        return {name for name, _ in self._peers.values()}

    def standbys(self) -> list[tuple[str, Any]]:
        """The standbys attached now: each one's name and ``GatewayFeed`` capability."""
        return list(self._peers.values())

    async def wait_attached(self) -> None:
        """Returns after the next standby attaches."""
        await self._attached.wait()

    def replace_routes(self, replicas: Mapping[str, Sequence[Replica]], models: Mapping[str, ModelInfo]) -> None:
        self.gateway.replace_routes(replicas, models)
        self._routes = (replicas, models)
        self._send(("routes", replicas, models))

    def kv_update(self, replica_id: str, delta: KvDelta) -> None:
        self.gateway.kv_update(replica_id, delta)
        held = set() if delta.reset else self._kv.get(replica_id, (set(), delta))[0]
        held.difference_update(delta.removed)
        held.update(delta.stored)
        self._kv[replica_id] = (held, delta)
        self._send(("kv", replica_id, delta))

    def kv_forget(self, replica_id: str) -> None:
        self.gateway.kv_forget(replica_id)
        self._kv.pop(replica_id, None)
        self._send(("forget", replica_id))

    def set_readiness(self, not_ready: str | None) -> None:
        self.gateway.set_readiness(not_ready)

    def access_changed(self) -> None:
        """Keys, tenants, ``serving.stopped`` or ``routing`` changed: every standby reloads them."""
        self._send(("access",))

    def send_shares(self, publication: Publication, applied: Callable[[], None]) -> None:
        """Queue ``publication``'s admission shares for its standby (if attached), in order
        with the rest of its stream; ``applied()`` is called once the standby applied them."""
        for queue, (name, _) in self._peers.items():
            if name == publication.gateway:
                queue.put(("shares", publication.shares, applied))

    def _send(self, item: tuple[Any, ...]) -> None:
        for peer in self._peers:
            peer.put(item)

    def version_of(self, name: str) -> str:
        """The llmgw release standby ``name`` said it runs when it attached ("": not attached, or not said)."""
        return self._versions.get(name, "") if name in self.peer_names else ""

    def feed_of(self, name: str) -> Any:
        """Standby ``name``'s ``GatewayFeed``; raises LookupError when it is not attached."""
        for peer, feed in self._peers.values():
            if peer == name:
                return feed
        raise LookupError(f"control plane {name!r} is not attached to the leader as a standby (see `llmgw ctl status`)")

    def attach(self, name: str, feed: Any, version: str = "") -> _PeerQueue:
        """Returns standby ``name``'s new queue (its ``feed`` the capability the queue is
        sent into), holding a full copy of the state so far; ``version`` is its llmgw release."""
        queue = _PeerQueue()
        queue.put(("routes", *self._routes))
        for replica_id, (held, last) in self._kv.items():
            full = KvDelta(reset=True, stored=tuple(held), block_size=last.block_size,
                           events_applied=last.events_applied, gaps=last.gaps, resyncs=last.resyncs)
            for part in split_delta(full):
                queue.put(("kv", replica_id, part))
        self._peers[queue] = (name, feed)
        self._versions[name] = version
        self._attached.set()
        self._attached = trio.Event()
        return queue

    def detach(self, queue: _PeerQueue) -> None:
        self._peers.pop(queue, None)

    def drop(self, name: str, reason: str) -> int:
        """End the stream to standby ``name`` (its session is then closed); returns how many were ended."""
        ended = [queue for queue, (peer, _) in self._peers.items() if peer == name]
        for queue in ended:
            queue.end(reason)
        return len(ended)


def _replica_dict(r: Replica) -> dict[str, Any]:
    return {
        "id": r.id, "model": r.model, "endpoint": r.endpoint, "nodeId": r.node_id, "engine": r.engine,
        "adapters": [{"key": name, "value": path} for name, path in r.adapters], "apiKey": r.api_key,
    }


def _replica_from(r: Any) -> Replica:
    return Replica(
        id=str(r.id), model=str(r.model), endpoint=str(r.endpoint), node_id=str(r.nodeId), engine=str(r.engine),
        adapters=tuple((str(kv.key), str(kv.value)) for kv in r.adapters), api_key=str(r.apiKey),
    )


def _model_dict(name: str, info: ModelInfo) -> dict[str, Any]:
    return {"name": name, "engine": info.engine, "adapters": list(info.adapters),
            "maxLoadedAdapters": info.max_loaded_adapters}


async def pump(tee: FeedTee, queue: _PeerQueue, feed: Any, name: str) -> None:
    """Send ``queue`` into standby ``name``'s ``feed`` capability, in order, until the
    session fails (logged; returns) or cancelled. Detaches the queue when it returns."""
    try:
        while True:
            item = await queue.get()
            with trio.fail_after(PEER_CALL_TIMEOUT):
                if item[0] == "routes":
                    _, replicas, models = item
                    await feed.routes(
                        [_replica_dict(r) for rs in replicas.values() for r in rs],
                        [_model_dict(name_, info) for name_, info in models.items()],
                    )
                elif item[0] == "kv":
                    await feed.kvUpdate(item[1], convert.kv_update_dict(item[2]))
                elif item[0] == "forget":
                    await feed.kvForget(item[1])
                elif item[0] == "shares":
                    await _send_shares(feed, item[1], name)
                    item[2]()
                else:
                    await feed.accessChanged()
    except (PeerTooSlow, PeerEnded, trio.TooSlowError, capnp.KjException) as exc:
        log.warning("standby %s: the stream to it ended: %s", name, exc)
    finally:
        tee.detach(queue)


async def _send_shares(feed: Any, shares: Any, name: str) -> None:
    """Send ``shares`` into standby ``name``'s ``feed``; a standby too old to take them is
    logged, not dropped (it enforces every tenant limit whole, as it always did)."""
    try:
        await feed.admissionShares(share_rows(shares), shares.default)
    except capnp.KjException as exc:
        if getattr(exc, "type", None) != "UNIMPLEMENTED":
            raise
        log.warning("standby %s does not take admission shares (an older llmgw): its gateway enforces every "
                    "tenant limit whole", name)


async def upgrade_standby(feed: Any, wheel: Path, sha256: str) -> tuple[str, str]:
    """Send the release ``wheel`` into a standby's ``feed`` in pieces and have it install it and
    restart on it; return (new release, previous release). Raises RuntimeError with the
    standby's reason, TooSlowError past the deadlines."""
    async def piece(offset: int, chunk: bytes) -> int:
        with trio.fail_after(PEER_CALL_TIMEOUT):
            return int((await feed.receiveRelease(wheel.name, offset, chunk)).received)

    try:
        await send_pieces(wheel, piece)
        with trio.fail_after(RELEASE_INSTALL_TIMEOUT):
            result = await feed.upgrade(wheel.name, sha256)
    except capnp.KjException as exc:
        raise RuntimeError(f"the standby: {remote_reason(exc)}") from None
    return str(result.release), str(result.previous)


class Follower:
    """A standby's side of the peer session (see :func:`follow_leader`)."""

    def __init__(
        self, gateway: GatewayInterface, reload_access: Callable[[], Awaitable[None]],
        restart: Callable[..., None], releases_dir: Path | None = None,
    ) -> None:
        self.gateway = gateway
        self.reload_access = reload_access
        #: ``restart(reason, exit_status=None)``: restart this control plane once the call answered.
        self.restart = restart
        #: Where releases sent by the leader are kept (None: this control plane takes none).
        self.releases_dir = releases_dir
        #: The last route table the leader sent, or this control plane's own when its lead
        #: ended (handed to its route feed when it takes the lead, so its gateway keeps
        #: routing while the nodes rejoin).
        self.routes: RouteTable | None = None
        #: The leader's ControlPeer while a session is up, else None.
        self.peer: Any = None
        #: The leader this standby streams from, while a session is up.
        self.leader_name: str | None = None
        #: This control plane's gateway's admission shares (None: not shared): led by the
        #: leader while a session is up, its demand reported at every ping.
        self.shares: LocalShares | None = None
        self._session_up = trio.Event()  # set while a session is up

    def _feed(self) -> Any:
        follower = self

        class FeedServer(schema.load().GatewayFeed.Server):  # type: ignore[misc]
            async def routes(self, replicas: Any, models: Any, **_: Any) -> None:
                table: dict[str, list[Replica]] = {}
                infos: dict[str, ModelInfo] = {}
                for m in models:
                    infos[str(m.name)] = ModelInfo(engine=str(m.engine), adapters=tuple(str(a) for a in m.adapters),
                                                   max_loaded_adapters=int(m.maxLoadedAdapters))
                for r in replicas:
                    replica = _replica_from(r)
                    table.setdefault(replica.model, []).append(replica)
                follower.routes = (table, infos)
                follower.gateway.replace_routes(table, infos)
                follower.gateway.set_readiness(None)

            async def kvUpdate(self, replica: str, update: Any, **_: Any) -> None:
                follower.gateway.kv_update(str(replica), convert.kv_update_from(update))

            async def kvForget(self, replica: str, **_: Any) -> None:
                follower.gateway.kv_forget(str(replica))

            async def restart(self, **_: Any) -> None:
                follower.restart("asked by the leader: llmgw ctl restart")

            async def receiveRelease(self, name: str, offset: int, chunk: bytes, _context: Any, **_: Any) -> None:
                _context.results.received = follower.inbox().write(str(name), int(offset), bytes(chunk))

            async def upgrade(self, name: str, sha256: str, _context: Any, **_: Any) -> None:
                release, previous = await install_here(release_root(), follower.inbox(), str(name), str(sha256))
                follower.restart(f"upgraded to llmgw {release}", UPGRADE_EXIT_STATUS)
                _context.results.release, _context.results.previous = release, previous

            async def admissionShares(self, shares: Any, default: float, **_: Any) -> None:
                if follower.shares is not None:
                    await follower.shares.apply_from_leader(shares_from(shares, default))

            async def accessChanged(self, **_: Any) -> None:
                try:
                    await follower.reload_access()
                except Exception as exc:  # noqa: BLE001 - the periodic reload retries
                    log.warning("standby: could not reload keys and settings: %s", exc)

        return FeedServer()

    def inbox(self) -> ReleaseInbox:
        """Where this standby keeps releases; raises ReleaseError where it keeps none."""
        if self.releases_dir is None:
            raise ReleaseError("this control plane takes no releases")
        return ReleaseInbox(self.releases_dir)

    async def admin(self, actor: str) -> Any:
        """Returns the leader's Admin capability for ``actor``, waiting up to
        :data:`PEER_CALL_TIMEOUT` for a peer session (a leader just changed); raises
        ConnectionError when none came up."""
        with trio.move_on_after(PEER_CALL_TIMEOUT):
            await self._session_up.wait()
        peer = self.peer
        if peer is None:
            raise ConnectionError("this control plane is a standby and has no session with the leader yet; "
                                  "try again in a few seconds, or connect to the leader")
        with trio.fail_after(PEER_CALL_TIMEOUT):
            return (await peer.admin(actor)).admin

    async def follow(self, election: LeaderElection, context: ssl.SSLContext) -> None:
        """Stream from whoever leads while this control plane does not, until cancelled.
        The gateway is ready once the first route table has arrived (the control plane
        marked it not ready at start)."""
        while True:
            leader = election.leader
            if election.leading or leader is None or leader.name == election.name:
                await election.wait_changed()
                continue
            async with trio.open_nursery() as nursery:
                async def leader_changed() -> None:
                    while not election.leading and election.leader is not None and \
                            election.leader.epoch == leader.epoch:
                        await election.wait_changed()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(leader_changed)
                await self._session(leader.name, leader.rpc_address, context)
                await trio.sleep(PEER_RETRY_S)
                nursery.cancel_scope.cancel()

    async def _session(self, name: str, address: str, context: ssl.SSLContext) -> None:
        """One peer session with the leader ``name`` at ``address``; returns when it ends.

        Its failures are caught inside the connection's block, so they leave it alone, not
        in a group with the connection's own shutdown (a cancellation of this session, when
        the leader changed, can meet a failing call)."""
        failure: BaseException | None = None
        try:
            stream = await net.connect(address, context)
            async with open_client(stream) as client:
                try:
                    cluster = client.bootstrap().cast_as(schema.load().Cluster)
                    with trio.fail_after(PEER_CALL_TIMEOUT):
                        result = await cluster.peer(self._feed(), __version__)
                    self.peer = result.peer
                    self.leader_name = name
                    self._session_up.set()
                    if self.shares is not None:
                        self.shares.led()
                    log.info("standby: streaming from the leader %s at %s (epoch %d)", name, address, result.epoch)
                    while True:
                        await trio.sleep(PEER_PING_INTERVAL)
                        with trio.fail_after(PEER_PING_INTERVAL * PEER_PING_MISSES):
                            await self.peer.ping()
                        if self.shares is not None:  # the ping interval is the admission sync interval
                            await self.shares.report(self.peer, PEER_PING_INTERVAL * PEER_PING_MISSES)
                except (trio.TooSlowError, capnp.KjException) as exc:
                    failure = exc
        except (OSError, trio.BrokenResourceError, capnp.KjException) as exc:
            failure = failure or exc
        finally:
            self.peer = None
            self.leader_name = None
            self._session_up = trio.Event()
            if self.shares is not None:
                self.shares.unled()
        if failure is not None:
            log.warning("standby: the session with the leader %s at %s ended: %s", name, address, remote_reason(failure)
                        if isinstance(failure, capnp.KjException) else failure)
