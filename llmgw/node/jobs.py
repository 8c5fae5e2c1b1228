"""Training jobs on a node: one at a time, each in a nursery of its own under the agent (issue 17).

The control plane's scheduler calls ``Agent.startJob`` with the job, its pairs and a
``JobReporter`` capability for that job alone; :class:`JobRunner` starts the job in its own
nursery and hands back a ``TrainingJob`` capability whose ``cancel`` cancels that nursery
(the trainer's process group is killed: nothing is left running). What training does is
given as ``train`` (llmgw/node/training/: fetch the weights, the trainer in the vLLM
environment with the training overlay, GGUF conversion); this module only runs it, relays
its events in order, and sends the result up in checksummed pieces.

A job whose reports cannot be sent (its control plane went away) keeps training and waits
up to :data:`REBIND_GRACE_S` for a new leader to adopt it (the agent's next registration
lists it; ``Agent.adoptJob`` hands a new reporter): its reports then go on where they
stopped. Without one it is cancelled: nobody could receive its result. The agent's nursery
closing cancels every job.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import shutil
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

import attrs
import capnp
import trio

from llmgw.rpc import convert, schema
from llmgw.trioutil import unwrap_single_group
from llmgw.training import RESULT_PIECE_BYTES, TrainingParams

log = logging.getLogger(__name__)

#: Every report call has this deadline: a control plane that takes longer is gone or stuck
#: (the job then waits for a new one: REBIND_GRACE_S).
REPORT_TIMEOUT_S = 30.0
#: Events waiting to be sent, at most; beyond it new events are dropped until the backlog drains
#: (a trainer reporting faster than the control plane takes them loses progress lines, never
#: its result or its end, which are sent after the events).
EVENT_BACKLOG = 256
#: Lines kept per job for TrainingJob.logs, and the jobs whose lines are kept (the newest).
LOG_LINES = 2000
LOG_JOBS = 20
#: How long a job whose reports failed waits for a new leader to adopt it: a failover is a
#: lease (10 s by default) and the agent's reconnection (seconds) away; this is ample.
REBIND_GRACE_S = 120.0


@attrs.frozen
class JobSpec:
    """One job as the node gets it (schema TrainingJobSpec). ``gpu`` -1: the CPU."""

    id: str
    model: str
    weights: str
    params: TrainingParams
    gpu: int = -1
    gpu_uuid: str = ""
    gguf: bool = False

    @classmethod
    def from_capnp(cls, r: Any) -> "JobSpec":
        return cls(str(r.id), str(r.model), str(r.weights), convert.training_params_from(r.params), int(r.gpu),
                   str(r.gpuUuid), bool(r.gguf))


class Train(Protocol):
    """Trains ``spec`` on the pairs file in ``workdir``, calling ``on_event`` with each event line
    the trainer prints; returns (the result file, its format: "peft" or "gguf"). Cancellation
    must leave no process running."""

    def __call__(self, spec: JobSpec, pairs: Path, workdir: Path,
                 on_event: Callable[[str], None]) -> Awaitable[tuple[Path, str]]: ...


class JobBusy(RuntimeError):
    """Another job trains on this node."""


@attrs.define
class _Active:
    """A job a runner holds: from its start until its end is reported (or its reports are
    lost), so a job whose end waits for a new leader is still listed and adoptable. It
    trains (and keeps the node busy) until ``ended``."""

    id: str
    scope: trio.CancelScope
    reports: "_Reports"
    #: Set once the job's nursery is over (its trainer gone), before its end is reported.
    ended: trio.Event = attrs.field(factory=trio.Event)


class JobRunner:
    """Runs training jobs one at a time (see the module docstring). ``workdir``: where each job
    gets a directory (removed when it ends); ``train``: what a job does."""

    def __init__(self, workdir: Path, train: Train) -> None:
        self.workdir = workdir
        self._train = train
        self._nursery: trio.Nursery | None = None
        self._held: dict[str, _Active] = {}
        self._logs: dict[str, collections.deque[str]] = {}
        self._stopping = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Holds the nursery jobs run in, until cancelled (which cancels every job)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                self._stopping = True  # the jobs' nurseries are being cancelled with this one

    def held(self) -> list[str]:
        """The jobs this node holds: training, or waiting to report their end (an agent's
        registration lists them, so a new leader adopts them)."""
        return list(self._held)

    def start(self, spec: JobSpec, pairs: bytes, reporter: Any) -> None:
        """Starts ``spec`` reporting to ``reporter``; raises JobBusy when a job trains here, and
        RuntimeError when the runner is not running."""
        if self._nursery is None:
            raise RuntimeError("this agent is not taking training jobs (it is stopping)")
        training = next((a.id for a in self._held.values() if not a.ended.is_set()), None)
        if training is not None:
            raise JobBusy(f"job {training} trains on this node; one job at a time")
        if spec.id in self._held:
            raise JobBusy(f"job {spec.id} is still reporting its end here")
        scope = trio.CancelScope()
        active = self._held[spec.id] = _Active(spec.id, scope, _Reports(spec.id, reporter, scope))
        self._logs[spec.id] = collections.deque(maxlen=LOG_LINES)
        for old in list(self._logs)[:-LOG_JOBS]:
            del self._logs[old]
        self._nursery.start_soon(self._job, spec, pairs, active)

    def rebind(self, job_id: str, reporter: Any) -> None:
        """Sends job ``job_id``'s reports to ``reporter`` from now on (a new leader adopted it);
        raises LookupError when the job does not run here."""
        active = self._held.get(job_id)
        if active is None:
            raise LookupError(f"training job {job_id} does not run on this node (it ended)")
        active.reports.rebind(reporter)

    def cancel(self, job_id: str) -> None:
        """Cancels job ``job_id``'s nursery (nothing when it has ended)."""
        active = self._held.get(job_id)
        if active is not None:
            active.scope.cancel()

    async def wait_ended(self, job_id: str) -> None:
        """Returns once job ``job_id``'s nursery is over, its trainer gone (at once for a job
        not held here)."""
        active = self._held.get(job_id)
        if active is not None:
            await active.ended.wait()

    def logs(self, job_id: str, lines: int) -> list[str]:
        kept = list(self._logs.get(job_id, ()))
        return kept[-lines:] if lines else kept

    async def _job(self, spec: JobSpec, pairs: bytes, active: _Active) -> None:
        directory = self.workdir / spec.id
        scope, reports = active.scope, active.reports
        ok, message = False, ""
        delivered: _Delivered | None = None  # the result, kept until the job's end is reported
        try:
            with scope:
                await trio.to_thread.run_sync(_fresh_dir, directory)
                pairs_path = directory / "pairs.jsonl"
                await trio.to_thread.run_sync(pairs_path.write_bytes, pairs)
                send, receive = trio.open_memory_channel[str](EVENT_BACKLOG)
                with unwrap_single_group():
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(reports.relay, receive)

                        dropped = 0

                        def on_event(line: str) -> None:
                            nonlocal dropped
                            self._logs[spec.id].append(line)
                            try:
                                send.send_nowait(line)
                            except trio.WouldBlock:
                                dropped += 1
                                if dropped == 1:
                                    log.warning("training job %s: reports are behind; events are dropped until "
                                                "they catch up", spec.id)

                        result, fmt = await self._train(spec, pairs_path, directory / "work", on_event)
                        send.close()  # the relay ends once every event is sent
                data = await trio.to_thread.run_sync(result.read_bytes)
                delivered = await self._send_result(data, fmt, reports)
                ok = True
            if reports.lost:
                ok, message = False, f"its control plane stopped taking reports ({reports.lost}): cancelled"
            elif scope.cancelled_caught:
                message = "cancelled: the trainer was stopped"
        except trio.Cancelled:
            del self._held[spec.id]
            if self._stopping:
                log.warning("training job %s: the agent stops; its trainer is stopped", spec.id)
            raise
        except Exception as exc:  # noqa: BLE001 - the job fails with the reason; the agent goes on
            message = str(exc) or type(exc).__name__
            log.warning("training job %s failed: %s", spec.id, message)
        finally:
            active.ended.set()
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, directory, True)
        log.info("training job %s %s", spec.id, "finished" if ok else f"ended: {message}")
        try:
            if not reports.lost:
                await self._report_end(ok, message, delivered, reports)
        except (_ReportsLost, RuntimeError) as exc:
            log.warning("training job %s: could not report its end: %s", spec.id, exc)
        finally:
            del self._held[spec.id]

    async def _report_end(self, ok: bool, message: str, delivered: "_Delivered | None", reports: "_Reports") -> None:
        """Reports the job's end. A leader that adopted the job after its result went to
        another holds none of it, so it is sent the result again first. Raises _ReportsLost
        (no control plane took the end) or RuntimeError (none took the result)."""
        while True:
            async def finish(reporter: Any) -> None:
                if delivered is not None and reports.generation != delivered.generation:
                    raise _Restart
                await reporter.finished(ok, message)

            try:
                await reports.call(finish)
                return
            except _Restart:
                assert delivered is not None
                log.info("training job %s: sending its result again, to the control plane that adopted it",
                         reports.job_id)
                delivered = await self._send_result(delivered.data, delivered.fmt, reports)

    async def _send_result(self, data: bytes, fmt: str, reports: "_Reports") -> "_Delivered":
        """Sends the result ``data`` in pieces of RESULT_PIECE_BYTES and returns what went to
        which reporter. A new leader that adopts the job meanwhile holds none of the pieces
        sent before, so the pieces start again from the first for it. Raises RuntimeError when
        no control plane takes them."""
        digest = hashlib.sha256(data).hexdigest()
        while True:
            generation = reports.generation
            try:
                for offset in range(0, max(len(data), 1), RESULT_PIECE_BYTES):
                    piece = data[offset:offset + RESULT_PIECE_BYTES]

                    async def send(reporter: Any, offset: int = offset, piece: bytes = piece) -> None:
                        if reports.generation != generation:
                            raise _Restart
                        await reporter.result(offset, piece, len(data), digest, fmt)

                    await reports.call(send)
            except _Restart:
                log.info("training job %s: sending its result again from the start, to the control plane that "
                         "adopted it", reports.job_id)
                continue
            except _ReportsLost as exc:
                raise RuntimeError(f"the result could not be sent: {exc}") from None
            log.info("training job %s: sent its %s result (%d bytes, sha256 %s)", reports.job_id, fmt, len(data),
                     digest[:12])
            return _Delivered(data, fmt, generation)


@attrs.frozen
class _Delivered:
    """A job's result and the reports' generation (:attr:`_Reports.generation`) it all went to."""

    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")
    fmt: str
    generation: int


class _Restart(Exception):
    """The job's reports were rebound while its result was being sent: start the pieces again."""


class _ReportsLost(Exception):
    """No control plane took a job's reports, and none adopted it within REBIND_GRACE_S."""


class _Reports:
    """Where one job's reports go: its reporter, replaced when a new leader adopts the job.
    A call that fails waits up to REBIND_GRACE_S for a new reporter and is made again to it;
    without one the job is cancelled and ``lost`` says why."""

    def __init__(self, job_id: str, reporter: Any, scope: trio.CancelScope) -> None:
        self.job_id, self.reporter, self.scope = job_id, reporter, scope
        self.lost = ""
        #: Counts rebinds: a multi-call exchange (the result's pieces) restarts when it changes.
        self.generation = 0
        self._rebound = trio.Event()

    def rebind(self, reporter: Any) -> None:
        self.reporter = reporter
        self.generation += 1
        self._rebound.set()
        log.info("training job %s: a new control plane takes its reports", self.job_id)

    async def call(self, method: Callable[[Any], Awaitable[Any]]) -> None:
        """Makes ``method(reporter)`` with a deadline; raises _ReportsLost (after cancelling
        the job) when neither the reporter nor one rebound within the grace takes it."""
        while True:
            if self.lost:
                raise _ReportsLost(self.lost)
            reporter = self.reporter
            try:
                with trio.fail_after(REPORT_TIMEOUT_S):
                    await method(reporter)
                return
            except (trio.TooSlowError, capnp.KjException) as exc:
                failure = str(exc) or "no answer in time"
            if self.reporter is reporter:  # not rebound meanwhile: wait for a new leader
                log.warning("training job %s: reports failed (%s); waiting up to %g s for a control plane to "
                            "adopt it", self.job_id, failure, REBIND_GRACE_S)
                self._rebound = trio.Event()
                with trio.move_on_after(REBIND_GRACE_S):
                    await self._rebound.wait()
                if self.reporter is reporter:
                    self.lost = failure
                    self.scope.cancel()
                    raise _ReportsLost(failure)

    async def relay(self, events: trio.MemoryReceiveChannel[str]) -> None:
        """Sends each event in order (see :meth:`call`); ends when the channel closes or the
        reports are lost."""
        async for line in events:
            try:
                await self.call(lambda r, line=line: r.event(line))
            except _ReportsLost:
                return


def _fresh_dir(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)


def make_job_server(runner: JobRunner, job_id: str) -> Any:
    """The ``TrainingJob`` capability of job ``job_id``."""

    class TrainingJobServer(schema.load().TrainingJob.Server):
        async def cancel(self, **_: Any) -> None:
            runner.cancel(job_id)
            await runner.wait_ended(job_id)  # the trainer's process group is gone by then

        async def logs(self, lines: int, _context: Any, **_: Any) -> None:
            _context.results.lines = runner.logs(job_id, int(lines))

    return TrainingJobServer()

