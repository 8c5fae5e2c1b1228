"""The node agent: joins the control plane and serves its ``Agent`` capability.

Nursery tree::

    Agent.run
    ├── supervisor (engines outlive sessions)
    └── session loop ── per session: join, heartbeats; Agent/Shard capabilities for that session

A session is one connection to one control plane. When it ends (the control
plane died, the network broke, a heartbeat went unanswered) the engines keep
serving; the loop reconnects to the first reachable control plane of the list,
with a short jittered backoff that starts small again once a join is accepted, and
the new registration lists the running shards so the control plane re-binds them.
"""

from __future__ import annotations

import json as _json  # a handler's parameter is named json
import logging
import random
import ssl
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs
import capnp
import trio

from llmgw import __version__, labels, logbook
from llmgw.nodeprotocol import AGENT_FEATURES, FIREWALL, TRAINING
from llmgw.config.defaults import DEFAULT_RECONNECT_BACKOFF_MAX
from llmgw.logthrottle import LogThrottle
from llmgw.node import discovery
from llmgw.node.cluster_settings import ClusterSettings
from llmgw.node.firewall import NodeFirewall
from llmgw.node.planes import ControlPlaneList
from llmgw.releases import (UPGRADE_EXIT_STATUS, clear_pending, find_root, install_here, mark_pending,
                            read_pending, release_root, rollback_release)
from llmgw.releasefiles import ReleaseError, ReleaseInbox
from llmgw.node.install import Converger, InstallError, SimInstaller
from llmgw.node.jobs import JobRunner, JobSpec, make_job_server
from llmgw.node.supervisor import Supervisor
from llmgw.node.telemetry.sampler import NodeSampler
from llmgw.node.weights import disk_usage, prepare_weights_dir
from llmgw.rpc import convert, net, schema
from llmgw.rpc.connection import open_client
from llmgw.rpc.errors import remote_reason
from llmgw.spec import KvDelta, ShardStatus, leader_hint

log = logging.getLogger(__name__)
#: A control plane that is down is dialled every second or so: one line per address, then one per interval.
_unreachable = LogThrottle(log)
#: A join refused again and again (a second agent with this node id, a refused certificate) is
#: retried as often: one line per address, then one per interval; a join accepted resets it.
_refused = LogThrottle(log)

#: First pause after a failed connection attempt; doubles up to ``backoff_max``
#: (agent.yaml ``reconnect_backoff_max``, whose default and reason are in llmgw.config.defaults).
RECONNECT_BACKOFF_MIN = 0.2
#: Each pause is drawn between this share of the backoff and all of it, so a fleet of agents
#: does not redial a restarted control plane in lockstep.
RECONNECT_JITTER = 0.5
#: A join does a registration round trip plus certificate checks on a possibly busy control plane.
JOIN_TIMEOUT = 15.0
#: A status report is one small message; a control plane that cannot take it in this time is in trouble.
REPORT_TIMEOUT = 10.0
#: Heartbeats missed in a row before the agent gives up on a session and reconnects.
HEARTBEAT_MISSES = 3
#: An engine's version and device check starts the engine binary once (CUDA init included).
ENGINE_CHECK_TIMEOUT = 120.0
#: The log source naming the agent's own log (``llmgw ctl logs NODE --source agent``); a shard
#: id names that engine's output.
AGENT_LOG_SOURCE = "agent"
#: Lines of a log sent when the caller asks for none in particular.
DEFAULT_LOG_LINES = 100
#: At most one engine report per this many seconds: install progress changes often,
#: the operator needs it fresh, the control plane does not need every step.
ENGINE_REPORT_INTERVAL = 1.0


class RemoteReporter:
    """A shard's ``ShardReporter`` capability, as the supervisor's reporter protocol."""

    def __init__(self, cap: Any) -> None:
        self._cap = cap

    async def status(self, status: ShardStatus) -> None:
        """Sends ``status``; raises TooSlowError after REPORT_TIMEOUT, capnp errors if the session broke."""
        with trio.fail_after(REPORT_TIMEOUT):
            await self._cap.status(convert.shard_status_dict(status))

    async def kv_update(self, delta: KvDelta) -> None:
        """Sends one KV-cache delta of the shard; raises like :meth:`status`."""
        with trio.fail_after(REPORT_TIMEOUT):
            await self._cap.kvUpdate(convert.kv_update_dict(delta))


def _make_shard_server(supervisor: Supervisor, shard_id: str) -> Any:
    s = schema.load()

    class ShardServer(s.Shard.Server):
        """The control plane's handle on one engine of this node."""

        async def stop(self, graceMs: int, **_: Any) -> None:
            await supervisor.stop_shard(shard_id, grace=graceMs / 1000 if graceMs else 10.0)

        async def status(self, _context: Any, **_: Any) -> None:
            status = supervisor.status(shard_id)
            _context.results.status = convert.shard_status_dict(status)

        async def logs(self, lines: int, _context: Any, **_: Any) -> None:
            _context.results.lines = supervisor.logs(shard_id, lines or 100)

        async def drain(self, timeoutMs: int, _context: Any, **_: Any) -> None:
            result = await supervisor.drain_shard(shard_id, timeoutMs / 1000)
            _context.results.idle = result.idle
            _context.results.inFlight = result.in_flight

    return ShardServer()


def _json_argument(text: str, what: str) -> Any:
    """Return the JSON value an RPC argument holds; raises ValueError saying ``what`` is not JSON."""
    try:
        return _json.loads(str(text))
    except ValueError as exc:
        raise ValueError(f"{what} is not JSON: {exc}") from None


def _release_root(settings: ClusterSettings | None) -> Path:
    """Return the release root this agent runs from; raises ReleaseError saying why it cannot upgrade."""
    if settings is None:
        raise ReleaseError("llmgw up's own agent is upgraded with the llmgw that runs it (pip install -U)")
    return release_root()


def _make_agent_server(
    supervisor: Supervisor, converger: Converger | None = None, planes: ControlPlaneList | None = None,
    settings: ClusterSettings | None = None, firewall: NodeFirewall | None = None, jobs: JobRunner | None = None,
) -> Any:
    s = schema.load()
    inbox = ReleaseInbox(supervisor.state_dir.parent / "incoming-releases")

    class AgentServer(s.Agent.Server):
        """This node, as handed to the control plane in the registration of one session."""

        async def startShard(self, spec: Any, reporter: Any, _context: Any, **_: Any) -> None:
            shard_spec = convert.shard_spec_from(spec)
            await supervisor.start_shard(shard_spec, RemoteReporter(reporter))
            _context.results.shard = _make_shard_server(supervisor, shard_spec.id)

        async def adopt(self, id: str, reporter: Any, _context: Any, **_: Any) -> None:
            shard_id = str(id)
            supervisor.bind_reporter(shard_id, RemoteReporter(reporter))
            _context.results.shard = _make_shard_server(supervisor, shard_id)

        async def ping(self, **_: Any) -> None:
            return None

        async def wantEngines(self, engines: Any, **_: Any) -> None:
            wanted = {str(kv.key): str(kv.value) for kv in engines}
            if converger is not None:
                converger.want(wanted)

        async def settings(self, json: str, **_: Any) -> None:
            layer = _json_argument(json, "the cluster settings")
            if settings is None:
                if layer == {}:  # nothing to take: every join sends the layer, empty for most clusters
                    return
                raise RuntimeError("this agent does not take cluster settings (llmgw up's own agent)")
            if not isinstance(layer, dict):
                raise ValueError("the cluster settings must be a mapping")
            settings.apply(layer)  # ValueError: it does not load with agent.yaml

        async def logs(self, source: str, lines: int, after: int, _context: Any, **_: Any) -> None:
            source, count, cursor = str(source) or AGENT_LOG_SOURCE, int(lines) or DEFAULT_LOG_LINES, int(after)
            shard_ids = [spec.id for spec, _ in supervisor.shards()]
            if source == AGENT_LOG_SOURCE:
                ring = logbook.PROCESS_RING
                if ring is None:
                    got, cursor = ["(this agent keeps no log in memory: it runs inside `llmgw up`, whose log is "
                                   "its terminal)"], 0
                else:
                    got, cursor = ring.after(cursor, count)
            elif source in shard_ids:
                got, cursor = supervisor.logs_after(source, cursor, count)
            else:
                known = ", ".join([AGENT_LOG_SOURCE, *shard_ids])
                raise LookupError(f"no log source {source!r} on this node: it has {known}")
            _context.results.lines = got
            _context.results.cursor = cursor
            _context.results.sources = [AGENT_LOG_SOURCE, *shard_ids]

        async def restart(self, **_: Any) -> None:
            if settings is None:
                raise RuntimeError("this agent cannot restart itself (llmgw up's own agent)")
            settings.restart_soon("asked by llmgw ctl restart")

        async def receiveRelease(self, name: str, offset: int, chunk: bytes, _context: Any, **_: Any) -> None:
            _context.results.received = inbox.write(str(name), int(offset), bytes(chunk))

        async def upgrade(self, name: str, sha256: str, rollbackAfterMs: int, _context: Any, **_: Any) -> None:
            root = _release_root(settings)
            release, previous = await install_here(root, inbox, str(name), str(sha256))
            if rollbackAfterMs:
                mark_pending(root, previous, release, time.time() + rollbackAfterMs / 1000)
            log.warning("agent: llmgw %s installed under %s (was %s)", release, root, previous)
            assert settings is not None
            settings.restart_soon(f"upgraded to llmgw {release}", UPGRADE_EXIT_STATUS)
            _context.results.release, _context.results.previous = release, previous

        async def rollback(self, _context: Any, **_: Any) -> None:
            root = _release_root(settings)
            release, previous = await trio.to_thread.run_sync(rollback_release, root)
            log.warning("agent: rolled back to llmgw %s under %s (from %s)", release, root, previous)
            assert settings is not None
            settings.restart_soon(f"rolled back to llmgw {release}", UPGRADE_EXIT_STATUS)
            _context.results.release, _context.results.previous = release, previous

        async def startJob(self, spec: Any, pairs: bytes, reporter: Any, _context: Any, **_: Any) -> None:
            if jobs is None:
                raise RuntimeError("this agent does not train (llmgw up's own agent)")
            job = JobSpec.from_capnp(spec)
            jobs.start(job, bytes(pairs), reporter)  # JobBusy: one job at a time
            _context.results.job = make_job_server(jobs, job.id)

        async def adoptJob(self, id: str, reporter: Any, _context: Any, **_: Any) -> None:  # noqa: A002
            if jobs is None:
                raise RuntimeError("this agent does not train (llmgw up's own agent)")
            jobs.rebind(str(id), reporter)  # LookupError: it ended
            _context.results.job = make_job_server(jobs, str(id))

        async def firewall(self, json: str, **_: Any) -> None:
            if firewall is None:
                raise RuntimeError("this agent leaves its node's firewall to the operator (firewall: false)")
            firewall.set(_json_argument(json, "the firewall setting"))  # ValueError: it does not check

        async def controlPlanes(self, addresses: Any, **_: Any) -> None:
            if planes is not None:
                planes.learn([str(a) for a in addresses])

        async def checkEngine(self, engine: str, _context: Any, **_: Any) -> None:
            name = str(engine)
            if converger is None:
                raise RuntimeError("this agent does not manage engine installs")
            with trio.fail_after(ENGINE_CHECK_TIMEOUT):
                try:
                    _context.results.output = await converger.check(name)
                except InstallError as exc:
                    raise RuntimeError(str(exc)) from None

    return AgentServer()


#: A piece of a training job's result is at most a MiB: a connected control plane sends it in
#: well under a second; this long means the session is dead or stuck.
JOB_RESULT_TIMEOUT = 60.0


class DeskLink:
    """The current session's NodeDesk, for what runs beside the session and needs the control
    plane: fetching a training job's result (``FetchSettings.job_results`` is :meth:`piece`)."""

    def __init__(self) -> None:
        self.desk: Any = None

    async def piece(self, job_id: str, offset: int) -> tuple[bytes, int, str, str]:
        """Returns (bytes, total, sha256, format) of job ``job_id``'s result from ``offset``;
        raises RuntimeError without a session or with the control plane's reason."""
        desk = self.desk
        if desk is None:
            raise RuntimeError("the agent has no session with a control plane now")
        try:
            with trio.fail_after(JOB_RESULT_TIMEOUT):
                r = await desk.jobResult(job_id, offset)
        except trio.TooSlowError:
            raise RuntimeError(f"the control plane sent no piece in {JOB_RESULT_TIMEOUT:g} s") from None
        except capnp.KjException as exc:
            raise RuntimeError(remote_reason(exc)) from None
        return bytes(r.chunk), int(r.total), str(r.sha256), str(r.format)


@attrs.define
class Agent:
    """One node agent.

    ``control_planes`` is the failover list of ``host:port`` RPC addresses;
    ``context`` the client TLS context holding this node's certificate.
    """

    node_id: str
    control_planes: Sequence[str]
    context: ssl.SSLContext
    supervisor: Supervisor
    engine_host: str | None = None
    backoff_max: float = DEFAULT_RECONNECT_BACKOFF_MAX
    #: The agent heartbeats at the shorter of this and the interval the control plane asks for.
    heartbeat_interval: float | None = None
    #: Installs engines and reports them (None: only the simulator, never installing).
    converger: Converger | None = None
    #: Where fetched weights go; created at start, its disk reported in every heartbeat
    #: (None: ``<supervisor state dir>/../weights``).
    weights_dir: Path | None = None
    #: The leader's address a standby named when it refused the last join (None: none named).
    _leader_hint: str | None = attrs.field(default=None, init=False)
    #: The cluster settings it runs with, and the restart a change asks for (None: takes none).
    cluster_settings: ClusterSettings | None = None
    #: Whether this agent keeps llmgw's nft table on the node (agent.yaml ``firewall``).
    manage_firewall: bool = False
    #: The node's labels (agent.yaml ``labels``), sent with every registration.
    labels: Mapping[str, str] = attrs.field(factory=dict)
    #: ``control_planes`` plus the list the leader sent (llmgw/node/planes.py).
    _planes: ControlPlaneList = attrs.field(init=False)
    #: The node's firewall (None: left to the operator, or llmgw up's own agent).
    firewall: NodeFirewall | None = attrs.field(init=False, default=None)
    #: Set once a control plane accepted this agent's join.
    _joined: trio.Event = attrs.field(init=False, factory=trio.Event)
    #: Reads the cards, the host and the engines' use of it for registrations and heartbeats.
    sampler: NodeSampler = attrs.field(factory=NodeSampler)
    #: Runs LoRA training jobs (None: this agent does not train; llmgw/node/jobs.py).
    jobs: JobRunner | None = None
    #: Set to each session's NodeDesk while it lasts (training job results are fetched over it).
    desk_link: DeskLink = attrs.field(factory=DeskLink)

    def __attrs_post_init__(self) -> None:
        if self.converger is None:
            self.converger = Converger({"sim": SimInstaller()})
        if self.weights_dir is None:
            self.weights_dir = self.supervisor.state_dir.parent / "weights"
        self._planes = ControlPlaneList(self.control_planes, self.supervisor.state_dir.parent)
        if self.manage_firewall:
            self.firewall = NodeFirewall(self.supervisor.state_dir.parent, self.supervisor.ports,
                                         self._planes.addresses)

    async def _confirm_upgrade(self) -> None:
        """Confirm a pending upgrade to this release once joined; past its deadline without a
        join, switch back to the previous release and restart on it (llmgw/releases.py)."""
        root = find_root()
        pending = read_pending(root) if root is not None else None
        if root is None or pending is None:
            return
        if pending["to"] != __version__:  # an older release, after a rollback: nothing to confirm
            clear_pending(root)
            return
        with trio.move_on_at(trio.current_time() + max(0.0, float(pending["deadline"]) - time.time())):
            await self._joined.wait()
            clear_pending(root)
            log.info("agent: the upgrade to llmgw %s is confirmed (joined a control plane)", __version__)
            return
        release, _ = await trio.to_thread.run_sync(rollback_release, root)
        clear_pending(root)
        log.error("agent: llmgw %s did not join a control plane by the upgrade's deadline: back to %s",
                  __version__, release)
        assert self.cluster_settings is not None
        self.cluster_settings.restart_soon(f"rolled back to llmgw {release}", UPGRADE_EXIT_STATUS)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Supervise engines and keep a session with a control plane until cancelled, or
        until :attr:`cluster_settings` asks for a restart (then returns, the caller restarts).

        Cancellation ends the session and leaves engines running (their state
        stays on disk for the next agent to adopt).
        """
        assert self.converger is not None and self.weights_dir is not None
        self.weights_dir = await trio.to_thread.run_sync(prepare_weights_dir, self.weights_dir)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.supervisor.run)
            await nursery.start(self.converger.run)
            if self.firewall is not None:
                await nursery.start(self.firewall.run)
            if self.jobs is not None:
                await nursery.start(self.jobs.run)
            task_status.started()
            if self.cluster_settings is None:
                await self._session_loop()
            else:
                nursery.start_soon(self._confirm_upgrade)
                nursery.start_soon(self._session_loop)
                nursery.start_soon(self.cluster_settings.watch_file)
                await self.cluster_settings.restart.wait()
                nursery.cancel_scope.cancel()

    async def _session_loop(self) -> None:
        """Keeps a session with the first control plane of the list that accepts, until cancelled.

        A standby refuses the join naming the leader, which is dialled next; the control
        plane whose session just ended is tried last (it may be frozen, and a frozen one
        takes the whole TLS handshake timeout to give up on). The list is agent.yaml's plus
        what the leader sent (:mod:`llmgw.node.planes`). After a session ends or every
        address failed, waits the backoff (jittered) and goes round the list again; the
        backoff doubles up to ``backoff_max`` and starts again from
        :data:`RECONNECT_BACKOFF_MIN` once a join is accepted.
        """
        backoff = RECONNECT_BACKOFF_MIN
        failed: str | None = None  # the control plane whose session ended last: tried last
        while True:
            worked = False
            known = self._planes.addresses()
            order = [a for a in known if a != failed] + ([failed] if failed else [])
            index = 0
            while index < len(order):
                address = order[index]
                index += 1
                try:
                    stream = await net.connect(address, self.context)
                except net.ConnectError as exc:
                    _unreachable.failure(address, logging.WARNING, "agent: %s", exc)
                    continue
                _unreachable.recovered(address, "agent: %s answers again", address)
                self._leader_hint = None
                try:
                    worked = await self._session(address, stream)
                finally:
                    await trio.aclose_forcefully(stream)
                if worked:
                    failed = address
                    break
                # A standby refused the join naming the leader: dial it next.
                hint = self._leader_hint
                if hint is not None and hint != failed and hint not in order[:index]:
                    order.insert(index, hint)
            if worked:
                backoff = RECONNECT_BACKOFF_MIN
            await trio.sleep(backoff * random.uniform(RECONNECT_JITTER, 1.0))
            backoff = min(backoff * 2, self.backoff_max)

    def _probe(self, control_plane_host: str) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
        """Blocking discovery for a registration: address, hardware, engines (run in a thread)."""
        address = self.engine_host or discovery.route_address(control_plane_host)
        hardware = convert.hardware_dict(self._read_hardware())
        engines = self._engine_dicts()
        return address, hardware, engines

    def _read_hardware(self) -> Any:
        """Blocking: discovery's figures plus the weights directory's disk (run in a thread)."""
        hardware = discovery.read_hardware(self.sampler.inventory)
        assert self.weights_dir is not None
        free_mb, total_mb = disk_usage(self.weights_dir)
        return attrs.evolve(hardware, disk_free_mb=free_mb, disk_total_mb=total_mb)

    def _sample(self, engine_groups: Mapping[str, int], sent: int) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
        """Blocking: a heartbeat's hardware, its telemetry (None when the sampler's generation is
        still ``sent``: nothing new to send), both as capnp dicts, and that generation (run in a
        thread). ``engine_groups``: each running shard's engine process group, by shard id."""
        hardware = convert.hardware_dict(self._read_hardware())
        telemetry = self.sampler.sample(engine_groups)
        generation = self.sampler.generation
        return hardware, convert.telemetry_dict(telemetry) if generation != sent else None, generation

    def _engine_dicts(self) -> list[dict[str, Any]]:
        """The engines to report: the converger's view, plus adapters it has no installer for."""
        assert self.converger is not None
        engines = {e.name: e for e in self.converger.engines()}
        for name, adapter in self.supervisor.engines.items():
            if name not in engines:
                engines[name] = adapter.probe()
        return [convert.engine_dict(e) for _, e in sorted(engines.items())]

    async def _report_engines(self, desk: Any, seen: int) -> None:
        """Send the node's engines up whenever the converger's view changes from version ``seen``
        (the one the registration carried; a change while joining is sent at once), throttled."""
        assert self.converger is not None
        while True:
            seen = await self.converger.wait_changed(seen)
            try:
                with trio.fail_after(REPORT_TIMEOUT):
                    await desk.reportEngines(self._engine_dicts())
            except (trio.TooSlowError, capnp.KjException) as exc:
                # The heartbeat loop notices a dead session and reconnects; the next
                # registration carries the engines anyway.
                log.warning("agent: could not report engines: %s", exc)
                return
            await trio.sleep(ENGINE_REPORT_INTERVAL)

    async def _report_config_problem(self, desk: Any, settings: ClusterSettings) -> None:
        """Tell the control plane why this agent runs on an older configuration, at once if
        it does when the session starts and again at every change, until the session ends."""
        sent = ""
        while True:
            problem, changed = settings.problem, settings.problem_changed
            if problem != sent:
                try:
                    with trio.fail_after(REPORT_TIMEOUT):
                        await desk.reportConfigProblem(problem)
                except (trio.TooSlowError, capnp.KjException) as exc:
                    # An older control plane has no such call; a dead session is the heartbeat's to notice.
                    log.warning("agent: could not report its configuration problem: %s", exc)
                    return
                sent = problem
            await changed.wait()

    async def _session(self, address: str, stream: trio.SSLStream) -> bool:
        """Run one session on a connected stream until it breaks. Returns True if the join succeeded."""
        host, _ = net.split_address(address)
        assert self.converger is not None
        engines_seen = self.converger.version  # the registration carries at least this view
        try:
            node_address, hardware, engines = await trio.to_thread.run_sync(self._probe, host)
        except OSError as exc:
            log.warning("agent: cannot register with %s: %s", address, exc)
            return False
        shards = [
            {"spec": convert.shard_spec_dict(spec), "status": convert.shard_status_dict(status)}
            for spec, status in self.supervisor.shards()
        ]
        joined = False
        try:
            async with open_client(stream) as client:
                cluster = client.bootstrap().cast_as(schema.load().Cluster)
                registration = {
                    "nodeId": self.node_id,
                    "address": node_address,
                    "hardware": hardware,
                    "shards": shards,
                    "engines": engines,
                    "features": [f for f in AGENT_FEATURES if (f != FIREWALL or self.firewall is not None)
                                 and (f != TRAINING or self.jobs is not None)],
                    "agent": _make_agent_server(self.supervisor, self.converger, self._planes,
                                                self.cluster_settings, self.firewall, self.jobs),
                    "version": __version__,
                    "labels": labels.to_pairs(self.labels),
                    "jobs": self.jobs.held() if self.jobs is not None else [],
                }
                with trio.fail_after(JOIN_TIMEOUT):
                    result = await cluster.join(registration)
                desk = self.desk_link.desk = result.desk
                interval = max(result.heartbeatIntervalMs, 100) / 1000
                if self.heartbeat_interval:
                    interval = min(interval, self.heartbeat_interval)
                joined = True
                _refused.recovered(address)
                log.info("agent: joined %s as node %r (%d shards)", address, self.node_id, len(shards))
                self._joined.set()
                # The heartbeat loop's failure is re-raised outside the nursery, unwrapped, for
                # the handlers below; the engine reporter ends quietly when the session breaks.
                failure: BaseException | None = None
                async with trio.open_nursery() as session_nursery:
                    session_nursery.start_soon(self._report_engines, desk, engines_seen)
                    if self.cluster_settings is not None:
                        session_nursery.start_soon(self._report_config_problem, desk, self.cluster_settings)
                    sent_generation = -1
                    try:
                        while True:
                            await trio.sleep(interval)
                            groups = {spec.id: status.pid for spec, status in self.supervisor.shards() if status.pid}
                            hardware, telemetry, generation = await trio.to_thread.run_sync(
                                self._sample, groups, sent_generation)
                            # Telemetry goes only with a new sample: the control plane keeps the last.
                            with trio.fail_after(interval * HEARTBEAT_MISSES):
                                if telemetry is not None:
                                    await desk.heartbeat(hardware, telemetry)
                                else:
                                    await desk.heartbeat(hardware)
                            sent_generation = generation
                    except (trio.TooSlowError, capnp.KjException) as exc:
                        failure = exc
                    session_nursery.cancel_scope.cancel()
                if failure is not None:
                    raise failure
        except trio.TooSlowError:
            log.warning("agent: %s stopped answering; reconnecting", address)
        except capnp.KjException as exc:
            if not joined:
                self._leader_hint = leader_hint(remote_reason(exc))
            if joined:
                log.warning("agent: session with %s ended: %s", address, _describe(exc, joined))
            else:
                _refused.failure(address, logging.WARNING, "agent: session with %s ended: %s",
                                 address, _describe(exc, joined))
        finally:
            self.desk_link.desk = None
        return joined


def _describe(exc: capnp.KjException, joined: bool) -> str:
    """Returns one line saying why a session ended: the control plane's own words."""
    reason = remote_reason(exc)
    if not joined and exc.type == "DISCONNECTED":
        return (
            f"the control plane closed the connection on the first call ({reason}): it refused this "
            "node's certificate (another cluster's CA, expired, issued for another node id, or revoked: "
            "the node was removed)"
        )
    return reason
