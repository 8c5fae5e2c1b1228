"""Training jobs on a node: one at a time, each in a nursery of its own under the agent (issue 17).

The control plane's scheduler calls ``Agent.startJob`` with the job, its pairs and a
``JobReporter`` capability for that job alone; :class:`JobRunner` starts the job in its own
nursery and hands back a ``TrainingJob`` capability whose ``cancel`` cancels that nursery
(the trainer's process group is killed: nothing is left running). What training does is
given as ``train`` (llmgw/node/training/: fetch the weights, the trainer in the vLLM
environment with the training overlay, GGUF conversion); this module only runs it, relays
its events in order, and sends the result up in checksummed pieces.

A job whose reports cannot be sent (its control plane went away) is cancelled: nobody could
receive its result. The agent's nursery closing cancels every job.
"""

from __future__ import annotations

import collections
import hashlib
import json
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

#: Every report call has this deadline: a control plane that takes longer is gone or stuck,
#: and the job is cancelled rather than left training for nobody.
REPORT_TIMEOUT_S = 30.0
#: Events waiting to be sent, at most; beyond it the oldest unsent progress event is dropped
#: (a trainer reporting faster than the control plane takes them loses steps, never its end).
EVENT_BACKLOG = 256
#: Lines kept for TrainingJob.logs.
LOG_LINES = 2000


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


class JobRunner:
    """Runs training jobs one at a time (see the module docstring). ``workdir``: where each job
    gets a directory (removed when it ends); ``train``: what a job does."""

    def __init__(self, workdir: Path, train: Train) -> None:
        self.workdir = workdir
        self._train = train
        self._nursery: trio.Nursery | None = None
        self._current: str | None = None
        self._scopes: dict[str, trio.CancelScope] = {}
        self._logs: dict[str, collections.deque[str]] = {}
        self._done: dict[str, trio.Event] = {}
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

    @property
    def current(self) -> str | None:
        """The id of the job training now, or None."""
        return self._current

    def start(self, spec: JobSpec, pairs: bytes, reporter: Any) -> None:
        """Starts ``spec`` reporting to ``reporter``; raises JobBusy when a job trains here, and
        RuntimeError when the runner is not running."""
        if self._nursery is None:
            raise RuntimeError("this agent is not taking training jobs (it is stopping)")
        if self._current is not None:
            raise JobBusy(f"job {self._current} trains on this node; one job at a time")
        self._current = spec.id
        scope = trio.CancelScope()
        self._scopes[spec.id] = scope
        self._done[spec.id] = trio.Event()
        self._logs[spec.id] = collections.deque(maxlen=LOG_LINES)
        self._nursery.start_soon(self._job, spec, pairs, reporter, scope)

    def cancel(self, job_id: str) -> None:
        """Cancels job ``job_id``'s nursery (nothing when it has ended)."""
        scope = self._scopes.get(job_id)
        if scope is not None:
            scope.cancel()

    def logs(self, job_id: str, lines: int) -> list[str]:
        kept = list(self._logs.get(job_id, ()))
        return kept[-lines:] if lines else kept

    async def _job(self, spec: JobSpec, pairs: bytes, reporter: Any, scope: trio.CancelScope) -> None:
        directory = self.workdir / spec.id
        relay = _Relay(spec.id, reporter, scope)
        ok, message = False, ""
        try:
            with scope:
                await trio.to_thread.run_sync(_fresh_dir, directory)
                pairs_path = directory / "pairs.jsonl"
                await trio.to_thread.run_sync(pairs_path.write_bytes, pairs)
                send, receive = trio.open_memory_channel[str](EVENT_BACKLOG)
                with unwrap_single_group():
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(relay.run, receive)

                        def on_event(line: str) -> None:
                            self._logs[spec.id].append(line)
                            try:
                                send.send_nowait(line)
                            except trio.WouldBlock:
                                log.warning("training job %s: reports are behind; an event was dropped", spec.id)

                        result, fmt = await self._train(spec, pairs_path, directory / "work", on_event)
                        send.close()  # the relay ends once every event is sent
                await self._send_result(spec.id, result, fmt, reporter)
                ok = True
            if relay.failure:
                ok, message = False, f"its control plane stopped taking reports ({relay.failure}): cancelled"
            elif scope.cancelled_caught:
                message = "cancelled: the trainer was stopped"
        except trio.Cancelled:
            if self._stopping:
                log.warning("training job %s: the agent stops; its trainer is stopped", spec.id)
            raise
        except Exception as exc:  # noqa: BLE001 - the job fails with the reason; the agent goes on
            message = str(exc) or type(exc).__name__
            log.warning("training job %s failed: %s", spec.id, message)
        finally:
            self._current = None
            self._scopes.pop(spec.id, None)
            self._done.pop(spec.id, trio.Event()).set()
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, directory, True)
        log.info("training job %s %s", spec.id, "finished" if ok else f"ended: {message}")
        if relay.failure:
            return  # nobody to tell
        try:
            with trio.fail_after(REPORT_TIMEOUT_S):
                await reporter.finished(ok, message)
        except (trio.TooSlowError, capnp.KjException) as exc:
            log.warning("training job %s: could not report its end: %s", spec.id, exc)

    async def wait_ended(self, job_id: str) -> None:
        """Returns once job ``job_id`` has ended (at once for one not running)."""
        done = self._done.get(job_id)
        if done is not None:
            await done.wait()

    async def _send_result(self, job_id: str, result: Path, fmt: str, reporter: Any) -> None:
        data = await trio.to_thread.run_sync(result.read_bytes)
        digest = hashlib.sha256(data).hexdigest()
        for offset in range(0, max(len(data), 1), RESULT_PIECE_BYTES):
            try:
                with trio.fail_after(REPORT_TIMEOUT_S):
                    await reporter.result(offset, data[offset:offset + RESULT_PIECE_BYTES], len(data), digest, fmt)
            except (trio.TooSlowError, capnp.KjException) as exc:
                raise RuntimeError(f"the result could not be sent: {exc}") from None
        log.info("training job %s: sent its %s result (%d bytes, sha256 %s)", job_id, fmt, len(data), digest[:12])


class _Relay:
    """Sends a job's events in order; a failed send cancels the job (see the module docstring)
    and is kept in ``failure``."""

    def __init__(self, job_id: str, reporter: Any, scope: trio.CancelScope) -> None:
        self.job_id, self.reporter, self.scope = job_id, reporter, scope
        self.failure = ""

    async def run(self, events: trio.MemoryReceiveChannel[str]) -> None:
        async for line in events:
            try:
                with trio.fail_after(REPORT_TIMEOUT_S):
                    await self.reporter.event(line)
            except (trio.TooSlowError, capnp.KjException) as exc:
                log.warning("training job %s: reports failed (%s); cancelling it", self.job_id, exc)
                self.failure = str(exc) or "no answer in time"
                self.scope.cancel()
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


def event_line(event: dict[str, Any]) -> str:
    """Returns an event as one JSON line (what the trainer prints), for events the agent adds."""
    return json.dumps(event, sort_keys=True)
