"""Which local tokenizer serves each replica: fetched once from its engine, checked against
its ``/tokenize`` on a sample of requests.

The gateway tokenizes prompts itself (llmgw/hftokenizer.py) where a replica's
engine hands out its tokenizer files (``GET /llmgw/tokenizer``, vLLM through llmgw's guard);
replicas of one model share one :class:`~llmgw.hftokenizer.LocalTokenizer` (by the
files' digest). Fetches run in the gateway's nursery, never on a request's path: until a
replica's tokenizer is here, its requests use ``/tokenize`` as before.

Every local tokenization is a claim that must match the engine's. The first
:data:`CHECK_FIRST` requests of each replica, then one in :data:`CHECK_EVERY`, are also sent
to the engine's ``/tokenize`` (in the background, one at a time per replica) and the ids
compared. A difference raises an alarm (``ctl status``, the
``llmgw_gateway_tokenizer_alarm`` gauge, a warning naming the first differing token) and
that replica goes back to ``/tokenize`` for :data:`MISMATCH_RETRY_S`; then its files are
fetched again and checked afresh (the alarm clears on the next agreeing check).
"""

from __future__ import annotations

import json
import logging
import random
import time
from typing import Any, Callable, Sequence

import attrs
import trio

from llmgw.hftokenizer import LocalTokenizer, Parts, TokenizerFilesError
from .replicas import Replica, RequestInfo, RoutingObserver

log = logging.getLogger(__name__)

#: Where a replica's engine serves its tokenizer files (llmgw_vllm_guard.TOKENIZER_PATH).
TOKENIZER_PATH = "/llmgw/tokenizer"
#: Deadline for fetching one replica's files (up to tens of MB over the LAN).
FETCH_TIMEOUT_S = 60.0
#: A replica whose engine served no files (404: another engine, an older agent) or whose
#: fetch failed is asked again after this long: an upgraded or restarted engine may serve them.
REFETCH_AFTER_S = 300.0
#: Requests of each replica checked against its /tokenize before sampling starts: a
#: tokenizer that disagrees is caught within the first few requests.
CHECK_FIRST = 8
#: After the first checks, one request in this many is checked (a few /tokenize calls a
#: second at thousands of requests a second, where every request used to make one).
CHECK_EVERY = 64
#: How long a replica whose local ids disagreed with its engine's uses /tokenize before
#: its files are fetched and checked again.
MISMATCH_RETRY_S = 600.0

READY, FETCHING, ABSENT, MISMATCH = "ready", "fetching", "absent", "mismatch"


def tokenizer_from_answer(body: bytes) -> LocalTokenizer:
    """Return the tokenizer in a ``GET /llmgw/tokenizer`` answer (``{"files": {name: text}}``);
    raises TokenizerFilesError (or ValueError for bad JSON) saying what is wrong."""
    files = json.loads(body).get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise TokenizerFilesError("'files' is not an object of texts")
    return LocalTokenizer({str(k): v.encode("utf-8") for k, v in files.items()})


@attrs.define
class _ReplicaState:
    model: str
    status: str
    tokenizer: LocalTokenizer | None = None
    retry_at: float = 0.0
    checked: int = 0
    checking: bool = False
    alarm: str | None = None


class TokenizerShelf:
    """Local tokenizers by replica (see the module docstring).

    :meth:`bind` hands it the gateway's upstream client and a nursery for fetches and
    checks (without both, only tokenizers given with :meth:`put` are used). Counters:
    ``fetched``, ``checks``, ``agreed``, ``mismatches``.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.client: Any = None
        self.nursery: trio.Nursery | None = None
        self.observer = RoutingObserver()
        self.timeout = 5.0  # the /tokenize deadline of checks (the hasher's tokenize_timeout)
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._replicas: dict[str, _ReplicaState] = {}
        self._by_digest: dict[str, LocalTokenizer] = {}
        self.fetched = 0
        self.checks = 0
        self.agreed = 0
        self.mismatches = 0

    def bind(self, client: Any, nursery: trio.Nursery | None) -> None:
        """Fetch and check through ``client`` in ``nursery`` from now on (None: stop)."""
        self.client, self.nursery = client, nursery

    def put(self, replica_id: str, model: str, tokenizer: LocalTokenizer) -> None:
        """Use ``tokenizer`` for ``replica_id`` (bench and tests; the gateway fetches)."""
        self._replicas[replica_id] = _ReplicaState(model, READY, self._shared(tokenizer))

    def forget(self, replica_id: str) -> None:
        """``replica_id`` is gone: drop its state and clear its alarm."""
        state = self._replicas.pop(replica_id, None)
        if state is not None and state.alarm is not None:
            self.observer.tokenizer_alarm(state.model, replica_id, False)
        live = {id(s.tokenizer) for s in self._replicas.values()}
        self._by_digest = {d: t for d, t in self._by_digest.items() if id(t) in live}

    def forget_all(self) -> None:
        """Drop every replica's state and clear every alarm."""
        for replica_id in list(self._replicas):
            self.forget(replica_id)

    def alarms(self) -> list[str]:
        """Return the raised tokenizer alarms in words (for ``ctl status``)."""
        return [s.alarm for s in self._replicas.values() if s.alarm is not None]

    def tokenizer_for(self, replica: Replica) -> LocalTokenizer | None:
        """Return the local tokenizer to use for ``replica`` now, or None (use ``/tokenize``).

        Starts a background fetch when none was tried, or a retry is due.
        """
        state = self._replicas.get(replica.id)
        if state is not None and state.status == READY:
            return state.tokenizer
        if state is not None and (state.status == FETCHING or self._clock() < state.retry_at):
            return None
        nursery = self.nursery
        if nursery is None or self.client is None:
            return None
        if state is None:
            state = self._replicas[replica.id] = _ReplicaState(replica.model, FETCHING)
        state.status = FETCHING
        nursery.start_soon(self._fetch, replica, state)
        return None

    def parts(self, tokenizer: LocalTokenizer, request: RequestInfo) -> Parts | None:
        """Return ``request``'s prompt as ``tokenizer``'s :class:`Parts`, or None when it must
        go to the engine (not chat or completions text, or a chat only the engine renders)."""
        if request.path == "/v1/chat/completions":
            return tokenizer.chat_parts(request.body)
        if request.path == "/v1/completions":
            if request.body.get("add_special_tokens") not in (None, True):
                return None
            prompt = request.body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str) and prompt:
                return tokenizer.completion_parts(prompt)
        return None

    def maybe_check(self, replica: Replica, tokenizer: LocalTokenizer, parts: Parts,
                    payload: Callable[[], bytes | None]) -> None:
        """Compare ``parts``' ids with ``replica``'s ``/tokenize`` of ``payload()`` (the
        request's ``/tokenize`` body, made only when checked) in the background, for the first
        requests of the replica and a sample after."""
        state = self._replicas.get(replica.id)
        if state is None or state.checking or self.nursery is None or self.client is None:
            return
        if state.checked >= CHECK_FIRST and self._rng.random() * CHECK_EVERY >= 1.0:
            return
        body = payload()
        if body is None:
            return
        state.checking = True
        self.nursery.start_soon(self._check, replica, state, tokenizer, parts, body)

    # -- background ------------------------------------------------------------------------

    def _shared(self, tokenizer: LocalTokenizer) -> LocalTokenizer:
        return self._by_digest.setdefault(tokenizer.digest, tokenizer)

    async def _fetch(self, replica: Replica, state: _ReplicaState) -> None:
        """Fetch ``replica``'s files and make its tokenizer; any failure schedules a retry."""
        try:
            with trio.fail_after(FETCH_TIMEOUT_S):
                status, body = await self.client.call(replica, "GET", TOKENIZER_PATH, b"", "llmgw-tokenizer")
            if status != 200:
                self._absent(replica, state, f"status {status}")
                return
            # Parsing tens of megabytes of JSON and loading the tokenizer take tens of
            # milliseconds of CPU: off the trio thread, which serves requests meanwhile.
            tokenizer = await trio.to_thread.run_sync(tokenizer_from_answer, body)
        except Exception as error:  # noqa: BLE001 - any failure means "keep using /tokenize"
            self._absent(replica, state, f"{type(error).__name__}: {error}")
            return
        if self._replicas.get(replica.id) is not state:
            return  # forgotten meanwhile
        self.fetched += 1
        state.tokenizer = self._shared(tokenizer)
        state.status = READY
        state.checked = 0
        log.info("replica %s: tokenizing %s's prompts in the gateway (files %s)", replica.id, replica.model,
                 tokenizer.digest[:12])

    def _absent(self, replica: Replica, state: _ReplicaState, reason: str) -> None:
        state.status = ABSENT
        state.retry_at = self._clock() + REFETCH_AFTER_S
        log.debug("replica %s serves no tokenizer files (%s); using its /tokenize", replica.id, reason)

    async def _check(self, replica: Replica, state: _ReplicaState, tokenizer: LocalTokenizer, parts: Parts,
                     payload: bytes) -> None:
        try:
            with trio.move_on_after(self.timeout):
                status, body = await self.client.call(replica, "POST", "/tokenize", payload, "llmgw-tokenize-check")
                if status == 200:
                    engine = json.loads(body)["tokens"]
                    if isinstance(engine, list):
                        self._compare(replica, state, tokenizer.ids(parts), engine)
        except Exception as error:  # noqa: BLE001 - a failed check proves nothing either way
            log.debug("tokenizer check on replica %s failed: %s", replica.id, error)
        finally:
            state.checking = False

    def _compare(self, replica: Replica, state: _ReplicaState, local: Sequence[int], engine: Sequence[int]) -> None:
        self.checks += 1
        state.checked += 1
        agreed = list(local) == list(engine)
        self.observer.tokenizer_check(state.model, agreed)
        if agreed:
            self.agreed += 1
            if state.alarm is not None:
                state.alarm = None
                self.observer.tokenizer_alarm(state.model, replica.id, False)
                log.info("replica %s: the gateway's tokenizer agrees with the engine's again", replica.id)
            return
        self.mismatches += 1
        at = next((i for i, (a, b) in enumerate(zip(local, engine)) if a != b), min(len(local), len(engine)))
        state.alarm = (f"replica {replica.id} ({state.model}): the gateway's tokenizer disagrees with the engine's "
                       f"/tokenize at token {at} of {len(engine)}; using /tokenize")
        state.status = MISMATCH
        state.retry_at = self._clock() + MISMATCH_RETRY_S
        self.observer.tokenizer_alarm(state.model, replica.id, True)
        log.warning("%s (gateway %s, engine %s); fetching its files again in %.0f s", state.alarm,
                    list(local[at:at + 4]), list(engine[at:at + 4]), MISMATCH_RETRY_S)
