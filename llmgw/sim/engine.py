"""The simulated engine's state: admission, prefill against the prefix cache, deterministic output, LoRA, counters.

No HTTP here (see :mod:`llmgw.sim.api`). Timing is simulated with ``trio.sleep``:
time to first token is ``prefill_us_per_token`` times the prompt tokens the
cache did not hold; each generated token costs ``decode_us_per_token``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import math
import os
import random
import struct
import time
from typing import AsyncIterator, Sequence

import attrs
import trio

from llmgw.sim import tokenizer
from llmgw.sim.cache import LoraRef, PrefixCache
from llmgw.sim.config import SimConfig
from llmgw.sim.echo import echo
from llmgw.sim.prompts import PromptTokenizer
from llmgw.sim.publisher import KvEventPublisher

#: Shortest and longest "natural" answer (before max_tokens); the length is derived from the prompt.
NATURAL_MIN_TOKENS = 24
NATURAL_SPREAD_TOKENS = 64

#: vLLM's time-to-first-token histogram buckets, in seconds.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


class EngineError(Exception):
    """A request the engine refuses; carries the HTTP status and OpenAI error type."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param


@attrs.frozen
class Output:
    """The planned output of one request: tokens, their text pieces, and why it ends."""

    token_ids: tuple[int, ...]
    pieces: tuple[str, ...]
    finish_reason: str  # "stop" or "length"
    stop_reason: str | None = None  # the stop string that ended it, if any

    @property
    def text(self) -> str:
        """Return the whole generated text."""
        return "".join(self.pieces)


@attrs.define
class Run:
    """One admitted request, between prefill and completion (see :meth:`Engine.run`)."""

    engine: "Engine"
    prompt: Sequence[int]
    lora: LoraRef | None
    cache_salt: str | None
    cached_tokens: int = 0
    prompt_hashes: tuple[bytes, ...] = ()
    output: Output | None = None

    async def decode_step(self) -> None:
        """Spend one generated token's simulated time."""
        if self.engine.decode_s_per_token > 0:
            await trio.sleep(self.engine.decode_s_per_token)

    def completed(self, output: Output) -> None:
        """Record that ``output`` was fully produced (its full blocks get cached on exit)."""
        self.output = output


def _digest_seed(*parts: bytes) -> int:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return int.from_bytes(h.digest()[:8], "big")


def plan_output(prompt: Sequence[int], max_tokens: int, *, adapter: str | None = None, stop: Sequence[str] = ()) -> Output:
    """Return the deterministic output for ``prompt`` (and ``adapter``): at most ``max_tokens`` tokens.

    The answer's natural length and words are derived from a hash of the prompt
    ids and the adapter name. Ends with ``"stop"`` at its natural length or at
    the first ``stop`` string (which is not included), else ``"length"``.
    """
    seed = _digest_seed((adapter or "").encode(), struct.pack(f">{len(prompt)}I", *prompt))
    rng = random.Random(seed)
    natural = NATURAL_MIN_TOKENS + seed % NATURAL_SPREAD_TOKENS
    n = min(max_tokens, natural)
    finish = "stop" if natural <= max_tokens else "length"
    nwords = len(tokenizer.GENERATED_PIECES)
    idx = [rng.randrange(nwords) for _ in range(n)]
    ids = [tokenizer.GENERATED_IDS[i] for i in idx]
    pieces = [tokenizer.GENERATED_PIECES[i] for i in idx]
    if stop:
        text = ""
        for k, piece in enumerate(pieces):
            text += piece
            hits = [(text.find(s), s) for s in stop if s and s in text]
            if hits:
                pos, s = min(hits)
                keep = text[:pos]
                prefix_len = len(text) - len(piece)
                pieces = pieces[:k] + ([keep[prefix_len:]] if len(keep) > prefix_len else [])
                ids = ids[: len(pieces)]
                return Output(tuple(ids), tuple(pieces), "stop", s)
    return Output(tuple(ids), tuple(pieces), finish)


def embedding(token_ids: Sequence[int], dim: int) -> list[float]:
    """Return a deterministic unit vector of ``dim`` floats for ``token_ids``."""
    rng = random.Random(_digest_seed(b"embed", struct.pack(f">{len(token_ids)}I", *token_ids)))
    v = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


class Engine:
    """State of one simulated engine. Not thread-safe: used from the trio thread only."""

    def __init__(self, cfg: SimConfig, publisher: KvEventPublisher) -> None:
        self.cfg = cfg
        self.publisher = publisher
        self.cache = PrefixCache(cfg.block_size, cfg.num_blocks, seed=cfg.hash_seed, emit=publisher.emit)
        self.prompts = PromptTokenizer(cfg.tokenizer, cfg.served_tokenizer)
        self.prefill_s_per_token = cfg.prefill_us_per_token / 1e6
        self.decode_s_per_token = cfg.decode_us_per_token / 1e6
        self.started_at = int(time.time())
        self.loras: dict[str, LoraRef] = {}
        self._next_lora_id = 1
        self._slots = trio.Semaphore(cfg.max_num_seqs)
        # Prefill compute: a FIFO queue when limited (trio's semaphore wakes waiters in order).
        self._prefill = trio.Semaphore(cfg.prefill_concurrency) if cfg.prefill_concurrency > 0 else None
        self.running = 0
        self.waiting = 0
        self.running_blocks = 0
        self.running_loras: collections.Counter[str] = collections.Counter()
        self.waiting_loras: collections.Counter[str] = collections.Counter()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.requests_total = 0
        self.fail_event = trio.Event()  # set when --fail-after is reached
        for name, path in cfg.loras:
            self._add_lora(name, path)

    # ---- models and LoRA -------------------------------------------------------------

    def resolve_model(self, name: object) -> LoraRef | None:
        """Return the adapter ``name`` refers to, or None for the base model (also when ``name`` is absent).

        Raises EngineError(404) for any other name.
        """
        if name is None or name == self.cfg.model:
            return None
        if isinstance(name, str) and name in self.loras:
            return self.loras[name]
        raise EngineError(404, f"The model `{echo(name)}` does not exist.", "NotFoundError", "model")

    def _add_lora(self, name: str, path: str) -> LoraRef:
        ref = LoraRef(name=name, path=path, int_id=self._next_lora_id)
        self._next_lora_id += 1
        self.loras[name] = ref
        return ref

    def load_lora(self, name: object, path: object) -> str:
        """Load adapter ``name`` from ``path``; return vLLM's success text. Raises EngineError as vLLM answers."""
        if not self.cfg.enable_lora:
            raise EngineError(400, "LoRA is not enabled: start the engine with --enable-lora.", "InvalidUserInput")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise EngineError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == self.cfg.model:
            raise EngineError(400, f"The lora adapter '{name}' has the same name as the base model; choose another name.", "InvalidUserInput")
        if name in self.loras:
            raise EngineError(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
        if self.cfg.lora_path_must_exist and not os.path.exists(path):
            raise EngineError(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        self._add_lora(name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora(self, name: object) -> str:
        """Unload adapter ``name``; return vLLM's success text. Raises EngineError(404) if unknown."""
        if not self.cfg.enable_lora:
            raise EngineError(400, "LoRA is not enabled: start the engine with --enable-lora.", "InvalidUserInput")
        if not isinstance(name, str) or not name:
            raise EngineError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in self.loras:
            raise EngineError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loras[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    # ---- requests ----------------------------------------------------------------------

    def max_tokens_for(self, prompt_len: int, requested: object) -> int:
        """Return the max_tokens to use; raises EngineError(400) when invalid or past max_model_len."""
        limit = self.cfg.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise EngineError(400, f"This model's maximum context length is {limit} tokens. However, your request has {prompt_len} input tokens. Please reduce the length of the input messages.", param="messages")
            return min(self.cfg.max_tokens_default, limit - prompt_len)
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise EngineError(400, f"max_tokens must be an integer of at least 1, got {echo(repr(requested))}.", param="max_tokens")
        if prompt_len + requested > limit:
            raise EngineError(400, f"This model's maximum context length is {limit} tokens. However, you requested {prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the completion). Please reduce the length of the messages or completion.", param="max_tokens")
        return requested

    @contextlib.asynccontextmanager
    async def run(self, prompt: Sequence[int], *, lora: LoraRef | None, cache_salt: str | None) -> AsyncIterator[Run]:
        """Admit a request, prefill it, and yield its :class:`Run` once the first token is due.

        Waits for a slot when ``max_num_seqs`` are running (counted as waiting).
        On exit, caches the full blocks of prompt + output if the run was
        completed, and counts the request. Cancellation (client gone) releases
        the slot and caches nothing more.
        """
        t0 = time.perf_counter()
        name = lora.name if lora else None
        self.waiting += 1
        if name:
            self.waiting_loras[name] += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
            if name:
                self.waiting_loras[name] -= 1
                if not self.waiting_loras[name]:
                    del self.waiting_loras[name]
        blocks = -(-len(prompt) // self.cfg.block_size)
        self.running += 1
        self.running_blocks += blocks
        if name:
            self.running_loras[name] += 1
        run = Run(self, prompt, lora, cache_salt)
        try:
            async with self._prefill if self._prefill is not None else contextlib.nullcontext():
                # The cache is looked up when this prefill's turn comes (as a scheduler does),
                # so a request queued behind one with the same prefix finds it cached.
                pre = self.cache.prefill(prompt, lora=lora, cache_salt=cache_salt)
                run.cached_tokens = pre.cached_tokens
                run.prompt_hashes = pre.hashes
                uncached = len(prompt) - pre.cached_tokens
                if uncached and self.prefill_s_per_token > 0:
                    await trio.sleep(uncached * self.prefill_s_per_token)
                else:
                    await trio.lowlevel.checkpoint()
            self._observe_ttft(time.perf_counter() - t0)
            self.prompt_tokens += len(prompt)
            yield run
            if run.output is not None:
                self.cache.store_decoded([*prompt, *run.output.token_ids], run.prompt_hashes, lora=lora, cache_salt=cache_salt)
                self.generation_tokens += len(run.output.token_ids)
                self.finished[run.output.finish_reason] += 1
        finally:
            self.running -= 1
            self.running_blocks -= blocks
            if name:
                self.running_loras[name] -= 1
                if not self.running_loras[name]:
                    del self.running_loras[name]
            self._slots.release()
            self.count_request()

    def count_request(self) -> None:
        """Count one served request; sets :attr:`fail_event` when ``--fail-after`` is reached."""
        self.requests_total += 1
        if self.cfg.fail_after is not None and self.requests_total >= self.cfg.fail_after:
            self.fail_event.set()

    def _observe_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        for i, bound in enumerate(TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_counts[i] += 1
                return
        self.ttft_counts[-1] += 1

    def kv_usage(self) -> float:
        """Return the fraction of KV blocks held by running requests (vLLM's kv_cache_usage_perc)."""
        return min(1.0, self.running_blocks / self.cfg.num_blocks)
