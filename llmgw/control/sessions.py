"""Node sessions on the control plane: the ``Cluster.join`` side of the RPC port.

One session is one agent connection. It owns, for its node:

* the ``Agent`` capability the agent handed over in its registration;
* a ``ShardReporter`` capability per shard (handed to the agent), through which
  that shard's status reaches the registry;
* a ``Shard`` capability per shard (handed back by the agent), through which the
  control plane stops it or reads its logs;
* a watchdog that closes the connection when the agent goes silent (Cap'n Proto
  has no keepalive: a hung agent would otherwise hold the session forever).

:class:`NodeSessions` keeps the current session per node and is the reconciler's
executor: it turns placement actions into calls on the right session.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any, Awaitable, Callable, Collection, Iterator

import capnp
import trio

from llmgw.control.registry import Registry
from llmgw.control.reports import endpoint_refusal, log_refusal
from llmgw.nodeprotocol import LOGS, UPGRADE
from llmgw.releasefiles import send_pieces
from llmgw.rpc import convert, schema
from llmgw.rpc.errors import remote_reason
from llmgw.spec import KvDelta, ShardSpec, UnknownShard

#: A node's account of its configuration problem is kept to this many characters (it is shown, not parsed).
MAX_PROBLEM_CHARS = 2000
log = logging.getLogger(__name__)

#: Starting a shard on the agent is local bookkeeping plus a process spawn; the engine
#: becoming ready is reported later through the shard's reporter, not awaited here.
START_CALL_TIMEOUT = 30.0
#: Extra time allowed on top of the stop grace period for the agent to answer.
STOP_CALL_MARGIN = 10.0
#: Stop grace for replicas the reconciler removes: engines finish in-flight requests.
#: Below the reconciler's per-action timeout, so a slow stop is not cut short.
DEFAULT_STOP_GRACE = 10.0
#: Re-binding one running shard at join is a local lookup on the agent.
ADOPT_TIMEOUT = 10.0
#: Logs are read from a file on the node.
LOGS_TIMEOUT = 10.0
#: A drain call waits up to its own timeout on the agent; this much more covers the round trip
#: and a slow agent before the control plane gives up on the answer.
DRAIN_CALL_MARGIN = 10.0
#: Telling an agent its wanted engines is a small message; the installs run afterwards.
WANT_ENGINES_TIMEOUT = 10.0
#: An engine's version and device check starts the engine binary once (CUDA init included);
#: a little above the agent's own limit, so the agent's reason arrives first.
CHECK_ENGINE_TIMEOUT = 130.0
#: Deadline for one piece of a release to reach an agent (a megabyte over the LAN).
RELEASE_PIECE_TIMEOUT = 30.0
#: Deadline for an agent to install a release: copying its environment and pip (the agent's
#: own pip deadline is 15 minutes; this covers it).
UPGRADE_TIMEOUT = 960.0
#: When a node joins while it still has a session, the old session's agent is pinged: a live
#: agent answers in milliseconds, even on a busy node. One that does not answer in this time
#: is hung or gone (a crash whose connection close has not arrived, a cut network), and its
#: session is replaced. Short, because a restarted agent waits this long to join.
LIVE_PING_TIMEOUT = 2.0


#: Where a shard's KV-cache deltas go: (shard id, delta). Called on the trio thread; must not block.
KvUpdateHandler = Callable[[str, KvDelta], None]
#: ``(job id, offset) -> (bytes, total, sha256, format)``: a piece of a training job's result.
JobResults = Callable[[str, int], Awaitable[tuple[bytes, int, str, str]]]


class NoSession(LookupError):
    """The node has no live session (never joined, disconnected or lost)."""


class SessionConflict(RuntimeError):
    """A node joined while its current session's agent still answers: two agents share a node id."""

    def __init__(self, node_id: str) -> None:
        super().__init__(
            f"node {node_id!r} already has a live session whose agent answers; a second agent with "
            "the same node id is refused (stop the other agent, or give this one its own node id "
            "and certificate)"
        )
        self.node_id = node_id


class NodeSession:
    """The control plane's side of one agent connection."""

    def __init__(
        self,
        registry: Registry,
        node_id: str,
        epoch: int,
        agent: Any,
        close: Callable[[], None],
        endpoint_hosts: Collection[str] = (),
    ) -> None:
        self.registry = registry
        self.node_id = node_id
        self.epoch = epoch
        self.agent = agent
        self.shards: dict[str, Any] = {}
        self._close = close
        #: The hosts this node's shard endpoints may name (:func:`llmgw.control.reports.endpoint_hosts`).
        self.endpoint_hosts = frozenset(endpoint_hosts)
        self.last_heartbeat = trio.current_time()
        self.closed = False
        #: What the agent said it can do (llmgw/nodeprotocol.py); calls beyond its protocol check it.
        self.features: frozenset[str] = frozenset()
        #: The training jobs the agent said it runs when it joined (a new leader adopts them).
        self.jobs: frozenset[str] = frozenset()
        #: Why the node refused the cluster settings last pushed ("": it took them).
        self.settings_problem = ""
        #: What the agent reported about its own configuration (an agent.yaml that does not load).
        self.file_problem = ""
        #: Gets the KV deltas of this session's shards (set by :meth:`NodeSessions.attach`; None: dropped).
        self.on_kv_update: KvUpdateHandler | None = None
        #: Reads a piece of a training job's result for NodeDesk.jobResult (set by :meth:`NodeSessions.attach`).
        self.job_results: JobResults | None = None

    def close(self) -> None:
        """End the session: cancels the connection it runs on."""
        self.closed = True
        self._close()

    async def answers(self, timeout: float = LIVE_PING_TIMEOUT) -> bool:
        """Returns whether this session's agent answers a ping within ``timeout`` seconds.

        False when the session is closed, the connection broke or the agent is silent;
        never raises for those. Cancellation propagates.
        """
        if self.closed:
            return False
        with trio.move_on_after(timeout):
            try:
                await self.agent.ping()
            except capnp.KjException:
                return False
            return True
        return False

    def reporter(self, shard_id: str) -> Any:
        """A fresh ``ShardReporter`` capability for ``shard_id`` bound to this session."""
        s = schema.load()
        session = self

        class ShardReporterServer(s.ShardReporter.Server):
            async def status(self, status: Any, **_: Any) -> None:
                report = convert.shard_status_from(status)
                if report.id != shard_id:
                    log_refusal(session.node_id, "report-shard-id", f"a report for shard {report.id[:200]!r} "
                                f"through the reporter of {shard_id!r}")
                    raise PermissionError(f"reporter of shard {shard_id!r} cannot report for {report.id[:200]!r}")
                refusal = endpoint_refusal(report.endpoint, session.endpoint_hosts)
                if refusal is not None:
                    log_refusal(session.node_id, "report-endpoint", f"a status of shard {shard_id!r}: {refusal}")
                    raise PermissionError(f"shard {shard_id!r}: {refusal}")
                session.registry.shard_status(session.node_id, report, epoch=session.epoch)

            async def kvUpdate(self, update: Any, **_: Any) -> None:
                delta = convert.kv_update_from(update)  # copied before anything else: params die with the call
                if session.closed:
                    raise RuntimeError(f"the session of node {session.node_id!r} has ended; join again")
                if session.on_kv_update is not None:
                    session.on_kv_update(shard_id, delta)

        return ShardReporterServer()

    def desk(self) -> Any:
        """The ``NodeDesk`` capability handed back by ``join``."""
        s = schema.load()
        session = self

        class NodeDeskServer(s.NodeDesk.Server):
            async def heartbeat(self, hardware: Any, telemetry: Any, _context: Any, **_: Any) -> None:
                # Agents send telemetry only with a new sample (every 10 s, heartbeats every 2 s);
                # without one the last stays and ages. Agents before issue 16 send none.
                hw = convert.hardware_from(hardware)
                sample = convert.telemetry_from(telemetry) if _context.params._has("telemetry") else None
                session.last_heartbeat = trio.current_time()
                session.registry.heartbeat(session.node_id, hw, telemetry=sample, epoch=session.epoch)

            async def reportConfigProblem(self, problem: str, **_: Any) -> None:
                session.file_problem = str(problem)[:MAX_PROBLEM_CHARS]

            async def jobResult(self, id: str, offset: int, _context: Any, **_: Any) -> None:  # noqa: A002
                if session.job_results is None:
                    raise RuntimeError("this control plane keeps no training job results")
                chunk, total, sha256, fmt = await session.job_results(str(id), int(offset))
                _context.results.chunk, _context.results.total = chunk, total
                _context.results.sha256, _context.results.format = sha256, fmt

            async def reportEngines(self, engines: Any, **_: Any) -> None:
                infos = [convert.engine_from(e) for e in engines]
                session.last_heartbeat = trio.current_time()
                session.registry.engines_changed(session.node_id, infos, epoch=session.epoch)

        return NodeDeskServer()

    async def want_engines(self, wanted: dict[str, str]) -> None:
        """Tell the agent which engines (name -> version, "" = its default) it should have."""
        with trio.fail_after(WANT_ENGINES_TIMEOUT):
            await self.agent.wantEngines([{"key": k, "value": v} for k, v in sorted(wanted.items())])

    async def tell_control_planes(self, addresses: list[str]) -> None:
        """Tell the agent the RPC addresses of every control plane, the leader first."""
        with trio.fail_after(WANT_ENGINES_TIMEOUT):
            await self.agent.controlPlanes(addresses)

    async def check_engine(self, engine: str) -> str:
        """Returns the output of ``engine``'s version and device check on this node."""
        with trio.fail_after(CHECK_ENGINE_TIMEOUT):
            return str((await self._call(self.agent.checkEngine(engine))).output)

    async def adopt(self, shard_id: str) -> None:
        """Re-bind a shard the agent reported at join to a reporter of this session.

        Raises :class:`~llmgw.spec.UnknownShard` if the agent has no such shard.
        """
        with trio.fail_after(ADOPT_TIMEOUT), _unknown_shard_typed(shard_id):
            result = await self.agent.adopt(shard_id, self.reporter(shard_id))
            self.shards[shard_id] = result.shard

    async def start_shard(self, spec: ShardSpec) -> None:
        """Ask the agent to start ``spec``; its progress arrives through the shard's reporter."""
        with trio.fail_after(START_CALL_TIMEOUT):
            result = await self.agent.startShard(convert.shard_spec_dict(spec), self.reporter(spec.id))
            self.shards[spec.id] = result.shard

    async def stop_shard(self, shard_id: str, grace: float = DEFAULT_STOP_GRACE) -> None:
        """Stop one shard (SIGTERM, grace, SIGKILL on the node) and drop its handle.

        Raises :class:`~llmgw.spec.UnknownShard` (the handle dropped too) if the agent has
        no such shard: nothing runs there to stop.
        """
        shard = self.shards.get(shard_id)
        try:
            with trio.fail_after(grace + STOP_CALL_MARGIN), _unknown_shard_typed(shard_id):
                if shard is None:
                    shard = (await self.agent.adopt(shard_id, self.reporter(shard_id))).shard
                await shard.stop(int(grace * 1000))
        except UnknownShard:
            self.shards.pop(shard_id, None)
            raise
        self.shards.pop(shard_id, None)

    async def drain_shard(self, shard_id: str, timeout: float) -> tuple[bool, int]:
        """Asks the agent to wait until the shard's engine has no request in flight, at most
        ``timeout`` seconds; returns (idle, requests still in flight). Raises
        :class:`~llmgw.spec.UnknownShard` if the agent has no such shard, KeyError if this
        session holds no handle on it, TooSlowError if the agent does not answer in time."""
        shard = self.shards.get(shard_id)
        if shard is None:
            raise KeyError(shard_id)
        with trio.fail_after(timeout + DRAIN_CALL_MARGIN), _unknown_shard_typed(shard_id):
            result = await shard.drain(max(0, min(int(timeout * 1000), 2**32 - 1)))
        return bool(result.idle), int(result.inFlight)

    async def node_logs(self, source: str, lines: int, after: int = 0) -> tuple[list[str], list[str], int]:
        """Returns the agent's last ``lines`` lines of ``source`` ("agent" or a shard id; with
        ``after``, a cursor it returned, only the lines since), the sources it has and the new
        cursor. Raises LookupError for an unknown source, RuntimeError for an agent too old
        to answer, TooSlowError after :data:`LOGS_TIMEOUT`."""
        self._needs(LOGS, "send its logs: upgrade it, or read them on the machine")
        with trio.fail_after(LOGS_TIMEOUT):
            try:
                result = await self.agent.logs(source, lines, after)
            except capnp.KjException as exc:
                raise LookupError(remote_reason(exc)) from None
        return list(result.lines), list(result.sources), int(result.cursor)

    async def upgrade(self, wheel: Path, sha256: str, rollback_after: float = 0.0) -> tuple[str, str]:
        """Send the release ``wheel`` to this agent in pieces and have it install it and restart
        on it; return (new release, previous release). Raises RuntimeError with the agent's
        reason (or for an agent too old to be upgraded over its session), TooSlowError past the
        deadlines. ``rollback_after``: seconds the new release has to join before the node goes
        back by itself (0: no limit)."""
        self._needs(UPGRADE, "be upgraded over its session: upgrade it on the machine")

        async def piece(offset: int, chunk: bytes) -> int:
            with trio.fail_after(RELEASE_PIECE_TIMEOUT):
                return int((await self._call(self.agent.receiveRelease(wheel.name, offset, chunk))).received)

        await send_pieces(wheel, piece)
        with trio.fail_after(UPGRADE_TIMEOUT):
            result = await self._call(self.agent.upgrade(wheel.name, sha256, int(rollback_after * 1000)))
        return str(result.release), str(result.previous)

    async def rollback(self) -> tuple[str, str]:
        """Have this agent put its previous release back and restart on it; return (release, previous)."""
        self._needs(UPGRADE, "roll back over its session: switch ROOT/current on the machine")
        with trio.fail_after(UPGRADE_TIMEOUT):
            result = await self._call(self.agent.rollback())
        return str(result.release), str(result.previous)

    def _needs(self, feature: str, what: str) -> None:
        """Raise RuntimeError unless the agent's registration listed ``feature`` (llmgw/nodeprotocol.py)."""
        if feature not in self.features:
            raise RuntimeError(f"the agent on {self.node_id} is too old to {what}")

    async def _call(self, promise: Any) -> Any:
        try:
            return await promise
        except capnp.KjException as exc:
            raise RuntimeError(f"node {self.node_id}: {remote_reason(exc)}") from None

    async def logs(self, shard_id: str, lines: int) -> list[str]:
        shard = self.shards.get(shard_id)
        if shard is None:
            raise KeyError(shard_id)
        with trio.fail_after(LOGS_TIMEOUT):
            result = await shard.logs(lines)
            return list(result.lines)


class NodeSessions:
    """The current session of every connected node; the reconciler's executor."""

    def __init__(self, registry: Registry, wanted_engines: dict[str, str] | None = None) -> None:
        self.registry = registry
        #: Where every session's KV deltas go (the control plane sets it: the gateway's KV
        #: index); None: dropped.
        self.on_kv_update: KvUpdateHandler | None = None
        #: Where NodeDesk.jobResult reads training job results (the control plane sets it).
        self.job_results: JobResults | None = None
        self._sessions: dict[str, NodeSession] = {}
        #: server.yaml ``engines:`` (name -> version, "" = the agent's default): pushed to every
        #: node when it joins.
        self.wanted_engines: dict[str, str] = dict(wanted_engines or {})
        #: Each node's agent version, as it last joined (kept after it leaves, for `ctl nodes`).
        self.agent_versions: dict[str, str] = {}

    def attach(self, session: NodeSession) -> None:
        """Make ``session`` the node's current one; an older session of that node is closed."""
        old = self._sessions.get(session.node_id)
        session.on_kv_update = self.on_kv_update
        session.job_results = self.job_results
        self._sessions[session.node_id] = session
        if old is not None and old is not session:
            log.info("node %s joined again; closing its previous session", session.node_id)
            old.close()

    def detach(self, session: NodeSession) -> None:
        """The connection of ``session`` ended: forget it and tell the registry (that it was
        expected when this control plane closed it or is stopping: cancelled here)."""
        if self._sessions.get(session.node_id) is session:
            del self._sessions[session.node_id]
        expected = session.closed or trio.current_effective_deadline() == -math.inf
        self.registry.node_disconnected(session.node_id, session.epoch, expected=expected)

    async def check_replaceable(self, node_id: str) -> None:
        """Raises :class:`SessionConflict` if ``node_id``'s current session still answers.

        Returns at once when the node has no session; otherwise waits up to
        :data:`LIVE_PING_TIMEOUT` for its agent's answer. A stale session (closed, broken or
        silent) is left for :meth:`attach` to replace.
        """
        current = self._sessions.get(node_id)
        if current is not None and await current.answers():
            raise SessionConflict(node_id)

    def all(self) -> list[NodeSession]:
        """Returns every open node session."""
        return list(self._sessions.values())

    def close_all(self) -> None:
        """Close every node session (this control plane stopped leading: the agents go and
        find the leader). Synchronous; never raises."""
        for session in list(self._sessions.values()):
            session.close()

    def get(self, node_id: str) -> NodeSession:
        session = self._sessions.get(node_id)
        if session is None:
            raise NoSession(f"node {node_id!r} has no live session")
        return session

    def find_shard(self, shard_id: str) -> NodeSession:
        for session in self._sessions.values():
            if shard_id in session.shards:
                return session
        raise KeyError(shard_id)

    # -- the reconciler's executor ----------------------------------------------------

    async def start_replica(self, node_id: str, spec: ShardSpec) -> None:
        await self.get(node_id).start_shard(spec)

    async def stop_replica(self, node_id: str, shard_id: str) -> None:
        await self.get(node_id).stop_shard(shard_id)

    async def drain_replica(self, node_id: str, shard_id: str, timeout: float) -> bool:
        """Returns whether the replica's engine finished every request in flight within
        ``timeout`` seconds (logging how many it still has when not); raises like
        :meth:`NodeSession.drain_shard`."""
        idle, in_flight = await self.get(node_id).drain_shard(shard_id, timeout)
        if not idle:
            log.warning("rollout: %s on node %s still has %d request(s) in flight after %g s; stopping it",
                        shard_id, node_id, in_flight, timeout)
        return idle


@contextlib.contextmanager
def _unknown_shard_typed(shard_id: str) -> Iterator[None]:
    """Turns an agent's "unknown shard" answer (a remote error) into :class:`~llmgw.spec.UnknownShard`."""
    try:
        yield
    except capnp.KjException as exc:
        if UnknownShard.in_text(remote_reason(exc)):
            raise UnknownShard(shard_id) from None
        raise


async def watch_heartbeats(session: NodeSession, lost_after: float) -> None:
    """Close ``session`` once its agent has been silent for ``lost_after`` seconds.

    Runs until the session closes or this task is cancelled. The registry's own
    watchdog marks the node LOST; this ends the stuck connection behind it.
    """
    while not session.closed:
        silent_until = session.last_heartbeat + lost_after
        now = trio.current_time()
        if now >= silent_until:
            log.warning("node %s sent no heartbeat for %.1fs; closing its session", session.node_id, lost_after)
            session.close()
            return
        await trio.sleep_until(silent_until)

