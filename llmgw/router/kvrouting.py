"""KV-cache-aware routing: send each request to the replica that holds its prefix, without hot spots.

:class:`KvAwarePolicy` prices every candidate replica by the time this request would wait
there for its first token, and picks the cheapest: the prefill work already queued on it
plus this request's tokens it does not hold, at the rate learnt for that replica from
observed TTFTs (:mod:`llmgw.router.prefillcost`). A cached request costs a few ms of
prefill where its prefix lives and its whole prompt elsewhere, so affinity holds as long
as it pays, and a replica that is truly backed up loses to a cold one. What a replica
holds is known:

* **precisely** for replicas whose KV events are live (vLLM, ``llmgw.sim``): the request's
  tokens (:mod:`llmgw.router.tokens`) are hashed as vLLM hashes them and matched against
  the :class:`~llmgw.router.kvindex.KvIndex`. Blocks routed but not yet confirmed by an
  event count for ``routing.unconfirmed_ttl``, so a burst of one prefix sticks to one
  replica before its first event arrives.
* **approximately** for engines without events (llama.cpp), for replicas whose events are
  missing (no delta yet, block size unknown) or stale (requests routed, no block reported
  within the agreement window), and for replicas whose hashes disagree with the router's
  (alarm raised): a :class:`~llmgw.router.prefixtree.PrefixTree` of the prompt text
  routed to each replica, its match converted to tokens at
  :data:`~llmgw.router.admission.CHARS_PER_TOKEN`. Each such route carries the tree's
  claim back to it with the engine's usage (``Route.on_usage``): what the engine reports
  holding sizes the replica's tree to its cache.
* **miss** (no candidate holds any block): the same price, so the replica with the least
  work queued, then the least recently chosen (never "the smallest tree").

The work queued counts every request this gateway forwarded, from routing to its first
token (:class:`~llmgw.router.replicas.Lease`); other gateways' requests show in the TTFTs
each replica's rate is fitted to.

A model with one candidate skips all of this (no tokenization on the hot path).

:class:`HashAgreement` checks continuously that the router's hashes are the engine's:
after a routed request, the replica's reported blocks should include the request's
leading blocks (held already or stored for it), at the latest :data:`AFTER_FIRST_TOKEN_S`
after its first token. A replica that reports blocks, but not the router's, for
``routing.mismatch_alarm_after`` requests in a row raises an alarm (wrong seed, block
size, tokenizer or template) instead of a silent 0% hit rate, and is routed
approximately until its hashes agree again (it is still checked on every request).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import random
import time
from typing import Any, Awaitable, Callable, Iterable, Sequence

import attrs

from llmgw.config import ROUTING_POLICIES, RoutingConfig
from llmgw.config.defaults import DEFAULT_AGREEMENT_WINDOW, DEFAULT_MISMATCH_ALARM_AFTER, DEFAULT_UNCONFIRMED_TTL
from llmgw.spec import KvDelta

from .kvindex import KvIndex
from .prefixtree import PrefixTree, path_hashes, prompt_text
from .admission import CHARS_PER_TOKEN
from .replicas import LeastOutstanding, LoadTracker, Replica, RequestInfo, Route, RoutingObserver, RoutingPolicy
from .tokens import TokenHasher, cache_salt
from .usage import Usage

log = logging.getLogger(__name__)

# The tunables operators may set (unconfirmed TTL, agreement window, alarm
# threshold) are RoutingConfig's, with their defaults and reasons in llmgw/config/defaults.py.

#: Consecutive routed requests after which the replica still had reported no block at
#: all: its events are missing; it is routed approximately until it reports again.
SILENT_AFTER = 3
#: Pending expectations kept per replica (oldest dropped past it).
MAX_EXPECTATIONS = 64
#: Leading block hashes of a request remembered per expectation (any one reported meets it).
EXPECTED_HASHES = 64
#: Seconds a replica has, after a request's first token, to report its blocks: the engine
#: stores them in the step that ends prefill, and the agent relays events within tens of ms.
AFTER_FIRST_TOKEN_S = 1.0

ALARM_TEXT = ("router and engine block hashes disagree (seed, block size, tokenizer or template?) "
              "or the replica's KV events stopped")

#: Predicted times to first token closer than this are equal (then the longest match, then
#: the least recently chosen replica wins): below a millisecond the fit's noise decides,
#: and idle replicas must take turns rather than all go to the one fitted fastest.
COST_TIE_S = 0.001

#: A request sent where its prefix is not stores its uncached tokens there, evicting other
#: tenants' blocks that will cost as much again to prefill later: those tokens are priced
#: (1 + AFFINITY) times. Measured in bench/routing.py (16 tenants, queued prefill, caches
#: smaller than the work): hit rate 0.82 at 0 and 0.85 at 1 (the pinned-tenant oracle's),
#: mean TTFT 10% lower; 2 is no better than 1.
AFFINITY = 1.0

#: Engines that publish no KV events: routed approximately always.
ENGINES_WITHOUT_EVENTS = frozenset({"llama.cpp"})

PRECISE, APPROXIMATE, MISS = "precise", "approximate", "miss"


@attrs.frozen
class Decision:
    """One routing decision: the replica, the kind (precise/approximate/miss), the hit
    (``matched`` of ``total`` blocks or tree nodes), the request's uncached prompt tokens
    there (estimated) and its predicted time to first token (seconds)."""

    replica: Replica
    kind: str
    matched: int
    total: int
    uncached: int = 0
    cost: float = 0.0
    expectation: Any = attrs.field(default=None, repr=False)  # HashAgreement's, told of the first token
    by_tree: bool = False  # priced from the prefix tree (not the KV index)


# -- hash agreement ----------------------------------------------------------------------


@attrs.define
class _Expectation:
    model: str
    hashes: frozenset[int]
    deadline: float


@attrs.define
class _AgreementState:
    model: str = ""
    pending: collections.deque[_Expectation] = attrs.field(factory=lambda: collections.deque(maxlen=MAX_EXPECTATIONS))
    mismatches: int = 0
    silent: int = 0
    alarmed: bool = False
    next_deadline: float = math.inf  # the earliest pending deadline


class HashAgreement:
    """Checks that the blocks the router names for a request are the ones the replica reports.

    After each precise routing decision, :meth:`expect` with the request's leading block
    hashes: a replica with prefix caching holds every full block of a prompt it served, so
    within ``window`` seconds its reported blocks (``index``, the KV index) should include
    some of them, whether they were there already or stored for this request. An
    expectation met (held at :meth:`expect`, stored in a delta :meth:`observe` sees, or held
    at its deadline) counts as agreement and clears the alarm. One unmet at its deadline is
    a *mismatch* when the replica reports blocks (just not these: a wrong seed, block size,
    tokenizer or template names the same prefix otherwise), else *silence* (its events are
    missing). ``threshold`` consecutive mismatches raise the alarm (log warning once,
    observer told); :meth:`stale` says whether the replica's events went silent.
    """

    def __init__(self, index: KvIndex, *, window: float = DEFAULT_AGREEMENT_WINDOW,
                 threshold: int = DEFAULT_MISMATCH_ALARM_AFTER,
                 observer: RoutingObserver | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.window = window
        self.threshold = threshold
        self.observer = observer or RoutingObserver()
        self._clock = clock
        self._state: dict[str, _AgreementState] = {}

    def expect(self, model: str, replica_id: str, hashes: Iterable[int]) -> _Expectation | None:
        """Record that ``replica_id`` should soon report some of ``hashes`` (the first
        :data:`EXPECTED_HASHES` are kept); return the pending expectation (None: met at
        once, or nothing to expect), to be passed to :meth:`started`."""
        wanted = frozenset(itertools.islice(hashes, EXPECTED_HASHES))
        state = self._state.get(replica_id)
        if state is None:
            state = self._state[replica_id] = _AgreementState()
        state.model = model
        self._expire(replica_id, state)
        if not wanted:
            return None
        if self._held(replica_id, wanted):
            self._agreed(replica_id, state)
            return None
        expectation = _Expectation(model, wanted, self._clock() + self.window)
        state.pending.append(expectation)
        state.next_deadline = min(state.next_deadline, expectation.deadline)
        return expectation

    def started(self, replica_id: str, expectation: _Expectation | None) -> None:
        """The request behind ``expectation`` got its first token: its blocks are stored
        now, so the replica has :data:`AFTER_FIRST_TOKEN_S` left to report them (not the
        whole window, which also covers a long queue before prefill)."""
        state = self._state.get(replica_id)
        if expectation is None or state is None:
            return
        expectation.deadline = min(expectation.deadline, self._clock() + AFTER_FIRST_TOKEN_S)
        state.next_deadline = min(state.next_deadline, expectation.deadline)

    def sweep(self) -> None:
        """Settle every replica's expectations whose deadline passed (a mismatch is found
        without waiting for more traffic to the replica concerned)."""
        now = self._clock()
        for replica_id, state in self._state.items():
            if state.next_deadline <= now:
                self._expire(replica_id, state)

    def observe(self, replica_id: str, delta: KvDelta) -> None:
        """Check ``replica_id``'s new delta against its pending expectations."""
        state = self._state.get(replica_id)
        if state is None:
            return
        if delta.stored:
            stored = set(delta.stored)
            unmet = [exp for exp in state.pending if not any(h in stored for h in exp.hashes)]
            if len(unmet) < len(state.pending):
                state.pending = collections.deque(unmet, maxlen=MAX_EXPECTATIONS)
                state.next_deadline = min((exp.deadline for exp in unmet), default=math.inf)
                self._agreed(replica_id, state)
            state.silent = 0
        self._expire(replica_id, state)

    def _held(self, replica_id: str, hashes: frozenset[int]) -> bool:
        entry = self.index.replica(replica_id)
        return entry is not None and any(h in entry.blocks for h in hashes)

    def _expire(self, replica_id: str, state: _AgreementState) -> None:
        now = self._clock()
        if state.next_deadline > now:
            return
        due = [exp for exp in state.pending if exp.deadline <= now]
        if due:
            state.pending = collections.deque((exp for exp in state.pending if exp.deadline > now),
                                              maxlen=MAX_EXPECTATIONS)
        state.next_deadline = min((exp.deadline for exp in state.pending), default=math.inf)
        for exp in due:
            entry = self.index.replica(replica_id)
            if entry is None or not entry.blocks:
                state.silent += 1
            elif self._held(replica_id, exp.hashes):
                self._agreed(replica_id, state)
            else:
                state.mismatches += 1
                self.observer.mismatch(exp.model, replica_id)
                if state.mismatches >= self.threshold and not state.alarmed:
                    state.alarmed = True
                    log.warning("model %s replica %s: %s", exp.model, replica_id, ALARM_TEXT)
                    self.observer.alarm(exp.model, replica_id, True)

    def _agreed(self, replica_id: str, state: _AgreementState) -> None:
        state.mismatches = 0
        state.silent = 0
        if state.alarmed:
            state.alarmed = False
            log.warning("model %s replica %s: router and engine block hashes agree again", state.model, replica_id)
            self.observer.alarm(state.model, replica_id, False)

    def stale(self, replica_id: str) -> bool:
        """Return whether ``replica_id`` reported no blocks after its last few routed requests."""
        state = self._state.get(replica_id)
        if state is None:
            return False
        self._expire(replica_id, state)
        return state.silent >= SILENT_AFTER

    def alarmed(self, replica_id: str) -> bool:
        """Return whether ``replica_id``'s alarm is raised."""
        state = self._state.get(replica_id)
        return state is not None and state.alarmed

    def alarms(self) -> list[str]:
        """Return the raised alarms in words, one per replica, sorted."""
        return sorted(f"model {s.model} replica {rid}: {ALARM_TEXT}" for rid, s in self._state.items() if s.alarmed)

    def forget_all(self) -> None:
        """Drop every replica's state (clearing their alarms)."""
        for replica_id in list(self._state):
            self.forget(replica_id)

    def forget(self, replica_id: str) -> None:
        """Drop ``replica_id``'s state (clearing its alarm)."""
        state = self._state.pop(replica_id, None)
        if state is not None and state.alarmed:
            self.observer.alarm(state.model, replica_id, False)


# -- unconfirmed blocks ------------------------------------------------------------------


class Unconfirmed:
    """Blocks routed to each replica in the last ``ttl`` seconds (``routing.unconfirmed_ttl``)."""

    def __init__(self, ttl: float = DEFAULT_UNCONFIRMED_TTL, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._blocks: dict[str, dict[int, float]] = {}
        self._order: dict[str, collections.deque[tuple[float, Sequence[int]]]] = {}

    def add(self, replica_id: str, hashes: Sequence[int]) -> None:
        """Count ``hashes`` as held by ``replica_id`` for ``ttl`` seconds."""
        expiry = self._clock() + self.ttl
        blocks = self._blocks.setdefault(replica_id, {})
        for h in hashes:
            blocks[h] = expiry
        self._order.setdefault(replica_id, collections.deque()).append((expiry, hashes))

    def live(self, replica_id: str) -> dict[int, float] | None:
        """Return ``replica_id``'s unexpired blocks (a container for ``in``), or None if none."""
        order = self._order.get(replica_id)
        if not order:
            return None
        blocks = self._blocks[replica_id]
        now = self._clock()
        while order and order[0][0] <= now:
            expiry, hashes = order.popleft()
            for h in hashes:
                if blocks.get(h) == expiry:
                    del blocks[h]
        return blocks or None

    def discard(self, replica_id: str, hashes: Sequence[int]) -> None:
        """Stop counting ``hashes`` for ``replica_id`` (its engine reported them evicted)."""
        blocks = self._blocks.get(replica_id)
        if blocks:
            for h in hashes:
                blocks.pop(h, None)

    def forget(self, replica_id: str) -> None:
        """Drop ``replica_id``'s unconfirmed blocks."""
        self._blocks.pop(replica_id, None)
        self._order.pop(replica_id, None)


# -- the policy --------------------------------------------------------------------------


class KvAwarePolicy(RoutingPolicy):
    """Routes by KV-cache hits and load (see the module docstring).

    ``index`` is the KV index the gateway feeds (:meth:`~llmgw.router.app.Gateway.kv_update`);
    ``hasher`` turns requests into block hashes (bound to the gateway's upstream client
    when it starts). :meth:`attach_observer` sends decisions, mismatches and alarms to the metrics.
    """

    index: KvIndex  # always one of its own (or the one given)
    name = "kv"

    def __init__(
        self,
        load: LoadTracker,
        *,
        index: KvIndex | None = None,
        settings: RoutingConfig = RoutingConfig(),
        hasher: TokenHasher | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.load = load
        self.index = index if index is not None else KvIndex()
        self.settings = settings
        self.hasher = hasher if hasher is not None else TokenHasher(timeout=settings.tokenize_timeout)
        self.observer = RoutingObserver()  # the gateway's metrics, by attach_observer
        self.tree = PrefixTree()
        self.unconfirmed = Unconfirmed(settings.unconfirmed_ttl, clock)
        self.agreement = HashAgreement(self.index, window=settings.agreement_window,
                                       threshold=settings.mismatch_alarm_after, observer=self.observer, clock=clock)
        self._clock = clock
        self._last_chosen: dict[str, float] = {}
        self._reports_cached: set[str] = set()  # replicas whose engines report cached prompt tokens
        self._picks = itertools.count()
        self._rng = random.Random()

    # -- gateway hooks ------------------------------------------------------------------

    def bind_upstream(self, client: Any, nursery: Any = None) -> None:
        """Use the gateway's upstream client for ``/tokenize`` and tokenizer files (None when
        it stops), fetching and checking tokenizers in ``nursery``."""
        self.hasher.bind(client, nursery)

    def attach_observer(self, observer: RoutingObserver) -> None:
        """Send decisions, mismatches and alarms to ``observer`` (the gateway's metrics)."""
        self.observer = observer
        self.agreement.observer = observer
        self.hasher.attach_observer(observer)

    def kv_applied(self, replica_id: str, delta: KvDelta) -> None:
        """A delta from ``replica_id`` was applied to the index: check hash agreement, and stop
        counting evicted (or, on a reset, all) routed-but-unconfirmed blocks."""
        self.agreement.observe(replica_id, delta)
        if delta.reset:
            self.unconfirmed.forget(replica_id)
        elif delta.removed:
            self.unconfirmed.discard(replica_id, delta.removed)

    def kv_forgotten(self, replica_id: str) -> None:
        """``replica_id``'s KV state is gone (shard stopped, session ended)."""
        self.unconfirmed.forget(replica_id)
        self.agreement.forget(replica_id)
        self.hasher.forget(replica_id)

    def alarms(self) -> list[str]:
        """Return the hash-agreement and tokenizer alarms in words (for ``ctl status``)."""
        return self.agreement.alarms() + self.hasher.alarms()

    def retune(self, settings: RoutingConfig) -> None:
        """Use ``settings``' deadlines and thresholds from the next request on; the index,
        prefix tree, unconfirmed blocks and agreement states stay."""
        self.settings = settings
        self.hasher.retime(settings.tokenize_timeout)
        self.unconfirmed.ttl = settings.unconfirmed_ttl
        self.agreement.window = settings.agreement_window
        self.agreement.threshold = settings.mismatch_alarm_after

    def close(self) -> None:
        """Clear every raised hash-agreement and tokenizer alarm (the gateway routes by another policy now)."""
        self.agreement.forget_all()
        self.hasher.forget_all()

    # -- choosing -----------------------------------------------------------------------

    def choose(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | Awaitable[Replica]:
        """Return the only candidate at once, else an awaitable of the chosen one."""
        if not candidates:
            raise ValueError("choose() needs at least one candidate replica")
        if len(candidates) == 1:
            return candidates[0]
        return self._choose(candidates, request)

    async def _choose(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica:
        decision = await self.decide(candidates, request)
        return decision.replica

    def precise_capable(self, replica: Replica, adapter: str | None) -> bool:
        """Return whether ``replica`` can be scored precisely now (live events, known block size)."""
        if replica.engine in ENGINES_WITHOUT_EVENTS:
            return False
        entry = self.index.replica(replica.id)
        if entry is None or entry.block_size <= 0:
            return False
        if adapter is not None and replica.adapter_path(adapter) is None:
            return False
        return not self.agreement.stale(replica.id)

    async def precise_hashes(
        self, candidates: Sequence[Replica], request: RequestInfo, adapter: str | None,
    ) -> dict[str, tuple[int, ...]]:
        """Return the request's block hashes per precise-capable candidate (empty if none or on failure).

        Candidates sharing a block size and adapter path share one computation; the
        least-loaded capable candidate tokenizes.
        """
        out: dict[str, tuple[int, ...]] = {}
        if not self.index.has_replicas():  # no replica reports KV events: all approximate
            return out
        capable = [r for r in candidates if self.precise_capable(r, adapter)]
        if not capable:
            return out
        capable.sort(key=lambda r: self.load.outstanding(r.id))
        groups: dict[tuple[int, tuple[str, str] | None], list[Replica]] = {}
        for r in capable:
            lora = (adapter, r.adapter_path(adapter) or "") if adapter is not None else None
            groups.setdefault((self.index.block_size(r.id), lora), []).append(r)
        for (block_size, lora), members in groups.items():
            hashes = await self.hasher.hashes(members[0], request, block_size, lora)
            if hashes is None:
                continue
            for r in members:
                out[r.id] = hashes
        return out

    def precise_match(self, replica: Replica, hashes: Sequence[int]) -> int:
        """Return the leading blocks of ``hashes`` that ``replica`` holds or was just sent."""
        return self.index.leading_match(replica.id, hashes, self.unconfirmed.live(replica.id))

    async def decide(self, candidates: Sequence[Replica], request: RequestInfo) -> Decision:
        """Price ``candidates`` for ``request`` and return the cheapest (and record it).

        Each candidate's price is its predicted time to first token
        (:meth:`~llmgw.router.prefillcost.PrefillLedger.predict`) for the tokens of this
        request it does not hold: precisely from the KV index where its hashes agree with
        the engine's, else from the prefix tree. Prices within :data:`COST_TIE_S` are
        equal; then the longest match, then the least recently chosen replica wins.
        """
        self.agreement.sweep()
        precise = await self.precise_hashes(candidates, request, request.adapter)
        return self._cheapest(candidates, request, precise)

    def _cheapest(self, candidates: Sequence[Replica], request: RequestInfo,
                  precise: dict[str, tuple[int, ...]]) -> Decision:
        """Return the cheapest of ``candidates`` for ``request`` (recorded), given the
        request's block hashes per precise-capable candidate (:meth:`precise_hashes`)."""
        adapter = request.adapter
        text = prompt_text(request.body)
        path = path_hashes(text, salt=(adapter, cache_salt(request.body)))
        prompt_tokens = _prompt_tokens(precise, self.index, text)
        price = self.load.prefill.price
        best: tuple[Any, ...] | None = None
        chosen: tuple[Any, ...] = ()
        for r in candidates:
            hashes = precise.get(r.id) if precise else None
            if hashes is not None and not self.agreement.alarmed(r.id):
                matched, total, kind = self.precise_match(r, hashes), len(hashes), PRECISE
            else:
                matched, total, kind = self.tree.match(r.id, path), len(path), APPROXIMATE
            uncached = prompt_tokens - (prompt_tokens * matched // total if total else 0)
            cost = price(r.id, uncached, AFFINITY)
            key = (-round(cost / COST_TIE_S), matched, -self._recency(r.id))
            if best is None or key > best:
                best = key
                chosen = (r, kind, matched, total, uncached, cost)
        r, kind, matched, total, uncached, cost = chosen
        decision = Decision(r, kind if matched else MISS, matched, total, uncached, cost, by_tree=kind == APPROXIMATE)
        return self._record(decision, request, path, precise.get(r.id))

    def _recency(self, replica_id: str) -> float:
        """Return when ``replica_id`` was last chosen (a pick number: lower is longer ago).

        A replica never chosen comes before every chosen one, in an order drawn at random
        once per router: with a fixed order (the candidates'), the routers of several
        gateways behind a round-robin balancer started their rotations at the same replica
        in lockstep, and sent a cold start's first requests there together
        (bench/routing.py, gateways section: 3 gateways sent the 30 requests of 6 conversations
        15/15/0/0 to four replicas).
        """
        last = self._last_chosen.get(replica_id)
        if last is None:
            last = self._last_chosen[replica_id] = -1.0 - self._rng.random()
        return last

    def route(self, candidates: Sequence[Replica], request: RequestInfo) -> Route | Awaitable[Route]:
        """Return the only candidate's route at once, else the cheapest's (with its uncached
        tokens, and the hash-agreement check told of its first token): at once while no
        replica reports KV events (nothing to tokenize), else an awaitable of it."""
        if not candidates:
            raise ValueError("route() needs at least one candidate replica")
        if len(candidates) == 1:
            return Route(candidates[0])
        if not self.index.has_replicas():  # nothing to hash: all approximate, priced now
            self.agreement.sweep()
            return self._route_of(self._cheapest(candidates, request, {}))
        return self._route(candidates, request)

    async def _route(self, candidates: Sequence[Replica], request: RequestInfo) -> Route:
        return self._route_of(await self.decide(candidates, request))

    def _route_of(self, decision: Decision) -> Route:
        """Return the route of ``decision``: its replica and uncached tokens, the hash-agreement
        check told of its first token, and the prefix tree's claim checked against the usage."""
        replica_id, expectation = decision.replica.id, decision.expectation
        on_usage = self._tree_check(decision) if decision.by_tree else None
        if expectation is None:
            return Route(decision.replica, decision.uncached, on_usage=on_usage)
        return Route(decision.replica, decision.uncached, lambda _s: self.agreement.started(replica_id, expectation),
                     on_usage)

    def _tree_check(self, decision: Decision) -> Callable[[Usage], None]:
        """Return the callback that holds the prefix tree's claim for ``decision`` (a share of
        the prompt held) against what the engine reports holding, once the answer is done
        (:meth:`~llmgw.router.prefixtree.PrefixTree.engine_held`: the tree learns the
        replica's cache size). A replica whose engine never reported cached tokens teaches nothing."""
        replica_id = decision.replica.id
        share = decision.matched / decision.total if decision.total else 0.0
        window = self.tree.window(replica_id)

        def engine_reported(usage: Usage) -> None:
            if usage.cached_reported or usage.cached_tokens:
                self._reports_cached.add(replica_id)
            elif replica_id not in self._reports_cached:
                return
            if usage.prompt_tokens > 0:
                self.tree.engine_held(replica_id, window, share * usage.prompt_tokens, usage.cached_tokens)

        return engine_reported

    def _record(self, decision: Decision, request: RequestInfo, path: list[int],
                hashes: tuple[int, ...] | None) -> Decision:
        """Record ``decision`` (tree, metrics, unconfirmed blocks, hash agreement); return it
        with its hash-agreement expectation."""
        replica = decision.replica
        self._last_chosen[replica.id] = next(self._picks)
        self.tree.insert(replica.id, path)
        # The hit-share estimate counts only what the engine itself reported holding (KV
        # events), of requests the router hashed: blocks routed but unconfirmed and the
        # prefix tree's guesses steer routing, but they overstated the hit share where
        # engines evicted (0.89 claimed where the engines counted 0.36).
        reported = self.index.leading_match(replica.id, hashes) if hashes else 0
        self.observer.decision(request.model, decision.kind, reported, len(hashes) if hashes else 0)
        if hashes:
            self.unconfirmed.add(replica.id, hashes)
            return attrs.evolve(decision, expectation=self.agreement.expect(request.model, replica.id, hashes))
        return decision


def _prompt_tokens(precise: dict[str, tuple[int, ...]], index: KvIndex, text: str) -> int:
    """Return the request's prompt length in tokens, one figure for every candidate: from its
    block hashes where a replica tokenized it (full blocks, plus half a block for the partial
    last one), else estimated from its text at :data:`CHARS_PER_TOKEN`."""
    for replica_id, hashes in precise.items():
        block = index.block_size(replica_id)
        if block > 0:
            return len(hashes) * block + block // 2
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


class RoundRobin(RoutingPolicy):
    """Picks candidates in turn, per model (a baseline for benchmarks and a config choice)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turns: dict[str, itertools.count[int]] = {}

    def choose(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica:
        """Return the next candidate in turn for ``request.model``."""
        if not candidates:
            raise ValueError("choose() needs at least one candidate replica")
        turn = next(self._turns.setdefault(request.model, itertools.count()))
        return candidates[turn % len(candidates)]


def make_policy(settings: RoutingConfig, load: LoadTracker, *, index: KvIndex | None = None) -> RoutingPolicy:
    """Return the routing policy ``settings.policy`` names, on ``load`` (a KV-aware one reads
    ``index``; None: a new one of its own).

    Raises ValueError for an unknown policy name (config validation refuses it first).
    """
    if settings.policy == "kv":
        return KvAwarePolicy(load, index=index, settings=settings)
    if settings.policy == "least-load":
        return LeastOutstanding(load)
    if settings.policy == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy {settings.policy!r}; use one of {', '.join(ROUTING_POLICIES)}")
