"""A request's KV block hashes, computed as vLLM computes them, from the replica's own tokenizer.

Tokens come, in order of preference:

- from the request itself (a completions prompt given as token ids);
- from the model's own tokenizer loaded in the gateway (llmgw/hftokenizer.py), where
  the replica's engine hands out its tokenizer files (llmgw/router/tokenizer_shelf.py, which
  also checks a sample of requests against the engine and falls back on a mismatch); a
  conversation's next turn tokenizes and hashes only its new segments
  (llmgw/router/turnhash.py);
- from the replica's ``POST /tokenize`` (vLLM and ``llmgw.sim`` serve it): for chat
  ``{"model", "messages", "add_generation_prompt": true, ...}`` with the chat template
  applied; for completions ``{"model", "prompt"}``. Exact by construction, at the price of
  a round trip per request (bench/README.md has the measured figures).

The ids are hashed with :mod:`llmgw.kvhash` (seed :data:`~llmgw.kvhash.KV_HASH_SEED`,
the block size the replica reported, the LoRA key ``("lora", name, path)`` and the
body's ``cache_salt``) and folded to vLLM's 64-bit event form. Results are cached by
the exact tokenize request plus the hash parameters, bounded by :data:`MAX_CACHED_HASHES`,
so identical prompts (retries, fan-out, benchmarks) are tokenized and hashed once; and
block digests are remembered by what they hash (:class:`~llmgw.kvhash.BlockHashMemo`), so
a conversation's next turn hashes only the blocks its earlier turns did not have.

Every failure (deadline, connection, bad answer) returns None: the caller routes
approximately instead. Nothing here raises for a bad request body.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
from typing import Any, Mapping

import trio

from llmgw import kvhash
from llmgw.config.defaults import DEFAULT_TOKENIZE_TIMEOUT

from .replicas import Replica, RequestInfo, RoutingObserver
from .http.upstream import UpstreamClient
from .tokenizer_shelf import TokenizerShelf
from .turnhash import TurnHashMemo

log = logging.getLogger(__name__)

#: Block hashes kept in the cache in all (about 40 bytes each: 2 million is ~80 MB),
#: least recently used entries dropped first.
MAX_CACHED_HASHES = 2_000_000

#: Chat fields that change the tokens the chat template produces, passed to /tokenize.
_CHAT_FIELDS = ("tools", "chat_template_kwargs", "continue_final_message", "add_special_tokens", "documents")



def tokenize_request(request: RequestInfo, model: str) -> bytes | None:
    """Return the ``/tokenize`` body for ``request`` (as ``model``), or None when the request
    has nothing to tokenize (embeddings, malformed prompt, several prompts)."""
    body = request.body
    if request.path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        out: dict[str, Any] = {"model": model, "messages": messages,
                               "add_generation_prompt": body.get("add_generation_prompt", True) is not False}
        for key in _CHAT_FIELDS:
            if key in body:
                out[key] = body[key]
        return json.dumps(out, separators=(",", ":")).encode()
    if request.path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            return None
        return json.dumps({"model": model, "prompt": prompt}, separators=(",", ":")).encode()
    return None


def token_ids_given(request: RequestInfo) -> list[int] | None:
    """Return the prompt's token ids when a completions request gives them directly, else None."""
    if request.path != "/v1/completions":
        return None
    prompt = request.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return prompt
    return None


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """Return the request's ``cache_salt`` if it is a non-empty string, else None."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


class TokenHasher:
    """Turns requests into vLLM event block hashes via the replicas' ``/tokenize``.

    ``client`` is the gateway's upstream client (set with :meth:`bind` when the gateway
    starts serving; None: every call returns None). ``seed`` is the hash seed engines run
    with. Counters: ``calls`` (``/tokenize`` requests made), ``local`` (prompts tokenized in
    the gateway), ``cache_hits``, ``failures``; ``memo`` counts the blocks hashed and the
    blocks found remembered; ``shelf`` holds the local tokenizers, ``turns`` the chains.
    """

    def __init__(self, *, seed: str | None = kvhash.KV_HASH_SEED, timeout: float = DEFAULT_TOKENIZE_TIMEOUT,
                 max_cached: int = MAX_CACHED_HASHES) -> None:
        self.seed = seed
        self.timeout = timeout
        self.max_cached = max_cached
        self.client: UpstreamClient | None = None
        self._cache: collections.OrderedDict[tuple[Any, ...], tuple[int, ...]] = collections.OrderedDict()
        self.memo = kvhash.BlockHashMemo()
        self.observer = RoutingObserver()
        self.shelf = TokenizerShelf()
        self.shelf.timeout = timeout
        self.turns = TurnHashMemo()
        self._local_failures: set[type[BaseException]] = set()
        self._cached = 0
        self.local = 0
        self.calls = 0
        self.cache_hits = 0
        self.failures = 0

    def bind(self, client: UpstreamClient | None, nursery: trio.Nursery | None = None) -> None:
        """Use ``client`` for ``/tokenize`` calls from now on (None: stop calling), and fetch
        and check local tokenizers in ``nursery`` (None: use only those already here)."""
        self.client = client
        self.shelf.bind(client, nursery if client is not None else None)

    def retime(self, timeout: float) -> None:
        """Give ``/tokenize`` calls (and tokenizer checks) ``timeout`` seconds from now on."""
        self.timeout = self.shelf.timeout = timeout

    def attach_observer(self, observer: RoutingObserver) -> None:
        """Send tokenization counts, checks and alarms to ``observer`` (the gateway's metrics)."""
        self.observer = self.shelf.observer = observer

    def forget(self, replica_id: str) -> None:
        """``replica_id`` is gone: drop its local tokenizer state and clear its alarm."""
        self.shelf.forget(replica_id)

    def forget_all(self) -> None:
        """Drop every replica's local tokenizer state and clear every alarm."""
        self.shelf.forget_all()

    def alarms(self) -> list[str]:
        """Return the raised tokenizer alarms in words."""
        return self.shelf.alarms()

    async def hashes(
        self, replica: Replica, request: RequestInfo, block_size: int, lora: tuple[str, str] | None,
    ) -> tuple[int, ...] | None:
        """Return ``request``'s full-block event hashes as ``replica`` would compute them, or None.

        Tokenizes in the gateway where ``replica``'s tokenizer is here, else on ``replica``
        (under :attr:`timeout`) unless cached or given as ids.
        ``lora`` is (adapter name, adapter path on that replica) or None. Returns None on
        any failure (logged at debug level, counted in ``failures``). Cancellation
        propagates.
        """
        salt = cache_salt(request.body)
        ids = token_ids_given(request)
        if ids is None:
            local = self._local_hashes(replica, request, block_size, lora, salt)
            if local is not None:
                return local
        payload = None if ids is not None else tokenize_request(request, replica.model)
        if ids is None and payload is None:
            return None
        source = hashlib.blake2b(payload if payload is not None else json.dumps(ids).encode(), digest_size=16).digest()
        key = (source, block_size, lora, salt)
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return found
        if ids is None:
            assert payload is not None
            ids = await self._tokenize(replica, payload)
            if ids is None:
                return None
        result = tuple(self.memo.event_hashes(ids, block_size, seed=self.seed, lora=lora, cache_salt=salt))
        self._remember(key, result)
        return result

    def _local_hashes(self, replica: Replica, request: RequestInfo, block_size: int, lora: tuple[str, str] | None,
                      salt: str | None) -> tuple[int, ...] | None:
        """Return the hashes from the gateway's own tokenizer for ``replica``, or None where it
        has none or the request needs the engine's rendering. A failure here is a bug: logged
        with its traceback (once per kind), and the request goes to ``/tokenize``."""
        tokenizer = self.shelf.tokenizer_for(replica)
        if tokenizer is None:
            return None
        try:
            parts = self.shelf.parts(tokenizer, request)
            if parts is None:
                return None
            result = self.turns.event_hashes(tokenizer, parts, block_size, self.memo, seed=self.seed, lora=lora,
                                             cache_salt=salt)
        except Exception as error:  # noqa: BLE001 - never fail a request for the router's own tokenization
            if type(error) not in self._local_failures:
                self._local_failures.add(type(error))
                log.exception("tokenizing in the gateway failed for replica %s; using its /tokenize", replica.id)
            return None
        self.local += 1
        self.observer.tokenized(replica.model, "gateway")
        self.shelf.maybe_check(replica, tokenizer, parts, lambda: tokenize_request(request, replica.model))
        return tuple(result)

    async def _tokenize(self, replica: Replica, payload: bytes) -> list[int] | None:
        """Return the token ids ``replica`` answers for ``payload``, or None on any failure."""
        client = self.client
        if client is None:
            return None
        self.calls += 1
        self.observer.tokenized(replica.model, "engine")
        try:
            with trio.move_on_after(self.timeout) as scope:
                status, body = await client.call(replica, "POST", "/tokenize", payload, "llmgw-tokenize")
            if scope.cancelled_caught:
                raise TimeoutError(f"no answer within {self.timeout:g}s")
            if status != 200:
                raise ValueError(f"status {status}: {body[:200]!r}")
            tokens = json.loads(body)["tokens"]
            if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                raise ValueError("'tokens' is not a list of ints")
            return tokens
        except Exception as error:  # noqa: BLE001 - any failure means "route approximately"
            self.failures += 1
            log.debug("tokenize on replica %s failed: %s", replica.id, error)
            return None

    def _remember(self, key: tuple[Any, ...], value: tuple[int, ...]) -> None:
        if len(value) > self.max_cached:
            return
        self._cache[key] = value
        self._cached += len(value)
        while self._cached > self.max_cached:
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)
