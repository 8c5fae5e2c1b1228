"""Predicted time to first token on a replica: the prefill work queued there, and what it costs.

Routing by cache hits alone piles work onto warm replicas; counting requests in flight
(the old load gate) treats a request whose prefix is cached (a few ms of prefill) and a
cold one (hundreds of ms) as the same load, so under pressure it sent cached requests
away, paid their whole prefill elsewhere and evicted other tenants there. This module
prices the choice in seconds instead:

    predicted TTFT on r = rate_r x (queued_r + uncached_r + RUNNING_TOKEN_EQUIV x decoding_r + OVERHEAD_TOKENS)

* ``queued_r``: uncached prompt tokens of requests this gateway sent to ``r`` that have
  not had their first token yet (prefill is compute bound: they go first);
* ``uncached_r``: this request's tokens ``r`` does not hold (the router's estimate);
* ``decoding_r``: requests on ``r`` past their first token (they share its steps);
* ``rate_r``: seconds per token of work, learnt per replica from the TTFTs this gateway
  observes, by an exponentially weighted least-squares fit of TTFT against the work
  ahead of each request when it was routed, pulled toward the fleet's fit (and a prior)
  while a replica has few observations. A replica slowed by other gateways' requests, a
  slower GPU or a full batch shows it in its TTFTs, so its rate rises.

:class:`PrefillLedger` keeps both per replica; :class:`~llmgw.router.replicas.LoadTracker`
owns one and its leases feed it. Synchronous, no I/O, trio thread only.
"""

from __future__ import annotations

import math
import time
from typing import Callable

#: Token-equivalents of prefill that one decoding request on a replica costs a newcomer:
#: each engine step carries one token per running sequence beside the prefill chunk,
#: and a full batch makes a newcomer wait for a slot. A small weight keeps the rule
#: "cache hits first" while still spreading when one replica collects many streams.
RUNNING_TOKEN_EQUIV = 32.0
#: Prior prefill rate before any TTFT is seen: 20,000 tokens/s (a small model on one
#: GPU). Only ratios between replicas matter until the fit takes over.
PRIOR_RATE_S_PER_TOKEN = 1.0 / 20_000
#: The fixed part of a TTFT (network, scheduling, the first decode step) in tokens of
#: prefill: 64 tokens is 3 ms at the prior rate, about what an idle engine adds.
OVERHEAD_TOKENS = 64.0
#: Weight of the prior in the fit, in observations: a replica's own data outweighs it
#: after a handful of requests.
PRIOR_WEIGHT = 4.0
#: Work (tokens) at which the prior's rate weighs as much as PRIOR_WEIGHT observations:
#: a typical prompt's uncached part.
PRIOR_SCALE_TOKENS = 1000.0
#: Each new observation multiplies the weight of the older ones by this: about the last
#: 100 requests on a replica count, so the fit follows a change of load within seconds.
DECAY = 0.99
#: Bounds on a fitted rate, as multiples of the prior: a fit on a few odd TTFTs could
#: otherwise go to zero (every replica looks free) or explode.
MIN_RATE_FACTOR, MAX_RATE_FACTOR = 0.01, 1000.0
#: Refit after this many new observations (cheap, but the cost is per request).
REFIT_EVERY = 4


class TtftFit:
    """An exponentially weighted least-squares fit of ``ttft = rate x (work + OVERHEAD_TOKENS)``.

    One coefficient per replica, its speed: a two-coefficient line (base and slope) cannot
    be told apart from the few work levels one replica sees, and a fit that is wrong
    between replicas routes worse than none. ``prior`` (a callable returning a rate)
    supplies the rate the fit is pulled toward, as :data:`PRIOR_WEIGHT` observations at
    :data:`PRIOR_SCALE_TOKENS`: the fleet's fit for a replica, a constant for the fleet.
    """

    __slots__ = ("_prior", "_n", "_sxy", "_sxx", "_pending", "rate")

    def __init__(self, prior: Callable[[], float]) -> None:
        self._prior = prior
        self._n = self._sxy = self._sxx = 0.0
        self._pending = 0
        self.rate = prior()

    def observe(self, work: float, seconds: float) -> None:
        """Add one TTFT of ``seconds`` for a request with ``work`` tokens ahead of and in it."""
        if not (math.isfinite(work) and math.isfinite(seconds)) or work < 0 or seconds < 0:
            return
        x = work + OVERHEAD_TOKENS
        self._n = self._n * DECAY + 1.0
        self._sxy = self._sxy * DECAY + x * seconds
        self._sxx = self._sxx * DECAY + x * x
        self._pending += 1
        if self._pending >= REFIT_EVERY:
            self.refit()

    @property
    def weight(self) -> float:
        """Return the decayed number of observations behind the fit."""
        return self._n

    def refit(self) -> None:
        """Recompute ``rate`` from the observations and the prior (bounded around the prior)."""
        self._pending = 0
        rate0 = self._prior()
        w = PRIOR_WEIGHT * PRIOR_SCALE_TOKENS**2
        rate = (self._sxy + w * rate0) / (self._sxx + w)
        self.rate = min(max(rate, PRIOR_RATE_S_PER_TOKEN * MIN_RATE_FACTOR), PRIOR_RATE_S_PER_TOKEN * MAX_RATE_FACTOR)

    def predict(self, work: float) -> float:
        """Return the predicted TTFT in seconds for ``work`` tokens ahead of and in a request."""
        return self.rate * (work + OVERHEAD_TOKENS)


class _Replica:
    __slots__ = ("queued", "decoding", "fit")

    def __init__(self, prior: Callable[[], float]) -> None:
        self.queued = 0  # uncached prompt tokens before their first token
        self.decoding = 0  # requests past their first token
        self.fit = TtftFit(prior)


class PrefillLedger:
    """Per replica: the prefill work queued, the requests decoding, and the TTFT fit.

    :meth:`routed` when a request is sent (returns the work it was routed behind, kept by
    the caller), :meth:`first_token` when its first token arrives (observes its TTFT),
    :meth:`finished` when it ends. :meth:`predict` prices a candidate.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._fleet = TtftFit(lambda: PRIOR_RATE_S_PER_TOKEN)
        self._replicas: dict[str, _Replica] = {}

    def _fleet_line(self) -> float:
        return self._fleet.rate

    def _get(self, replica_id: str) -> _Replica:
        state = self._replicas.get(replica_id)
        if state is None:
            state = self._replicas[replica_id] = _Replica(self._fleet_line)
        return state

    def work_ahead(self, replica_id: str) -> float:
        """Return the tokens of work a new request on ``replica_id`` waits behind."""
        state = self._replicas.get(replica_id)
        if state is None:
            return 0.0
        return state.queued + RUNNING_TOKEN_EQUIV * state.decoding

    def predict(self, replica_id: str, uncached_tokens: float) -> float:
        """Return the predicted TTFT (seconds) of a request with ``uncached_tokens`` on ``replica_id``."""
        return self._fit(replica_id).predict(self.work_ahead(replica_id) + uncached_tokens)

    def price(self, replica_id: str, uncached_tokens: float, affinity: float) -> float:
        """Return :meth:`predict` plus ``affinity`` x :meth:`rate` x ``uncached_tokens`` (the
        router's price of a candidate, in seconds), with one lookup of the replica's fit."""
        fit = self._fit(replica_id)
        return fit.predict(self.work_ahead(replica_id) + uncached_tokens) + affinity * fit.rate * uncached_tokens

    def rate(self, replica_id: str) -> float:
        """Return ``replica_id``'s fitted seconds per prefill token (the fleet's if unknown)."""
        return self._fit(replica_id).rate

    def _fit(self, replica_id: str) -> TtftFit:
        """Return ``replica_id``'s fit, or the fleet's while it has observed nothing."""
        state = self._replicas.get(replica_id)
        return state.fit if state is not None and state.fit.weight > 0 else self._fleet

    def routed(self, replica_id: str, uncached_tokens: int) -> float:
        """Count a request with ``uncached_tokens`` as queued on ``replica_id``; return the
        work (tokens) it is routed behind, plus its own (what its TTFT is fitted against)."""
        state = self._get(replica_id)
        work = state.queued + RUNNING_TOKEN_EQUIV * state.decoding + uncached_tokens
        state.queued += uncached_tokens
        return work

    def first_token(self, replica_id: str, uncached_tokens: int, work: float, seconds: float) -> None:
        """The request counted by :meth:`routed` got its first token after ``seconds``:
        its prefill leaves the queue, it counts as decoding, its TTFT is observed."""
        state = self._get(replica_id)
        state.queued = max(0, state.queued - uncached_tokens)
        state.decoding += 1
        state.fit.observe(work, seconds)
        self._fleet.observe(work, seconds)

    def finished(self, replica_id: str, uncached_tokens: int, started: bool) -> None:
        """The request ended (``started``: after :meth:`first_token`; else its prefill is dropped)."""
        state = self._replicas.get(replica_id)
        if state is None:
            return
        if started:
            state.decoding = max(0, state.decoding - 1)
        else:
            state.queued = max(0, state.queued - uncached_tokens)

    def forget(self, replica_id: str) -> None:
        """Drop ``replica_id``'s state (the replica left the table)."""
        self._replicas.pop(replica_id, None)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Return each replica's queued tokens, decoding requests and fitted line (for metrics, tests)."""
        return {rid: {"queued_tokens": s.queued, "decoding": s.decoding, "rate_s_per_token": s.fit.rate,
                      "observations": s.fit.weight}
                for rid, s in self._replicas.items()}
