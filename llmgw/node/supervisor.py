"""The node agent's shard supervisor: the set of shards, adoption and the session binding.

The supervisor's nursery holds one task per shard (:class:`llmgw.node.shard.Shard`, which
owns the engine's lifecycle: spawn, health, restart with backoff, stop; its own task
tree is drawn in :mod:`llmgw.node.shard`):

    supervisor ── shard (one per shard id) ── status sender, KV-event subscriber, lifecycle

:meth:`Supervisor.start_shard` checks a new spec (id, engine, arguments), gives it a free
port and persists it before its task starts; :meth:`Supervisor.bind_reporter` points a
shard's statuses at the session that asked for it; :meth:`Supervisor.stop_shard` ends it.

The shard's spec, port, engine process identity and restart count are persisted under
``state_dir``. Cancelling :meth:`Supervisor.run` (agent exit) leaves engines running
and their state on disk; the next agent's ``run`` adopts them (same pid, create time
and command line) or, if they are gone, starts them again on the same port.

Every engine also carries a marker in its environment (:mod:`llmgw.node.markers`), so
``run`` finds engines whose record was lost or went stale: one of a persisted shard is
adopted, one of no shard (or a second one of a shard) is stopped. No engine of this
state directory is left running unmanaged. ``run`` holds an exclusive lock on the state
directory (:mod:`llmgw.node.statelock`): a second agent on it is refused at once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Mapping

import trio

from llmgw.logbook import lines_after
from llmgw.node import markers, shard_state
from llmgw.node.drain import DrainResult
from llmgw.node.engines import ENGINES, Engine, get_engine
from llmgw.node.fetch import FetchSettings
from llmgw.node.kvevents import KvEventsConfig
from llmgw.node.ports import free_port
from llmgw.node.process import adopt, describe_exit, terminate
from llmgw.node.shard import STOP_GRACE, RestartPolicy, Shard, ShardContext, ShardReporter
from llmgw.node.shard_state import ShardRecord
from llmgw.node.statelock import lock_state_dir
from llmgw.spec import ShardSpec, ShardStatus, UnknownShard

__all__ = ["KV_EVENTS_HOST", "Supervisor", "kv_events_for"]

logger = logging.getLogger(__name__)


#: Where engines publish KV events, whatever address they serve on: only the agent
#: subscribes. IPv4 on purpose: vLLM BINDS (instead of connecting) any endpoint with "::".
KV_EVENTS_HOST = "127.0.0.1"


def kv_events_for(
    engine: Engine, spec: ShardSpec, avoid: set[int] = frozenset(),  # type: ignore[assignment]
) -> KvEventsConfig | None:
    """Returns where ``engine`` publishes KV events for ``spec`` (fresh loopback ports outside
    ``avoid``), or None when it does not (no ``kv_events_for`` on the adapter, or turned off by
    the profile). Raises OSError if no free ports outside ``avoid`` came up."""
    chooser = getattr(engine, "kv_events_for", None)
    if chooser is None:
        return None
    return chooser(spec, KV_EVENTS_HOST, avoid)


class Supervisor:
    """Runs the shards of this node; see the module docstring.

    ``state_dir``: where shard state and engine logs live. ``host``: the address
    engines listen on (and are health-checked at). ``engines``: adapters by name
    (default :data:`llmgw.node.engines.ENGINES`). ``policy``: timings and limits.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        host: str = "127.0.0.1",
        engines: Mapping[str, Engine] | None = None,
        policy: RestartPolicy | None = None,
        fetch_settings: FetchSettings | None = None,
        disabled_engines: Iterable[str] = (),
        engine_user: str = "",
    ) -> None:
        self.state_dir = Path(state_dir)
        #: Engines agent.yaml's ``disabled_engines`` names: no new shard of them starts here (one
        #: already running is still adopted and stopped as usual).
        self.disabled_engines = frozenset(disabled_engines)
        #: Who engines run as (llmgw/node/engine_user.py; "": the agent's own user).
        self.engine_user = engine_user
        #: Where weights of shards with an http(s)/hf:// source are fetched to before start
        #: (default: ``<state_dir>/../weights``, the agent's default weights directory).
        self.fetch_settings = fetch_settings or FetchSettings(weights_dir=self.state_dir.parent / "weights")
        self.host = host
        self.engines: Mapping[str, Engine] = ENGINES if engines is None else engines
        self.policy = policy or RestartPolicy()
        self._shards: dict[str, Shard] = {}
        self._nursery: trio.Nursery | None = None
        self._start_lock = trio.Lock()  # one start_shard at a time: ids and ports are checked, then taken

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Locks the state directory, adopts or restarts the persisted shards, signals
        started, then runs until cancelled.

        Each persisted engine still running (same pid, create time, command line, or the
        marker of its shard) is adopted; the others are started again. Shards that had
        FAILED stay FAILED. Marked engines of no persisted shard are stopped (in the
        background). Raises :class:`~llmgw.node.statelock.StateDirLocked` (before started)
        if another agent holds the state directory. Cancellation stops supervising but
        leaves engines running and state on disk; the lock is released on any exit.
        """
        lock = await trio.to_thread.run_sync(lock_state_dir, self.state_dir)
        try:
            records = await trio.to_thread.run_sync(shard_state.load_all, self.state_dir)
            marked = await trio.to_thread.run_sync(markers.find_marked, self.state_dir)
            strays = markers.match_marked(records, marked)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for stray in strays:
                    nursery.start_soon(self._stop_stray, stray)
                for record in records:
                    shard = self._new_shard(record, self.engines.get(record.spec.engine), reporter=None)
                    self._shards[record.spec.id] = shard
                    await nursery.start(shard.run, True)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            lock.release()

    async def _stop_stray(self, stray: markers.MarkedEngine) -> None:
        """Stops a marked engine no shard of this supervisor owns (logged, never raises)."""
        process = adopt(stray.identity)
        if process is None:
            return  # gone meanwhile
        try:
            code = await terminate(process, self.policy.kill_grace)
        except trio.TooSlowError:
            logger.error("stray engine pid %d (shard %s) survived SIGKILL", stray.identity.pid, stray.shard_id)
            return
        finally:
            process.close()
        logger.warning(
            "stopped engine pid %d of shard %s: it carried this agent's marker but no shard here owns it "
            "(its record was lost, or another engine serves that shard); it %s",
            stray.identity.pid, stray.shard_id, describe_exit(code),
        )

    async def start_shard(self, spec: ShardSpec, reporter: ShardReporter | None) -> None:
        """Starts supervising ``spec``; returns once the shard is STARTING (spawning underway).

        Idempotent per shard id: the same spec again only rebinds ``reporter`` (which
        then gets the current status), also when that shard is FAILED (stop it, then
        start it, to retry). If the shard is being stopped, waits for that first.
        Raises ValueError if the id is already used by a different spec, :class:`~llmgw.node.engines.UnknownEngine` for an engine this node
        lacks, :class:`~llmgw.node.engines.EngineRefused` for refused args/env, OSError if
        the state cannot be written, RuntimeError if :meth:`run` is not running.
        """
        async with self._start_lock:
            await self._start_shard(spec, reporter)

    async def _start_shard(self, spec: ShardSpec, reporter: ShardReporter | None) -> None:
        if self._nursery is None:
            raise RuntimeError("the supervisor is not running: start Supervisor.run() first")
        existing = self._shards.get(spec.id)
        if existing is not None and existing.stopping:
            await existing.wait_stopped()  # it has removed itself from _shards by then
            existing = self._shards.get(spec.id)
        if existing is not None:
            if existing.spec != spec:
                raise ValueError(
                    f"shard {spec.id} already runs a different spec on this node; stop it before starting it again"
                )
            self.bind_reporter(spec.id, reporter)
            return
        shard_state.check_shard_id(spec.id)
        if spec.engine in self.disabled_engines:
            raise ValueError(f"engine {spec.engine} is disabled on this node (agent.yaml disabled_engines): "
                             f"shard {spec.id} cannot start here")
        engine = get_engine(spec.engine, self.engines)
        engine.check_args(spec)
        taken = self._allocated_ports()
        port = free_port(self.host, taken)
        record = ShardRecord(spec=spec, port=port, kv_events=kv_events_for(engine, spec, taken | {port}))
        try:
            await trio.to_thread.run_sync(shard_state.save, self.state_dir, record)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot record shard {spec.id} in {self.state_dir}: {exc.strerror or exc}") from None
        if self._nursery is None:
            raise RuntimeError("the supervisor stopped while the shard was being started")
        shard = self._new_shard(record, engine, reporter=reporter)
        self._shards[spec.id] = shard
        await self._nursery.start(shard.run, False)

    def bind_reporter(self, shard_id: str, reporter: ShardReporter | None) -> None:
        """Sends this shard's statuses to ``reporter`` from now on, starting with the current one.

        Raises :class:`~llmgw.spec.UnknownShard` (a KeyError) if the shard is unknown.
        ``None`` unbinds (statuses are kept).
        """
        self._shard(shard_id).bind(reporter)

    async def stop_shard(self, shard_id: str, grace: float = STOP_GRACE) -> None:
        """Stops the shard's engine and forgets the shard; returns once it is STOPPED.

        SIGTERM to the engine's process group, up to ``grace`` seconds, SIGKILL to the
        group; then its state directory (and log) is deleted and STOPPED is reported.
        Raises :class:`~llmgw.spec.UnknownShard` (a KeyError) if the shard is unknown.
        Concurrent calls all wait for the one stop.
        """
        await self._shard(shard_id).stop(grace)

    async def drain_shard(self, shard_id: str, timeout: float) -> DrainResult:
        """Waits until the shard's engine has no request in flight, at most ``timeout`` seconds;
        returns whether it did and the last count (see :meth:`Shard.drain`). Raises
        :class:`~llmgw.spec.UnknownShard` if the shard is unknown."""
        return await self._shard(shard_id).drain(timeout)

    def _shard(self, shard_id: str) -> Shard:
        """Returns the shard; raises :class:`~llmgw.spec.UnknownShard` if there is none by that id."""
        shard = self._shards.get(shard_id)
        if shard is None:
            raise UnknownShard(shard_id)
        return shard

    def ports(self) -> set[int]:
        """Returns the ports given to this supervisor's shards (a new one must avoid them; the
        node's firewall protects them from the moment they are given, llmgw/node/firewall.py)."""
        return {s.port for s in self._shards.values()}

    def _allocated_ports(self) -> set[int]:
        """Returns every port given to this supervisor's shards: their HTTP ports and their
        engines' KV-event ports (a new shard's ports must avoid them all)."""
        taken = self.ports()
        for shard in self._shards.values():
            kv_events = shard.record.kv_events
            if kv_events is not None:
                taken.update(kv_events.ports())
        return taken

    def _new_shard(self, record: ShardRecord, engine: Engine | None, reporter: ShardReporter | None) -> Shard:
        """Returns the (not yet running) shard of ``record``, sharing this supervisor's settings."""
        context = ShardContext(self.state_dir, self.host, self.policy, self.fetch_settings,
                               taken_ports=self._allocated_ports, engine_user=self.engine_user)
        return Shard(record, engine, reporter, context=context, on_stopped=self._forget)

    def _forget(self, shard: Shard) -> None:
        """Drops a stopped shard (the shard's ``on_stopped``)."""
        if self._shards.get(shard.spec.id) is shard:
            del self._shards[shard.spec.id]

    def shards(self) -> list[tuple[ShardSpec, ShardStatus]]:
        """Returns every shard this supervisor knows, with its latest status (for registration)."""
        return [(s.spec, s.status) for s in self._shards.values()]

    def status(self, shard_id: str) -> ShardStatus:
        """Returns the shard's latest status. Raises :class:`~llmgw.spec.UnknownShard` if unknown."""
        return self._shard(shard_id).status

    def logs_after(self, shard_id: str, cursor: int, limit: int) -> tuple[list[str], int]:
        """Returns the engine's output lines added since ``cursor`` (0: its last ``limit``
        lines) and the new cursor (:func:`llmgw.logbook.lines_after`). Raises
        :class:`~llmgw.spec.UnknownShard` if unknown."""
        tail = self._shard(shard_id).tail
        return lines_after(tail.lines, tail.total, cursor, limit)

    def logs(self, shard_id: str, lines: int) -> list[str]:
        """Returns up to ``lines`` of the engine's last output lines, oldest first.

        At most :data:`llmgw.node.process.OUTPUT_LINES` are kept. Raises
        :class:`~llmgw.spec.UnknownShard` if unknown.
        """
        return self._shard(shard_id).tail.last(lines)
