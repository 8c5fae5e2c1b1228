"""One shard's lifecycle on a node: spawn or adopt its engine, watch it, restart it, stop it.

:class:`Shard` is one task in the supervisor's nursery (:mod:`llmgw.node.supervisor`), with
its own nursery underneath:

    shard ── status sender (latest status -> bound reporter, one call at a time, deadline each)
          ├─ KV-event subscriber (engines with KV events; bound before the first spawn):
          │    mirror of the engine's blocks, net deltas -> bound reporter's kv_update,
          │    a full copy at every binding, a reset at every engine (re)start
          └─ lifecycle ── per engine run: exit watcher, output reader, health poller

Lifecycle: spawn (or adopt) the engine -> STARTING; the health poller turns it READY on
the first passing check, UNHEALTHY after UNHEALTHY_AFTER failures in a row (and READY
again on success). If the engine exits, or is not healthy within the adapter's
``startup_timeout`` (then it is killed), the shard goes RESTARTING with the reason and
the engine's last lines, waits out an exponential backoff and starts again; after
``max_failures`` consecutive failures it is FAILED. Only :meth:`Shard.stop` ends an
engine: SIGTERM to its process group, grace period, SIGKILL to the group, then the
shard's state is deleted and STOPPED reported.

Reporting never blocks a shard: the shard only records its latest status; a sender
task pushes it to the reporter bound at the time, with a deadline per call. A failing
or slow reporter is logged, and the status waits for the next binding.
"""

from __future__ import annotations

import logging
import math
import os
import signal
from pathlib import Path
from typing import Callable, Protocol

import attrs
import httpx
import trio
import zmq

from llmgw.catalog.sources import is_remote
from llmgw.logthrottle import LogThrottle, is_disconnection, reason
from llmgw.node import markers, shard_state
from llmgw.node.drain import DrainResult
from llmgw.node.drain import drain as drain_engine
from llmgw.node.engine_secret import auth_headers, secret_env
from llmgw.node.engine_user import ENGINE_HOME_DIR, EngineUser, EngineUserError, home_env, prepare_home
from llmgw.node.engine_user import resolve as resolve_engine_user
from llmgw.node.engines import Engine, EngineRefused, base_environment
from llmgw.node.engines import compute as engine_compute
from llmgw.node.engines.load import in_flight_probe
from llmgw.node.fetch import FetchError, FetchSettings, cached_path, fetch_adapters, fetch_weights
from llmgw.node.kvevents import KvSubscriber
from llmgw.node.ports import free_port, port_is_free
from llmgw.node.process import (
    EngineProcess,
    OutputTail,
    adopt,
    describe_exit,
    identity_of,
    same_process,
    signal_group,
    spawn,
    terminate,
)
from llmgw.node.shard_state import ShardRecord
from llmgw.spec import FREE_SOURCE_ENGINES, KvDelta, ShardSpec, ShardState, ShardStatus

__all__ = ["RestartPolicy", "STOP_GRACE", "Shard", "ShardContext", "ShardReporter", "endpoint_url"]

logger = logging.getLogger(__name__)
#: Reporter sends and state saves fail for every status while the agent is cut off from its
#: control plane (or its disk is full): one line per shard and kind, then one per interval.
_failures = LogThrottle(logger)

# First wait before restarting a crashed engine; doubled per consecutive failure.
# Short enough that a one-off crash costs little serving time.
BACKOFF_INITIAL = 1.0
# Ceiling of the backoff: a crash-looping engine retries at most this often.
BACKOFF_MAX = 60.0
# An engine that became ready and stayed up this long counts as having recovered:
# its next crash starts the backoff (and the failure count) from the beginning.
BACKOFF_RESET_AFTER = 300.0
# Consecutive failures (crash, or not healthy in time) after which the shard is
# FAILED rather than retried: by then it is a configuration problem, not bad luck.
MAX_CONSECUTIVE_FAILURES = 5

# Health polling: once a second is cheap for the engine and notices trouble quickly.
HEALTH_INTERVAL = 1.0
# Deadline of one health request; a loaded engine can be slow to answer, not dead.
HEALTH_TIMEOUT = 5.0
# Failed checks in a row before a READY shard is reported UNHEALTHY (one slow answer
# under load is no reason to pull a replica from routing).
UNHEALTHY_AFTER = 3

# How long an engine gets to exit after SIGTERM before its group is SIGKILLed: long
# enough for vLLM to free GPU memory and finish in-flight requests.
STOP_GRACE = 30.0

# Deadline of one status call to a reporter; a session that cannot take a status in
# this time is treated as gone (the status is kept for the next binding).
REPORT_TIMEOUT = 10.0

# SIGTERM grace for an engine stopped because its pid could not be recorded: it has just
# started and served nothing, so there is no in-flight work to finish, and the stop must
# not hold up the shard (or an agent's exit) for the full STOP_GRACE.
UNRECORDED_STOP_GRACE = 5.0

# How many of the engine's last lines go into a crash or failure report.
LAST_OUTPUT_LINES = 20

# The engine log is rotated (one old generation kept) when a new run starts and the
# file has grown past this. A long-running engine's log is not rotated under it.
LOG_ROTATE_BYTES = 64 * 1024 * 1024


@attrs.frozen
class RestartPolicy:
    """Timings and limits of supervision; defaults are the module constants above."""

    backoff_initial: float = BACKOFF_INITIAL
    backoff_max: float = BACKOFF_MAX
    backoff_reset_after: float = BACKOFF_RESET_AFTER
    max_failures: int = MAX_CONSECUTIVE_FAILURES
    health_interval: float = HEALTH_INTERVAL
    health_timeout: float = HEALTH_TIMEOUT
    unhealthy_after: int = UNHEALTHY_AFTER
    report_timeout: float = REPORT_TIMEOUT
    kill_grace: float = STOP_GRACE  # SIGTERM grace when killing an engine that missed its startup deadline

    def backoff(self, failures: int) -> float:
        """Returns the wait before the next start after ``failures`` consecutive failures (>= 1)."""
        return min(self.backoff_max, self.backoff_initial * math.pow(2, max(0, failures - 1)))


class ShardReporter(Protocol):
    """Where a shard's status goes (implemented by the RPC layer).

    Calls may fail or hang when the session is gone; the shard bounds and logs them.
    """

    async def status(self, status: ShardStatus) -> None: ...

    # Optional: ``async def kv_update(self, delta: KvDelta) -> None`` takes the shard's KV-cache
    # changes (reporters without it get none; the full copy at the next binding covers them).


def endpoint_url(host: str, port: int) -> str:
    """Returns ``http://host:port`` (IPv6 addresses in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@attrs.frozen
class ShardContext:
    """What every shard of one supervisor shares: where state lives, the engines' address,
    the restart policy, where remote weights are fetched to, and the ports the supervisor
    has given to its shards (a shard whose port was taken must not move onto another's)."""

    state_dir: Path
    host: str
    policy: RestartPolicy
    fetch_settings: FetchSettings
    taken_ports: Callable[[], set[int]] = set
    #: Who engines run as (agent.yaml ``engine_user`` as :func:`~llmgw.node.engine_user.wanted_user`
    #: gives it; "": the agent's own user). Their home is ENGINE_HOME_DIR beside the state directory.
    engine_user: str = ""


class Shard:
    """One shard's supervision (see the module docstring), a task in the supervisor's nursery.

    ``record``: the persisted spec, port and engine identity. ``engine``: its adapter (None:
    this node does not know the engine; the shard is FAILED). ``reporter``: where statuses go.
    ``context``: the supervisor's settings. ``on_stopped``: called with the shard once its
    stop is complete (the supervisor forgets it then).
    """

    def __init__(
        self,
        record: ShardRecord,
        engine: Engine | None,
        reporter: ShardReporter | None,
        *,
        context: ShardContext,
        on_stopped: Callable[[Shard], None],
    ) -> None:
        self._context = context
        self._on_stopped = on_stopped
        self._policy = context.policy
        self.record = record
        self.engine = engine
        self.dir = shard_state.shard_dir(context.state_dir, record.spec.id)
        self.tail = OutputTail(self.dir / shard_state.LOG_FILE)
        # compute: the engine's startup lines until READY, parsed then (engine_compute)
        self.collector = engine_compute.OutputCollector()
        self.tail.on_line = self.collector.add
        self._fatal: str | None = None  # set when the engine must be FAILED, not restarted
        self.status = ShardStatus(
            id=record.spec.id,
            state=ShardState.STARTING,
            endpoint=endpoint_url(context.host, record.port),
            restarts=record.restarts,
            compute=record.compute,
        )
        self._reporter = reporter
        self._delivered: tuple[object, ShardStatus] | None = None  # (reporter, status) last sent
        self._wakeup = trio.Event()
        self._process: EngineProcess | None = None
        self._adopted: EngineProcess | None = None
        self._ready_seen = False
        self._life_scope = trio.CancelScope()
        self._stop_requested = trio.Event()
        self._stop_grace = STOP_GRACE
        self._stopped = trio.Event()
        self._save_lock = trio.Lock()
        kv = record.kv_events
        # KV events: mirrored for the shard's lifetime (across engine restarts and sessions).
        self.kv: KvSubscriber | None = (
            None if kv is None else KvSubscriber(kv.endpoint, kv.replay_endpoint, topic=kv.topic, block_size=kv.block_size)
        )

    @property
    def spec(self) -> ShardSpec:
        """Returns the shard's spec as persisted (sources as given, not fetched paths)."""
        return self.record.spec

    @property
    def port(self) -> int:
        """Returns the port the engine serves on (kept across engine restarts and agents)."""
        return self.record.port

    @property
    def stopping(self) -> bool:
        """Returns True once a stop was asked for (the shard is going away)."""
        return self._stop_requested.is_set()

    # -- status --------------------------------------------------------------------

    def publish(self, state: ShardState, message: str, **changes: object) -> None:
        """Records a new status (restarts always from the record) and wakes the sender."""
        self.status = attrs.evolve(
            self.status, state=state, message=message, restarts=self.record.restarts, **changes
        )
        logger.info("shard %s: %s: %s", self.spec.id, state.value, message)
        self._wakeup.set()

    def bind(self, reporter: ShardReporter | None) -> None:
        """Binds ``reporter`` and has the sender push the current status to it (and, for a
        shard with KV events, a full copy of its KV mirror)."""
        self._reporter = reporter
        self._delivered = None
        self._wakeup.set()
        if self.kv is not None and reporter is not None:
            self.kv.resend_full()

    async def _send_kv(self, delta: KvDelta) -> None:
        """Sends one KV delta to the bound reporter within the report deadline. Without a
        reporter (or one without ``kv_update``) the delta is dropped: the mirror is kept and
        the next binding gets a full copy. Raises what the reporter raises, or TooSlowError;
        the subscriber then sends a full copy next."""
        send = getattr(self._reporter, "kv_update", None)
        if send is None:
            return
        with trio.fail_after(self._policy.report_timeout):
            await send(delta)

    async def _run_kv(self, kv: KvSubscriber, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Runs the KV subscriber until cancelled. A bind failure is raised (before started);
        a later failure is logged and ends only the subscriber: the engine keeps serving."""
        try:
            await kv.run(self._send_kv, task_status=task_status)
        except Exception:
            if not kv.bound:
                raise
            logger.exception("shard %s: the KV-event subscriber failed; the router routes it approximately", self.spec.id)

    async def _send_loop(self) -> None:
        """Pushes the latest status to the bound reporter whenever it changes. Runs until cancelled."""
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            reporter, status = self._reporter, self.status
            if reporter is None:
                continue
            if self._delivered is not None and self._delivered[0] is reporter and self._delivered[1] is status:
                continue
            if await self._deliver(reporter, status):
                self._delivered = (reporter, status)

    async def _deliver(self, reporter: ShardReporter, status: ShardStatus) -> bool:
        """Sends one status within the report deadline; returns False (logged) if it failed."""
        try:
            with trio.fail_after(self._policy.report_timeout):
                await reporter.status(status)
        except trio.TooSlowError:
            _failures.failure(
                ("report", self.spec.id), logging.WARNING,
                "shard %s: reporter took over %.0f s for a status; keeping it for the next binding",
                self.spec.id,
                self._policy.report_timeout,
            )
            return False
        except Exception as exc:
            disconnected = is_disconnection(exc)  # the agent's session loop says so already
            _failures.failure(
                ("report", self.spec.id), logging.INFO if disconnected else logging.WARNING,
                "shard %s: reporter failed (%s); keeping the status for the next binding", self.spec.id, reason(exc),
                exc_info=not disconnected,
            )
            return False
        _failures.recovered(("report", self.spec.id), "shard %s: status reported again", self.spec.id)
        return True

    async def _persist(self) -> None:
        """Persists the record (in a thread; not cancellable midway). Raises OSError if the
        disk refuses (full, read-only); the previous record then stays intact."""
        async with self._save_lock:
            await trio.to_thread.run_sync(shard_state.save, self._context.state_dir, self.record)

    async def _save(self) -> None:
        """Persists the record like :meth:`_persist`; logs a failure instead of raising it."""
        try:
            await self._persist()
        except OSError as exc:
            _failures.failure(
                ("save", self.spec.id), logging.ERROR,
                "shard %s: cannot persist its state (%s); a restarted agent finds its engine by its marker",
                self.spec.id, exc, exc_info=True,
            )
        else:
            _failures.recovered(("save", self.spec.id), "shard %s: its state is persisted again", self.spec.id)

    # -- lifetime ------------------------------------------------------------------

    async def run(self, adopting: bool, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The shard task: prepares (adopts), signals started, supervises until stopped.

        Returns after a stop completed (STOPPED sent). Cancellation (agent exit) leaves
        the engine running. Errors inside the lifecycle are turned into FAILED, never
        propagated to the supervisor.
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_loop)
                if self.kv is not None:  # bound before the engine starts: vLLM connects to it
                    try:
                        await nursery.start(self._run_kv, self.kv)
                    except zmq.ZMQError as exc:
                        logger.warning(
                            "shard %s: cannot bind the KV-event endpoint %s (%s); no KV events for this shard",
                            self.spec.id, self.kv.endpoint, exc,
                        )
                        self.kv = None
                if adopting:
                    self._prepare_adoption()
                else:
                    self.publish(ShardState.STARTING, "starting the engine")
                task_status.started()
                with self._life_scope:
                    try:
                        await self._lifecycle()
                    except Exception as exc:
                        logger.exception("shard %s: supervision failed", self.spec.id)
                        self.publish(ShardState.FAILED, f"supervision failed inside the agent: {exc!r}", pid=0)
                await self._stop_requested.wait()
                await self._stop_engine()
                nursery.cancel_scope.cancel()
        finally:
            if self._process is not None:  # releases a pidfd; never signals the engine
                self._process.close()
        self._on_stopped(self)
        reporter = self._reporter
        if reporter is not None and self._delivered != (reporter, self.status):
            await self._deliver(reporter, self.status)
        self._stopped.set()

    def _prepare_adoption(self) -> None:
        """Adopts the persisted engine if it still runs; sets the first status either way."""
        identity = self.record.identity
        process = adopt(identity) if identity is not None else None
        self._adopted = process
        if process is not None:
            self._process = process
            self.tail.load_existing()
            if self.record.failed:  # a FAILED shard keeps no engine; a live one is a stray, killed on stop
                self.publish(
                    ShardState.FAILED, self.record.message, pid=process.identity.pid, last_output=self.record.last_output
                )
            else:
                self.publish(
                    ShardState.STARTING,
                    f"adopted the running engine (pid {process.identity.pid}) from a previous agent; checking its health",
                    pid=process.identity.pid,
                    adapters=self._adopted_adapters(),
                )
        elif self.record.failed:
            self.publish(ShardState.FAILED, self.record.message, last_output=self.record.last_output)
        elif identity is not None:
            self.publish(
                ShardState.STARTING,
                f"the engine of the previous agent (pid {identity.pid}) is gone; starting it again",
            )
        else:
            self.publish(ShardState.STARTING, "starting the engine (none was running)")

    async def drain(self, timeout: float) -> DrainResult:
        """Returns once the engine has no request in flight or ``timeout`` seconds passed
        (see :func:`llmgw.node.drain.drain`; the reads carry the shard's secret)."""
        return await drain_engine(
            self.status.endpoint, in_flight_probe(self.engine), timeout,
            headers=auth_headers(self.spec), label=f"shard {self.spec.id}",
        )

    async def stop(self, grace: float) -> None:
        """Asks the shard task to stop its engine; returns once STOPPED is recorded.

        The shard task does the stopping (SIGTERM to the group, ``grace`` seconds, SIGKILL,
        state deleted): cancelling this call only stops the waiting, not the stop. A second
        call while one is under way waits for it (its ``grace`` is not used).
        """
        if not self._stop_requested.is_set():
            self._stop_grace = grace
            self.publish(ShardState.STOPPING, f"SIGTERM sent to the engine's process group; SIGKILL after {grace:g} s")
            self._stop_requested.set()
            self._life_scope.cancel()
        await self._stopped.wait()

    async def wait_stopped(self) -> None:
        """Returns once this shard has been stopped (STOPPED recorded, forgotten by its supervisor)."""
        await self._stopped.wait()

    async def _stop_engine(self) -> None:
        """Terminates the engine's group (if running), deletes the state, records STOPPED."""
        process, message = self._process, "stopped on request"
        # An engine that already exited had its group killed then; its pid may be reused since.
        if process is not None:
            try:
                if process.poll() is False:
                    code = await terminate(process, self._stop_grace)
                    message = f"stopped on request (engine {describe_exit(code)})"
            except trio.TooSlowError:
                message = f"stop requested, but engine pid {process.identity.pid} survived SIGKILL (stuck in the kernel?)"
                logger.error("shard %s: %s", self.spec.id, message)
            finally:
                process.close()
        await trio.to_thread.run_sync(shard_state.remove, self._context.state_dir, self.spec.id)
        self.publish(ShardState.STOPPED, message, pid=0)

    async def _lifecycle(self) -> None:
        """Starts/adopts, watches and restarts the engine; returns only once FAILED."""
        if self.record.failed:
            return
        if self.engine is None:
            message = (
                f"engine {self.spec.engine!r} is not known to this node; "
                "install it or stop the shard"
            )
            self.publish(ShardState.FAILED, message, pid=0)
            return
        process, self._adopted = self._adopted, None
        failures = 0
        while True:
            outcome, ready, uptime = "", False, 0.0
            if process is None:
                try:
                    self.engine.check_args(self.spec)
                except EngineRefused as exc:
                    await self._give_up(str(exc), ())
                    return
                try:
                    process = await self._spawn()
                except EngineUserError as exc:  # retrying cannot create the user: say so and stop
                    await self._give_up(str(exc), ())
                    return
                except OSError as exc:
                    outcome = f"the engine could not be started: {exc}"
                except FetchError as exc:
                    outcome = f"fetching failed: {exc}"
            if process is not None:
                outcome, ready, uptime = await self._supervise(process)
                process = None
                if self._fatal is not None:  # e.g. given GPUs, the engine found none: retrying cannot help
                    self.status = attrs.evolve(self.status, compute=self.record.compute)
                    await self._give_up(self._fatal, self.tail.run_output(LAST_OUTPUT_LINES))
                    return
            if ready and uptime >= self._policy.backoff_reset_after:
                failures = 0
            failures += 1
            self.record.restarts += 1
            self.record.identity = None
            last_output = self.tail.run_output(LAST_OUTPUT_LINES)
            if failures >= self._policy.max_failures:
                await self._give_up(
                    f"the engine failed {failures} times in a row; giving up. Last failure: {outcome}. "
                    "Check the engine's last output and the model's profile, then stop and start the shard",
                    last_output,
                )
                return
            await self._save()
            delay = self._policy.backoff(failures)
            self.publish(
                ShardState.RESTARTING,
                f"{outcome}; restarting in {delay:g} s (failure {failures} of {self._policy.max_failures})",
                pid=0,
                last_output=last_output,
            )
            await trio.sleep(delay)

    async def _give_up(self, message: str, last_output: tuple[str, ...]) -> None:
        """Records FAILED (persisted, so a restarted agent reports it too)."""
        self.record.failed, self.record.message, self.record.last_output = True, message, last_output
        self.record.identity = None
        await self._save()
        self.publish(ShardState.FAILED, message, pid=0, last_output=last_output)

    async def _local_weights(self) -> ShardSpec:
        """Returns the spec with ``source`` and each adapter's ``source`` a local path,
        fetching remote weights and adapters first.

        Progress is published as STARTING ("fetching weights: 1.2/4.0 GB", "fetching adapter
        NAME: 3/8 MB"). Raises :class:`FetchError`; cancellation leaves only resumable
        ``.partial`` files.
        """

        def progress(message: str) -> None:
            self.publish(ShardState.STARTING, message, pid=0)

        spec = self.spec
        if is_remote(spec.source):
            local = await fetch_weights(spec.source, self._context.fetch_settings, progress)
            spec = attrs.evolve(spec, source=str(local))
        if spec.adapters:  # the simulated engine's adapters are names only: no files to check
            adapters = await fetch_adapters(
                spec.adapters, self._context.fetch_settings, progress, check_local=spec.engine not in FREE_SOURCE_ENGINES
            )
            spec = attrs.evolve(spec, adapters=adapters)
        return spec

    def _adopted_adapters(self) -> tuple[tuple[str, str], ...]:
        """Returns (name, local path) of the spec's adapters as an adopted engine loaded them:
        where a completed fetch lies (no network call), else the source as given."""
        settings = self._context.fetch_settings
        return tuple(
            (a.name, str(cached_path(a.source, settings) or a.source)) for a in self.spec.adapters
        )

    async def _spawn(self) -> EngineProcess:
        """Starts a new engine run (log rotated if large); returns it, identity persisted.

        The shard's port is bind-tested first and, if something else listens there, the
        engine gets a fresh port (said so in the status). The engine carries the marker of
        this shard (:mod:`llmgw.node.markers`). Raises OSError if the process cannot be
        started, or if its identity cannot be persisted: the engine is then stopped
        (SIGTERM, grace, SIGKILL to its group) rather than left running unrecorded.
        """
        assert self.engine is not None
        shard_state.make_private_dirs(self._context.state_dir, self.dir)
        log_path = self.tail.path
        try:
            if log_path.stat().st_size > LOG_ROTATE_BYTES:
                os.replace(log_path, log_path.with_name(log_path.name + ".1"))
        except FileNotFoundError:
            pass
        self.tail.skip_to_end()
        self.tail.mark_run_start()
        if self.kv is not None:
            self.kv.engine_restarted()  # a new engine holds no blocks and counts from 0
        self.collector.reset()
        self._fatal = None
        spec = await self._local_weights()
        await self._check_port()
        if self.kv is not None and self.record.kv_events is not None:  # only with a subscriber bound
            argv = self.engine.argv(spec, self._context.host, self.port, kv_events=self.record.kv_events)  # type: ignore[call-arg]
        else:
            argv = self.engine.argv(spec, self._context.host, self.port)
        user, home = await trio.to_thread.run_sync(self._engine_home)
        env = {
            **base_environment(),
            **(home_env(home) if user is not None else {}),
            **self.engine.env(spec),
            **markers.marker_env(self._context.state_dir, spec.id),
            **secret_env(spec),  # in the environment, not argv: /proc/PID/cmdline is world-readable
        }
        process = await spawn(argv, env=env, log_path=log_path, cwd=home if user is not None else self.dir, user=user)
        self._process = process  # before any checkpoint: a stop from now on must find it
        self.record.identity = process.identity
        try:
            await self._persist()
        except OSError as exc:
            await self._stop_unrecorded(process, exc)
            raise OSError(
                f"its pid {process.identity.pid} could not be recorded in {self._context.state_dir} "
                f"({exc.strerror or exc}); stopped it rather than leave it unmanaged"
            ) from None
        self.publish(
            ShardState.STARTING,
            f"engine started (pid {process.identity.pid}); waiting for its health check",
            pid=process.identity.pid,
            last_output=(),
            adapters=tuple((a.name, a.source) for a in spec.adapters),
        )
        return process

    def _engine_home(self) -> tuple[EngineUser | None, Path]:
        """Blocking: returns who the engine runs as (None: the agent) and the engines' home (made
        for that user). Raises EngineUserError for a user that cannot be used, OSError for a home
        that cannot be made."""
        user = resolve_engine_user(self._context.engine_user)
        home = self._context.state_dir.parent / ENGINE_HOME_DIR
        return user, prepare_home(home, user) if user is not None else home

    async def _stop_unrecorded(self, process: EngineProcess, exc: OSError) -> None:
        """Stops an engine whose identity could not be persisted (shielded: never left running)."""
        logger.error("shard %s: cannot record engine pid %d (%s); stopping it", self.spec.id, process.identity.pid, exc)
        with trio.CancelScope(shield=True):
            try:
                await terminate(process, min(self._policy.kill_grace, UNRECORDED_STOP_GRACE))
            except trio.TooSlowError:
                logger.error("shard %s: engine pid %d survived SIGKILL", self.spec.id, process.identity.pid)
            finally:
                process.close()
        self._process = None
        self.record.identity = None

    async def _check_port(self) -> None:
        """Moves the shard to a fresh port if something already listens on its own.

        Raises OSError if the engine host is not an address of this machine.
        """
        host, port = self._context.host, self.port
        if await trio.to_thread.run_sync(port_is_free, host, port):
            return
        new_port = free_port(host, self._context.taken_ports() | {port})
        self.record.port = new_port
        message = f"port {port} is taken by another process; the engine gets port {new_port} instead"
        logger.warning("shard %s: %s", self.spec.id, message)
        self.publish(ShardState.STARTING, message, endpoint=endpoint_url(host, new_port), pid=0)

    async def _supervise(self, process: EngineProcess) -> tuple[str, bool, float]:
        """Watches one engine run until it exits (or is killed for missing its startup deadline).

        Returns (what happened in words, whether it became ready, seconds it ran).
        Cancellation (stop or agent exit) leaves the process alone.
        """
        self._process = process
        self._ready_seen = False
        started = trio.current_time()
        killed_because: list[str] = []

        async def health_then_kill() -> None:
            reason = await self._poll_health()
            killed_because.append(reason)
            try:
                await terminate(process, grace=self._policy.kill_grace)
            except trio.TooSlowError:
                logger.error("shard %s: engine pid %d survived SIGKILL", self.spec.id, process.identity.pid)

        async with trio.open_nursery() as nursery:
            await nursery.start(self.tail.follow)
            nursery.start_soon(health_then_kill)
            code = await process.wait()
            nursery.cancel_scope.cancel()
        signal_group(process.identity.pid, signal.SIGKILL)  # whatever the engine left behind in its group
        try:
            self.tail.read_new(final=True)  # the engine's last words
        except OSError as exc:
            logger.warning("shard %s: cannot read the engine log: %s", self.spec.id, exc)
        process.close()
        uptime = trio.current_time() - started
        if killed_because:
            return f"{killed_because[0]}; killed it", False, uptime
        return f"engine (pid {process.identity.pid}) {describe_exit(code)}", self._ready_seen, uptime

    async def _poll_health(self) -> str:
        """Polls the health endpoint; publishes READY/UNHEALTHY.

        Returns (only) when the engine has not passed a check within the adapter's
        startup timeout, with the reason in words. Runs until cancelled otherwise.
        """
        assert self.engine is not None
        url = self.status.endpoint + self.engine.health_path
        timeout = self.engine.startup_timeout
        deadline = trio.current_time() + timeout
        failures = 0
        # The secret goes on the health checks too: /health is open on every engine today, but
        # an engine that guards it must not look dead.
        headers = auth_headers(self.spec)
        async with httpx.AsyncClient(timeout=self._policy.health_timeout, trust_env=False, headers=headers) as client:
            while True:
                ok, detail = await self._check(client, url)
                if ok:
                    failures = 0
                    if not self._ready_seen:
                        self._ready_seen = True
                        await self._refresh_identity()
                        fatal = await self._read_compute()
                        if fatal is not None:
                            self._fatal = fatal
                            return fatal
                    if self.status.state != ShardState.READY:
                        self.publish(ShardState.READY, "health check passing", last_output=(), compute=self.record.compute)
                else:
                    failures += 1
                    if not self._ready_seen and trio.current_time() >= deadline:
                        return f"engine not healthy within {timeout:g} s (last check: {detail})"
                    if (
                        self._ready_seen
                        and failures >= self._policy.unhealthy_after
                        and self.status.state == ShardState.READY
                    ):
                        self.publish(ShardState.UNHEALTHY, f"health check failed {failures} times in a row: {detail}")
                await trio.sleep(self._policy.health_interval)

    async def _check(self, client: httpx.AsyncClient, url: str) -> tuple[bool, str]:
        """Returns (passed, what happened) for one GET of ``url`` within the health timeout."""
        with trio.move_on_after(self._policy.health_timeout):
            try:
                response = await client.get(url)
            except httpx.HTTPError as exc:
                return False, f"{url}: {type(exc).__name__}: {exc}".rstrip(": ")
            if response.status_code == 200:
                return True, "HTTP 200"
            return False, f"{url} answered HTTP {response.status_code}"
        return False, f"{url} did not answer within {self._policy.health_timeout:g} s"

    async def _read_compute(self) -> str | None:
        """Reads what the engine computes on (its output, else nvidia-smi, else CPU) and persists it.

        Returns the reason the shard must FAIL (given GPUs, the engine says it has none, in
        its words, or holds memory on none of them: compute.unused_gpus), or None. Called once per run, when the engine is first healthy.
        """
        assert self.engine is not None
        # The engine wrote its startup lines before it answered the health check, but the
        # follower reads the log on a timer: catch up first, or READY races the parser.
        self.tail.read_new()
        lines = self.collector.close() or list(self.tail.lines)  # adopted runs: what the log still holds
        parsed = engine_compute.engine_compute(self.engine, lines)
        failure = engine_compute.engine_gpu_failure(self.engine, parsed, self.spec)
        pid = self._process.identity.pid if self._process is not None else 0
        if parsed is None and self.record.compute is not None:
            compute = self.record.compute  # an adopted engine whose startup lines are gone: keep what it said
        else:
            compute = await trio.to_thread.run_sync(engine_compute.resolve_compute, parsed, self.spec, pid)
        if compute != self.record.compute:
            self.record.compute = compute
            await self._save()
        if failure is None and pid:
            failure = await trio.to_thread.run_sync(engine_compute.unused_gpus, self.engine, self.spec, pid)
        return failure

    async def _refresh_identity(self) -> None:
        """Re-reads the engine's identity once ready (engines may retitle themselves) and persists it."""
        process = self._process
        if process is None:
            return
        current = identity_of(process.identity.pid)
        if current is not None and same_process(current, process.identity):
            if self.record.identity != current:
                self.record.identity = current
                await self._save()
