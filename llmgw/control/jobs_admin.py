"""The Admin methods for LoRA training jobs (``llmgw ctl jobs``), a mixin.

:func:`llmgw.control.admin.make_admin` calls :meth:`JobsAdminMixin.bind_jobs`. Jobs are
checked before anything is stored (the catalog model, a free adapter name, the pairs with
their bad lines named) and audited; the leader's :class:`~llmgw.control.training.JobScheduler`
sends them to nodes.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import attrs

from llmgw.catalog.sources import SourceError, parse_source
from llmgw.control.store import Store
from llmgw.control.store.training import NoSuchJob
from llmgw.control.training import JobScheduler, new_job_id, with_job_adapter
from llmgw.rpc import convert
from llmgw.spec import ModelSpec
from llmgw.training import GGUF, PEFT, QUEUED, SUCCEEDED, TrainingJob, check_job_id, check_pairs

log = logging.getLogger(__name__)

#: The most a download call returns at once (one RPC message).
MAX_DOWNLOAD_PIECE = 4 * 1024 * 1024


async def check_job_adapters(store: Store, model: ModelSpec) -> None:
    """Raises ValueError unless every adapter of ``model`` whose source is a training job's result
    (``llmgw-job://JOB``) names a job that succeeded for this model, in the form its engine loads
    (GGUF for llama.cpp, a PEFT directory for vLLM)."""
    for adapter in model.adapters:
        try:
            parsed = parse_source(adapter.source)
        except SourceError:
            continue  # validate_model has said so already
        if parsed.kind != "job":
            continue
        try:
            job = await store.get_training_job(parsed.location)
        except NoSuchJob:
            raise ValueError(f"adapter {adapter.name}: no training job {parsed.location!r} "
                             "(see `llmgw ctl jobs list`)") from None
        if job.state != SUCCEEDED:
            raise ValueError(f"adapter {adapter.name}: training job {job.id} is {job.state} ({job.message}); "
                             "only a job that succeeded gives an adapter")
        if job.model != model.name:
            raise ValueError(f"adapter {adapter.name}: training job {job.id} trained an adapter for {job.model}, "
                             f"not {model.name}")
        wanted = GGUF if model.engine == "llama.cpp" else PEFT
        if model.engine != "sim" and job.result_format != wanted:
            raise ValueError(f"adapter {adapter.name}: job {job.id} gave a {job.result_format} adapter, but "
                             f"{model.engine} loads {wanted}: train it again for this model")


class JobsAdminMixin:
    """trainJob, listJobs, cancelJob, jobLogs, downloadJob (see schema/llmgw.capnp)."""

    _jobs_store: Store
    _jobs_actor: str
    _jobs_scheduler: Callable[[], JobScheduler]

    def bind_jobs(self, store: Store, actor: str, scheduler: Callable[[], JobScheduler]) -> None:
        """Act on ``store`` for ``actor``; ``scheduler()`` is the leader's job scheduler."""
        self._jobs_store = store
        self._jobs_actor = actor
        self._jobs_scheduler = scheduler

    async def trainJob(self, adapter: str, model: str, weights: str, node: str, gpuMib: int, params: Any, pairs: bytes,
                       register: bool, _context: Any, **_: Any) -> None:
        adapter, model_name, weights, node = str(adapter), str(model), str(weights), str(node)
        store = self._jobs_store
        catalog = await store.list_models()
        found = next((m for m in catalog if m.name == model_name), None)
        if found is None:
            raise ValueError(f"no model {model_name!r} in the catalog (see `llmgw ctl models list`)")
        job_id = new_job_id()
        try:  # the adapter's name, checked now as it will be when the result is registered
            with_job_adapter(found, adapter, job_id, catalog)
        except ValueError as exc:
            raise ValueError(f"--name {adapter!r}: {exc}") from None
        weights = weights or found.source
        if weights.lower().endswith(".gguf"):
            raise ValueError(f"{model_name} is served from a GGUF file ({weights}); training needs the model's "
                             "safetensors weights: give them with --weights (a directory, URL or hf://org/repo)")
        training = convert.training_params_from(params)
        problem = training.problem()
        if problem:
            raise ValueError(problem)
        count = check_pairs(bytes(pairs))
        job = TrainingJob(job_id, adapter, model_name, weights, node, int(gpuMib), training, QUEUED,
                          "queued", pairs=count, created_by=self._jobs_actor, register=bool(register))
        job = await store.create_training_job(job, bytes(pairs))
        await store.audit(self._jobs_actor, "job.train", job.id, {"adapter": adapter, "model": model_name,
                                                                   "node": node, "gpu_mib": job.gpu_mib,
                                                                   "pairs": count, "register": job.register,
                                                                   **attrs.asdict(training)})
        log.info("%s queued training job %s: %s for %s (%d pairs)", self._jobs_actor, job.id, adapter, model_name,
                 count)
        self._jobs_scheduler().wake()
        _context.results.job = convert.training_job_dict(job)

    async def listJobs(self, _context: Any, **_: Any) -> None:
        scheduler = self._jobs_scheduler()
        _context.results.jobs = [convert.training_job_dict(scheduler.live(j))
                                 for j in await self._jobs_store.list_training_jobs()]

    async def cancelJob(self, id: str, _context: Any, **_: Any) -> None:  # noqa: A002 - the schema's name
        job = await self._jobs_store.get_training_job(check_job_id(str(id)))
        if job.final:
            raise ValueError(f"training job {job.id} has ended already ({job.state})")
        cancelled = await self._jobs_scheduler().cancel(job, self._jobs_actor)
        await self._jobs_store.audit(self._jobs_actor, "job.cancel", job.id, {})
        _context.results.job = convert.training_job_dict(cancelled)

    async def jobLogs(self, id: str, lines: int, _context: Any, **_: Any) -> None:  # noqa: A002
        job = await self._jobs_store.get_training_job(check_job_id(str(id)))
        kept = await self._jobs_scheduler().logs(job.id, int(lines))
        _context.results.lines = kept or [f"{job.state}: {job.message}"]

    async def downloadJob(self, id: str, offset: int, length: int, _context: Any, **_: Any) -> None:  # noqa: A002
        size = min(int(length) or MAX_DOWNLOAD_PIECE, MAX_DOWNLOAD_PIECE)
        chunk, total, sha256, fmt = await self._jobs_scheduler().result_piece(str(id), int(offset), size)
        _context.results.chunk, _context.results.total = chunk, total
        _context.results.sha256, _context.results.format = sha256, fmt
