"""The prefill ledger: work queued per replica, and the TTFT fit it is priced with."""

from __future__ import annotations

import pytest

from llmgw.router.prefillcost import (
    MAX_RATE_FACTOR, MIN_RATE_FACTOR, OVERHEAD_TOKENS, PRIOR_RATE_S_PER_TOKEN, RUNNING_TOKEN_EQUIV, PrefillLedger,
    TtftFit,
)
from llmgw.router.replicas import LoadTracker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prior() -> float:
    return PRIOR_RATE_S_PER_TOKEN


def test_fit_starts_at_the_prior_and_learns_the_rate() -> None:
    fit = TtftFit(prior)
    assert fit.rate == PRIOR_RATE_S_PER_TOKEN
    rate = 1e-3  # 1,000 tokens/s: 20x slower than the prior
    for i in range(400):
        work = float((i * 37) % 2000)
        fit.observe(work, rate * (work + OVERHEAD_TOKENS))
    fit.refit()
    assert fit.rate == pytest.approx(rate, rel=0.05)
    assert fit.predict(1000) == pytest.approx(rate * (1000 + OVERHEAD_TOKENS), rel=0.05)


def test_fit_ignores_nonsense_and_bounds_the_rate() -> None:
    fit = TtftFit(prior)
    for bad in ((float("nan"), 1.0), (1.0, float("inf")), (-5.0, 1.0), (5.0, -1.0)):
        fit.observe(*bad)
    assert fit.weight == 0
    for _ in range(200):
        fit.observe(10.0, 1e6)  # a replica that never answers in time
    fit.refit()
    assert fit.rate == PRIOR_RATE_S_PER_TOKEN * MAX_RATE_FACTOR
    for _ in range(2000):
        fit.observe(1e9, 0.0)  # answers before it could have read the prompt
    fit.refit()
    assert fit.rate == pytest.approx(PRIOR_RATE_S_PER_TOKEN * MIN_RATE_FACTOR)


def test_ledger_counts_queued_prefill_until_the_first_token() -> None:
    clock = Clock()
    load = LoadTracker(clock)
    ledger = load.prefill
    first = load.acquire("r", prefill_tokens=1000)
    second = load.acquire("r", prefill_tokens=500)
    assert ledger.work_ahead("r") == 1500
    assert ledger.predict("r", 100) > ledger.predict("idle", 100)
    clock.now += 0.2
    first.first_token()
    first.first_token()  # once only
    assert ledger.work_ahead("r") == 500 + RUNNING_TOKEN_EQUIV  # one decoding, one queued
    for replica in ("r", "idle"):  # the router's price: the prediction plus the affinity term, in one lookup
        assert ledger.price(replica, 100, 1.0) == pytest.approx(ledger.predict(replica, 100) + ledger.rate(replica) * 100)
    second.release()  # failed before its first token: its prefill leaves the queue
    first.release()
    first.release()
    assert ledger.work_ahead("r") == 0
    assert ledger.snapshot()["r"]["observations"] == pytest.approx(1.0)
    assert load.outstanding("r") == 0


def test_a_slow_replica_is_priced_higher_after_its_ttfts_are_seen() -> None:
    clock = Clock()
    load = LoadTracker(clock)
    for i in range(200):
        for replica, seconds_per_token in (("fast", 1e-4), ("slow", 1e-3)):
            tokens = 200 + 50 * (i % 7)
            lease = load.acquire(replica, prefill_tokens=tokens)
            clock.now += 0.003 + seconds_per_token * tokens
            lease.first_token()
            lease.release()
    ledger = load.prefill
    assert ledger.rate("slow") > 3 * ledger.rate("fast")  # ~6x truly (3 ms fixed each); the fleet prior pulls both
    assert ledger.predict("slow", 500) > ledger.predict("fast", 500)
    ledger.forget("slow")
    assert "slow" not in ledger.snapshot()


def test_an_unseen_replica_is_priced_by_the_fleet() -> None:
    ledger = PrefillLedger(Clock())
    assert ledger.predict("new", 1000) == pytest.approx(PRIOR_RATE_S_PER_TOKEN * (1000 + OVERHEAD_TOKENS))
