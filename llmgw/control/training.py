"""The leader's scheduler of LoRA training jobs (issue 17): queued jobs to nodes, reports to the store.

One :class:`JobScheduler` per term, started in the term's nursery. It sends the oldest
queued job to a node whose agent is connected and says it trains (``training`` feature),
that has vLLM installed (training uses the torch of the node's vLLM environment), that
trains nothing else and, for a job asking for card memory, has a card with that much free
(beside an engine if it leaves that much). What the trainer reports comes back through a
``JobReporter`` capability handed per job: progress is kept in memory and written to the
store at most every :data:`PERSIST_INTERVAL_S`, with the job's log (its last :data:`LOG_LINES`
lines, a file of the job's beside its pairs and result); the result arrives in pieces, is
checked against its SHA-256 and kept in the store. A node that goes fails its job with that reason.

A control plane failover does not lose a job: its state is in the store, the node keeps
training (its reports wait for a new leader), and a new leader adopts each job a previous
one left running once the node's agent joins it listing the job (``Agent.adoptJob`` hands
it a new reporter). A job whose node does not come back with it within
:data:`ADOPT_GRACE_S` fails with that reason.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import secrets
from typing import Any, Callable, Mapping, Sequence

import attrs
import capnp
import trio

from llmgw.catalog import model_to_dict, namespace_conflict, validate_model
from llmgw.catalog.sources import job_source
from llmgw.control.registry import NodeState, NodeView, Registry
from llmgw.control.sessions import NodeSessions
from llmgw.control.store import Store
from llmgw.control.store.training import LOG, PAIRS, RESULT
from llmgw.nodeprotocol import TRAINING
from llmgw.rpc import convert, schema
from llmgw.rpc.errors import remote_reason
from llmgw.spec import Adapter, ModelSpec, gpu_display
from llmgw.training import (
    CANCELLED, FAILED, GGUF, PEFT, QUEUED, RESULT_PIECE_BYTES, RUNNING, SUCCEEDED, TrainingJob, check_job_id,
)

log = logging.getLogger(__name__)

#: Queued jobs are looked at again this often even when nothing woke the scheduler (a card's
#: free memory changes with every heartbeat, and nothing announces that).
SCHEDULE_INTERVAL_S = 5.0
#: Progress is written to the store at most this often per job (a trainer may report every
#: step, many a second); the last report before a job ends is always written.
PERSIST_INTERVAL_S = 2.0
#: An agent answers startJob once the job's nursery runs (the trainer starts in it): a
#: connected agent does so in well under a second; one that does not in this long is stuck.
START_TIMEOUT_S = 30.0
#: cancel returns once the trainer's process group is gone (SIGTERM, then SIGKILL after the
#: agent's own grace): this is that grace and then some.
CANCEL_TIMEOUT_S = 30.0
#: Trainer events kept per job for `ctl jobs logs` (the newest; a job reports a few per step),
#: and the jobs whose events are kept (the newest; older jobs show their state and message).
LOG_LINES = 2000
LOG_JOBS = 100
#: The largest result the control plane takes: a rank-256 adapter of a 70B model is a few GB;
#: held in memory while it arrives and then written to the store.
MAX_RESULT_BYTES = 4 * 1024**3
#: How long a new leader waits for the node of a job an earlier leader left running to join
#: and list it (the agent waits longer for it: llmgw.node.jobs.REBIND_GRACE_S).
ADOPT_GRACE_S = 90.0
#: The engine whose Python environment (its torch) trains.
TRAINING_ENGINE = "vllm"


def new_job_id() -> str:
    """Returns a fresh job id: "job-" and 8 hex digits."""
    return f"job-{secrets.token_hex(4)}"


def with_job_adapter(model: ModelSpec, name: str, job_id: str, catalog: Sequence[ModelSpec]) -> ModelSpec:
    """Returns ``model`` with adapter ``name`` (source ``llmgw-job://JOB``) added, checked as the
    catalog checks every entry: a valid name, not the model's, and free among ``catalog``'s models
    and adapters (they share the namespace requests use). Raises ValueError saying why not."""
    spec = validate_model(model_to_dict(attrs.evolve(
        model, adapters=(*model.adapters, Adapter(name, job_source(job_id))))))
    conflict = namespace_conflict(spec, catalog)
    if conflict:
        raise ValueError(conflict)
    return spec


@attrs.define
class _Running:
    """A job sent to a node: its capability there, its latest state, its arriving result."""

    job: TrainingJob
    node: str
    cap: Any = None
    dirty: bool = False
    persisted_at: float = -math.inf
    result: bytearray = attrs.field(factory=bytearray)
    result_total: int = 0
    result_sha256: str = ""
    result_format: str = ""


class JobScheduler:
    """See the module docstring. ``catalog_changed()`` is called after a job registered its
    adapter in the catalog (``--register``)."""

    def __init__(self, store: Store, registry: Registry, sessions: NodeSessions,
                 catalog_changed: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self.registry = registry
        self.sessions = sessions
        self._catalog_changed = catalog_changed
        self._running: dict[str, _Running] = {}
        self._logs: dict[str, collections.deque[str]] = {}
        self._waiting: dict[str, str] = {}  # queued job -> why it waits
        self._wake = trio.Event()
        self._result_cache: tuple[str, bytes] | None = None
        self._orphans: dict[str, tuple[TrainingJob, float]] = {}  # left running by an earlier leader

    # -- what admin calls ------------------------------------------------------------

    def wake(self) -> None:
        """Look at the queue now (a job was added, a node joined)."""
        self._wake.set()

    def live(self, job: TrainingJob) -> TrainingJob:
        """Returns ``job`` with what the scheduler knows beyond the store (progress not yet
        written, why it waits)."""
        running = self._running.get(job.id)
        if running is not None:
            return running.job
        if job.state == QUEUED and job.id in self._waiting:
            return attrs.evolve(job, message=self._waiting[job.id])
        return job

    def running(self) -> list[TrainingJob]:
        """The jobs training now, with their latest progress (for /metrics)."""
        return [r.job for r in self._running.values()]

    async def logs(self, job_id: str, lines: int) -> list[str]:
        """The last ``lines`` (0: all kept) lines of the job's log: what its trainer reported and
        what became of it; from the store for a job this control plane has not seen (it ended
        before a restart, or ran under an earlier leader)."""
        kept = self._logs.get(job_id)
        if kept is None:
            kept = collections.deque(await self._stored_log(job_id), maxlen=LOG_LINES)
        return list(kept)[-lines:] if lines else list(kept)

    async def _stored_log(self, job_id: str) -> list[str]:
        text = (await self.store.read_training_file(job_id, LOG)).decode("utf-8", errors="replace")
        return text.splitlines()

    async def _write_log(self, job_id: str) -> None:
        """Stores the job's log as this control plane holds it (its last LOG_LINES lines)."""
        kept = self._logs.get(job_id)
        if kept is not None:
            await self.store.put_training_file(job_id, LOG, "\n".join(kept).encode())

    async def cancel(self, job: TrainingJob, actor: str) -> TrainingJob:
        """Cancels ``job``: a queued one at once, a running one once its node killed the trainer
        (or could not be asked: then it is cancelled here and the node stops it when its reports
        fail). Returns the job as stored."""
        message = f"cancelled by {actor}"
        self._orphans.pop(job.id, None)  # its node, if it comes back, finds its reports refused and stops it
        running = self._running.pop(job.id, None)
        if running is not None:
            job = running.job
            if running.cap is not None:
                try:
                    with trio.fail_after(CANCEL_TIMEOUT_S):
                        await running.cap.cancel()
                except (trio.TooSlowError, Exception) as exc:  # noqa: BLE001 - the node went, or is stuck
                    message += f" (node {running.node} did not confirm: {_reason(exc)})"
        self._note(job.id, message)
        stored = await self.store.update_training_job(attrs.evolve(job, state=CANCELLED, message=message))
        await self._write_log(job.id)
        return stored

    async def result_piece(self, job_id: str, offset: int, length: int = RESULT_PIECE_BYTES
                           ) -> tuple[bytes, int, str, str]:
        """Returns (bytes from ``offset``, total, sha256, format) of finished job ``job_id``'s
        result, for a node fetching an adapter ``llmgw-job://JOB`` and for `ctl jobs download`.
        The last result read is kept in memory, so reading one in pieces reads the store once.
        Raises ValueError for a job without a result."""
        job = await self.store.get_training_job(check_job_id(job_id))
        if job.state != SUCCEEDED or not job.result_bytes:
            raise ValueError(f"training job {job.id} has no result ({job.state}: {job.message})")
        cached = self._result_cache
        if cached is None or cached[0] != job.id:
            cached = self._result_cache = (job.id, await self.store.read_training_file(job.id, RESULT))
        data = cached[1]
        start = min(max(0, offset), len(data))
        return data[start:start + max(1, length)], len(data), job.result_sha256, job.result_format

    # -- the loop ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Takes the jobs an earlier leader left running as orphans to adopt, then schedules
        until cancelled."""
        deadline = trio.current_time() + ADOPT_GRACE_S
        for job in await self.store.list_training_jobs():
            if job.state == RUNNING:
                self._orphans[job.id] = (job, deadline)
                self._logs[job.id] = collections.deque(await self._stored_log(job.id), maxlen=LOG_LINES)
                self._note(job.id, f"waiting for {job.assigned_node} to report it to this control plane")
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_registry)
            while True:
                self._wake = trio.Event()
                await self._adopt_orphans()
                await self._fail_departed()
                await self._persist()
                await self._place_queued()
                with trio.move_on_after(SCHEDULE_INTERVAL_S):
                    await self._wake.wait()

    async def _watch_registry(self) -> None:
        version = self.registry.version
        while True:
            version = await self.registry.wait_changed(version)
            self._wake.set()

    async def _adopt_orphans(self) -> None:
        """Adopts each orphan whose node joined listing it; fails those whose node joined
        without it or did not join within ADOPT_GRACE_S."""
        now = trio.current_time()
        for job_id, (job, deadline) in list(self._orphans.items()):
            try:
                session = self.sessions.get(job.assigned_node)
            except LookupError:
                session = None
            if session is not None and job_id in session.jobs:
                del self._orphans[job_id]
                running = self._running[job_id] = _Running(job, job.assigned_node)
                try:
                    with trio.fail_after(START_TIMEOUT_S):
                        running.cap = (await session.agent.adoptJob(job_id, self._reporter(job_id))).job
                except Exception as exc:  # noqa: BLE001 - the job says why
                    await self._end(job_id, FAILED, f"{job.assigned_node} could not hand it over after the control "
                                                    f"plane changed: {_reason(exc)}")
                    continue
                self._note(job_id, f"adopted from {job.assigned_node} after the control plane changed")
                log.info("training job %s on %s adopted after the control plane changed", job_id, job.assigned_node)
            elif session is not None or now >= deadline:
                del self._orphans[job_id]
                why = ("joined without it" if session is not None
                       else f"did not report it within {ADOPT_GRACE_S:g} s")
                message = f"the control plane changed while it trained and {job.assigned_node} {why}"
                self._note(job_id, message)
                await self.store.update_training_job(attrs.evolve(job, state=FAILED, message=message))
                await self._write_log(job_id)

    async def _fail_departed(self) -> None:
        """Fails each running job whose node is no longer ONLINE."""
        nodes = self.registry.snapshot().nodes
        for job_id, running in list(self._running.items()):
            node = nodes.get(running.node)
            if node is not None and node.state is NodeState.ONLINE:
                continue
            gone = "was removed" if node is None else f"went away ({node.state.value})"
            await self._end(job_id, FAILED, f"node {running.node} {gone} while the job trained")

    async def _persist(self) -> None:
        now = trio.current_time()
        for running in list(self._running.values()):
            if running.dirty and now - running.persisted_at >= PERSIST_INTERVAL_S:
                running.dirty, running.persisted_at = False, now
                stored = await self.store.update_training_job(running.job)
                if stored.final:  # cancelled meanwhile (by another admin call)
                    self._running.pop(stored.id, None)
                else:
                    await self._write_log(stored.id)

    async def _place_queued(self) -> None:
        busy = {r.node for r in self._running.values()} | {job.assigned_node for job, _ in self._orphans.values()}
        nodes = self.registry.snapshot().nodes
        waiting: dict[str, str] = {}
        for job in await self.store.list_training_jobs(state=QUEUED):
            choice = self._choose(job, nodes, busy)
            if isinstance(choice, str):
                waiting[job.id] = choice
                continue
            node_id, gpu, uuid = choice
            busy.add(node_id)
            await self._send(job, node_id, gpu, uuid)
        self._waiting = waiting

    def _choose(self, job: TrainingJob, nodes: Mapping[str, NodeView], busy: set[str]) -> tuple[str, int, str] | str:
        """Returns (node, gpu placement index or -1, gpu uuid) for ``job`` among ``nodes``, or why
        none fits."""
        reasons = []
        if job.node and job.node not in nodes:
            return f"waiting: node {job.node} has not joined"
        candidates = [nodes[job.node]] if job.node else list(nodes.values())
        for node in sorted(candidates, key=lambda n: n.id):
            why = self._unfit(node, busy)
            if why:
                reasons.append(f"{node.id} {why}")
                continue
            if not job.gpu_mib:
                return node.id, -1, ""
            cards = [g for g in node.hardware.gpus if g.memory_free_mb >= job.gpu_mib]
            if not cards:
                free = ", ".join(f"{gpu_display(g.index)}: {g.memory_free_mb} MiB" for g in node.hardware.gpus)
                reasons.append(f"{node.id} has no card with {job.gpu_mib} MiB free ({free or 'no GPUs'})")
                continue
            card = max(cards, key=lambda g: (g.memory_free_mb, -g.index))
            return node.id, card.index, card.uuid
        return "waiting: " + ("; ".join(reasons) if reasons else "no node has joined")

    def _unfit(self, node: NodeView, busy: set[str]) -> str:
        if node.state is not NodeState.ONLINE:
            return f"is {node.state.value}"
        if node.id in busy:
            return "trains another job"
        try:
            session = self.sessions.get(node.id)
        except LookupError:
            return "has no session"
        if TRAINING not in session.features:
            return "runs an agent too old to train (upgrade it: `llmgw ctl upgrade`)"
        engine = node.engine(TRAINING_ENGINE)
        if engine is None or not engine.installed:
            return f"has no {TRAINING_ENGINE} environment to train with (its torch trains)"
        return ""

    async def _send(self, job: TrainingJob, node_id: str, gpu: int, uuid: str) -> None:
        model = await self.store.get_model(job.model)
        running = _Running(attrs.evolve(job, state=RUNNING, assigned_node=node_id, gpu=gpu,
                                        message=f"sent to {node_id}" + (f" GPU {gpu_display(gpu)}" if gpu >= 0 else
                                                                        " (CPU)")), node_id)
        self._running[job.id] = running
        await self.store.update_training_job(running.job)
        self._note(job.id, running.job.message)
        await self._write_log(job.id)
        spec = {"id": job.id, "model": job.model, "weights": job.weights,
                "params": convert.training_params_dict(job.params), "gpu": gpu, "gpuUuid": uuid,
                "gguf": model is not None and model.engine == "llama.cpp"}
        try:
            pairs = await self.store.read_training_file(job.id, PAIRS)
            session = self.sessions.get(node_id)
            with trio.fail_after(START_TIMEOUT_S):
                result = await session.agent.startJob(spec, pairs, self._reporter(job.id))
            running.cap = result.job
        except Exception as exc:  # noqa: BLE001 - the node refused or went: the job says why
            await self._end(job.id, FAILED, f"{node_id} could not start it: {_reason(exc)}")
            return
        log.info("training job %s (%s for %s) runs on %s", job.id, job.adapter, job.model, node_id)

    # -- what the node reports ---------------------------------------------------------

    def _reporter(self, job_id: str) -> Any:
        scheduler = self

        class JobReporterServer(schema.load().JobReporter.Server):
            async def event(self, json: str, **_: Any) -> None:
                scheduler._on_event(job_id, str(json))

            async def result(self, offset: int, chunk: bytes, total: int, sha256: str, format: str, **_: Any) -> None:
                scheduler._on_result(job_id, int(offset), bytes(chunk), int(total), str(sha256), str(format))

            async def finished(self, ok: bool, message: str, **_: Any) -> None:
                await scheduler._on_finished(job_id, bool(ok), str(message))

        return JobReporterServer()

    def _on_event(self, job_id: str, text: str) -> None:
        running = self._running.get(job_id)
        if running is None:
            raise RuntimeError(f"training job {job_id} is no longer running here")
        self._note(job_id, text)
        try:
            event = json.loads(text)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        job = running.job
        changes: dict[str, Any] = {}
        for name, field in (("step", "step"), ("steps", "steps"), ("peak_memory_bytes", "peak_memory_bytes")):
            if isinstance(event.get(name), int):
                changes[field] = event[name]
        if isinstance(event.get("device"), str):
            changes["device"] = event["device"]
        loss = event.get("loss")
        if isinstance(loss, (int, float)):
            changes["loss"] = float(loss)
            if math.isnan(job.first_loss):
                changes["first_loss"] = float(loss)
        if event.get("event") == "error" and isinstance(event.get("message"), str):
            changes["message"] = event["message"]
        elif event.get("event") == "progress":
            changes["message"] = f"training on {running.node}"
        if changes:
            running.job = attrs.evolve(job, **changes)
            running.dirty = True

    def _on_result(self, job_id: str, offset: int, chunk: bytes, total: int, sha256: str, fmt: str) -> None:
        running = self._running.get(job_id)
        if running is None:
            raise RuntimeError(f"training job {job_id} is no longer running here")
        if total > MAX_RESULT_BYTES:
            raise ValueError(f"the result is {total} bytes; this control plane keeps at most {MAX_RESULT_BYTES}")
        if fmt not in (PEFT, GGUF):
            raise ValueError(f"unknown result format {fmt!r}")
        if offset == 0:
            running.result = bytearray()
        if offset != len(running.result):
            raise ValueError(f"piece at {offset} does not follow the {len(running.result)} bytes received")
        running.result += chunk
        running.result_total, running.result_sha256, running.result_format = total, sha256, fmt

    async def _on_finished(self, job_id: str, ok: bool, message: str) -> None:
        running = self._running.get(job_id)
        if running is None:
            return
        if not ok:
            await self._end(job_id, CANCELLED if message.startswith("cancelled") else FAILED, message)
            return
        data = bytes(running.result)
        if len(data) != running.result_total or hashlib.sha256(data).hexdigest() != running.result_sha256:
            await self._end(job_id, FAILED, f"the result arrived damaged ({len(data)} of {running.result_total} "
                                            "bytes, or its SHA-256 did not match)")
            return
        digest = await self.store.put_training_file(job_id, RESULT, data)
        job = running.job
        loss = "" if math.isnan(job.loss) else f", loss {job.first_loss:.4g} -> {job.loss:.4g}"
        message = message or f"trained on {running.node}{loss}"
        await self._end(job_id, SUCCEEDED, message, result_bytes=len(data), result_sha256=digest,
                        result_format=running.result_format)
        if job.register:
            registered = await self._register(job)
            stored = await self.store.get_training_job(job_id)
            await self.store.update_training_job(attrs.evolve(stored, message=f"{message}; {registered}"),
                                                 unless_final=False)

    async def _register(self, job: TrainingJob) -> str:
        """Adds ``job``'s result to its model as adapter ``job.adapter`` (source llmgw-job://ID);
        returns what happened, in words (why not, when it could not)."""
        catalog = await self.store.list_models()
        model = next((m for m in catalog if m.name == job.model), None)
        if model is None:
            return f"not registered: {job.model} is no longer in the catalog"
        try:
            await self.store.put_model(with_job_adapter(model, job.adapter, job.id, catalog), create_only=False)
        except Exception as exc:  # noqa: BLE001 - the job succeeded; its registration says why not
            return (f"not registered ({exc}); `llmgw ctl models adapters add {job.model} NAME --from-job {job.id}` "
                    "registers it under another name")
        await self.store.audit(job.created_by, "model.replace", job.model, {"adapter": job.adapter, "job": job.id})
        self._catalog_changed()
        log.info("training job %s: adapter %s added to %s", job.id, job.adapter, job.model)
        return f"registered as adapter {job.adapter} of {job.model}"

    async def _end(self, job_id: str, state: str, message: str, **result: Any) -> None:
        running = self._running.pop(job_id, None)
        if running is None:
            return
        self._note(job_id, f"{state}: {message}")
        log.info("training job %s %s: %s", job_id, state, message)
        await self.store.update_training_job(attrs.evolve(running.job, state=state, message=message, **result))
        await self._write_log(job_id)
        self._wake.set()

    def _note(self, job_id: str, line: str) -> None:
        running = self._running.get(job_id)
        if running is not None:
            running.dirty = True  # the log is written with the progress
        if job_id not in self._logs:
            self._logs[job_id] = collections.deque(maxlen=LOG_LINES)
            for old in list(self._logs)[:-LOG_JOBS]:
                del self._logs[old]
        self._logs[job_id].append(line)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "no answer in time"
    if isinstance(exc, capnp.KjException):
        return remote_reason(exc)
    return str(exc) or type(exc).__name__
