"""KvAwarePolicy decisions, unconfirmed blocks, pricing by predicted TTFT, and the hash-agreement check."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.config import RoutingConfig
from llmgw.router.kvrouting import (
    ALARM_TEXT, APPROXIMATE, MISS, PRECISE, HashAgreement, KvAwarePolicy, RoundRobin, make_policy,
)
from llmgw.router.kvindex import KvIndex
from llmgw.router.prefixtree import SHRINK_FACTOR
from llmgw.router.tokens import TokenHasher
from llmgw.router.usage import Usage
from llmgw.router.replicas import LeastOutstanding, LoadTracker, Replica, RequestInfo, Route, RoutingObserver
from llmgw.spec import KvDelta

A = Replica("a", "m", "http://127.0.0.1:1", engine="vllm")
B = Replica("b", "m", "http://127.0.0.1:2", engine="vllm")
HASHES = tuple(range(100, 110))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FixedHasher(TokenHasher):
    """Stands in for TokenHasher: every request hashes to HASHES."""

    def __init__(self, hashes: tuple[int, ...] | None = HASHES) -> None:
        super().__init__()
        self.value = hashes

    async def hashes(self, replica: Replica, request: RequestInfo, block_size: int, lora: Any) -> Any:
        self.calls += 1
        return self.value


class Recorder(RoutingObserver):
    def __init__(self) -> None:
        self.decisions: list[tuple[str, int, int]] = []
        self.alarms: list[tuple[str, bool]] = []
        self.mismatches = 0

    def decision(self, model: str, kind: str, matched: int, total: int) -> None:
        self.decisions.append((kind, matched, total))

    def mismatch(self, model: str, replica_id: str) -> None:
        self.mismatches += 1

    def alarm(self, model: str, replica_id: str, raised: bool) -> None:
        self.alarms.append((replica_id, raised))


def chat(text: str = "hello " * 100) -> RequestInfo:
    return RequestInfo(path="/v1/chat/completions", model="m", body={"messages": [{"role": "user", "content": text}]})


def policy(clock: Clock, hasher: FixedHasher | None = None, load: LoadTracker | None = None) -> KvAwarePolicy:
    p = KvAwarePolicy(load or LoadTracker(), hasher=hasher or FixedHasher(), clock=clock)  # type: ignore[arg-type]
    p.attach_observer(Recorder())
    return p


def live(p: KvAwarePolicy, replica: Replica, stored: tuple[int, ...] = ()) -> None:
    delta = KvDelta(reset=True, stored=stored, block_size=16)
    p.index.apply(replica.id, delta)
    p.kv_applied(replica.id, delta)


async def test_precise_goes_to_the_replica_holding_the_prefix() -> None:
    clock = Clock()
    p = policy(clock)
    live(p, A)
    live(p, B, HASHES[:4])
    decision = await p.decide([A, B], chat())
    assert (decision.replica, decision.kind, decision.matched, decision.total) == (B, PRECISE, 4, 10)


async def test_hit_share_estimate_counts_only_blocks_the_engine_reported() -> None:
    rec = Recorder()
    p = KvAwarePolicy(LoadTracker(), hasher=FixedHasher(), clock=Clock())  # type: ignore[arg-type]
    p.attach_observer(rec)
    live(p, A)
    live(p, B, HASHES[:4])
    first = await p.decide([A, B], chat())
    assert first.replica is B and rec.decisions[-1] == (PRECISE, 4, 10)
    # B was just sent all 10 blocks: routing counts them (it sends the next one there too),
    # but until B's KV events report them the estimate still says 4 of 10.
    second = await p.decide([A, B], chat())
    assert (second.replica, second.matched) == (B, 10)
    assert rec.decisions[-1] == (PRECISE, 4, 10)
    # B evicts and says so: the estimate follows the engine, not the router's memory.
    delta = KvDelta(removed=HASHES[:4], block_size=16)
    p.index.apply("b", delta)
    p.kv_applied("b", delta)
    await p.decide([A, B], chat())
    assert rec.decisions[-1][1:] == (0, 10)
    # A request the router could not hash counts in neither figure.
    p.hasher = FixedHasher(None)  # type: ignore[assignment]
    await p.decide([A, B], chat())
    assert rec.decisions[-1][1:] == (0, 0)


async def test_single_candidate_skips_tokenizing() -> None:
    hasher = FixedHasher()
    p = policy(Clock(), hasher)
    assert p.choose([A], chat()) is A
    assert hasher.calls == 0


async def test_affinity_holds_while_it_pays() -> None:
    # B holds the prefix and has a few cached requests (a few tokens each) queued: their
    # wait is a few tokens' prefill, far less than the whole prompt on A.
    load = LoadTracker()
    p = policy(Clock(), load=load)
    live(p, A)
    live(p, B, HASHES)
    leases = [load.acquire("b", prefill_tokens=16) for _ in range(8)]
    decision = await p.decide([A, B], chat())
    assert (decision.replica, decision.kind) == (B, PRECISE)
    assert decision.uncached < len(HASHES) * 16
    for lease in leases:
        lease.release()


async def test_a_backed_up_replica_loses_to_a_cold_one() -> None:
    load = LoadTracker()
    clock = Clock()
    p = policy(clock, load=load)
    live(p, A)
    live(p, B, HASHES)
    backlog = load.acquire("b", prefill_tokens=10 * len(HASHES) * 16)  # ten whole prompts queued on B
    decision = await p.decide([A, B], chat())
    assert decision.replica is A and decision.kind == MISS
    backlog.first_token()  # its prefill is done: B's queue is empty again
    clock.now += 10  # A's unconfirmed copy of the prefix has expired
    assert (await p.decide([A, B], chat())).replica is B


async def test_route_carries_the_uncached_tokens_and_the_first_token_shortens_the_agreement_window() -> None:
    clock = Clock()
    rec = Recorder()
    load = LoadTracker(clock)
    p = KvAwarePolicy(load, hasher=FixedHasher(), clock=clock)  # type: ignore[arg-type]
    p.attach_observer(rec)
    live(p, A, (999,))  # A reports blocks, never the router's (a wrong seed)
    live(p, B)
    load.acquire("b", prefill_tokens=1_000_000)  # B is backed up: everything goes to A
    threshold = RoutingConfig().mismatch_alarm_after
    for i in range(threshold):
        route = await p.route([A, B], chat())
        assert route.replica is A
        if i == 0:
            assert route.prefill_tokens == len(HASHES) * 16 + 8  # nothing held: all of it, and a partial block
        lease = load.acquire(route.replica.id, route.prefill_tokens, route.on_first_token)
        clock.now += 0.5
        lease.first_token()
        lease.release()
        clock.now += 1.1  # past AFTER_FIRST_TOKEN_S, well inside the agreement window
        p.agreement.sweep()
        p.unconfirmed.forget("a")
    assert rec.mismatches == threshold
    assert rec.alarms == [("a", True)]  # within the first few mismatches, without waiting for the window
    decision = await p.decide([A, B], chat())
    assert decision.replica is A and decision.kind == APPROXIMATE  # alarmed: routed by the prefix tree


async def test_miss_goes_least_loaded_then_least_recently_chosen() -> None:
    hasher = FixedHasher(None)  # tokenizing fails: approximate, and these prompts share nothing
    p = policy(Clock(), hasher)
    first = await p.decide([A, B], chat("one " * 100))
    second = await p.decide([A, B], chat("two " * 100))
    assert {first.replica, second.replica} == {A, B}
    assert first.kind == second.kind == MISS


async def test_unconfirmed_blocks_count_until_ttl() -> None:
    clock = Clock()
    p = policy(clock)
    live(p, A)
    live(p, B)
    first = await p.decide([A, B], chat())
    again = await p.decide([A, B], chat())
    assert again.replica is first.replica and again.kind == PRECISE and again.matched == 10
    p.kv_applied(first.replica.id, KvDelta(removed=HASHES[5:]))  # (the index is not consulted here)
    assert (await p.decide([A, B], chat())).matched == 5  # evicted blocks stop counting at once
    clock.now += RoutingConfig().unconfirmed_ttl + 0.1
    later = await p.decide([A, B], chat())
    assert later.kind == MISS and later.replica is not first.replica  # least recently chosen


async def test_approximate_for_engines_without_events() -> None:
    hasher = FixedHasher()
    p = policy(Clock(), hasher)
    la, lb = Replica("a", "m", "http://x:1", engine="llama.cpp"), Replica("b", "m", "http://x:2", engine="llama.cpp")
    system = "You are a helpful assistant. " * 20
    first = await p.decide([la, lb], chat(system + "question one"))
    second = await p.decide([la, lb], chat(system + "question two"))
    assert second.replica is first.replica and second.kind == APPROXIMATE
    assert hasher.calls == 0
    # While no replica reports KV events there is nothing to tokenize: route() prices the
    # candidates at once and returns the route itself, no coroutine to await.
    route = p.route([la, lb], chat(system + "question three"))
    assert isinstance(route, Route) and route.replica is first.replica
    live(p, A)
    pending = p.route([A, B], chat())  # a replica reports events: it may tokenize
    assert not isinstance(pending, Route)
    assert (await pending).replica in (A, B)


async def test_stale_events_fall_back_to_approximate() -> None:
    clock = Clock()
    p = policy(clock)
    live(p, A)
    live(p, B)
    for i in range(6):  # routed requests (alternating A, B) after which nothing is stored at all
        await p.decide([A, B], chat(f"{i} " * 200))
        clock.now += 20
    assert not p.precise_capable(A, None) and not p.precise_capable(B, None)
    decision = await p.decide([A, B], chat("fresh " * 200))
    assert decision.kind == MISS  # approximate scoring, nothing in the tree for this prompt
    p.index.apply("a", KvDelta(stored=(5,)))
    p.kv_applied("a", KvDelta(stored=(5,)))
    assert p.precise_capable(A, None)  # it reports again: precise again


def agreement(clock: Clock, threshold: int, rec: RoutingObserver | None = None) -> tuple[HashAgreement, KvIndex]:
    index = KvIndex()
    return HashAgreement(index, window=5, threshold=threshold, observer=rec, clock=clock), index


def report(check: HashAgreement, index: KvIndex, replica: str, delta: KvDelta) -> None:
    index.apply(replica, delta)
    check.observe(replica, delta)


def test_agreement_alarm_raised_and_cleared() -> None:
    clock = Clock()
    rec = Recorder()
    check, index = agreement(clock, 3, rec)
    for i in range(3):
        check.expect("m", "r", [i * 10 + 1, i * 10 + 2])
        report(check, index, "r", KvDelta(stored=(999 + i,)))  # the engine stores other blocks
        clock.now += 6
    check.observe("r", KvDelta())
    assert rec.mismatches == 3 and check.alarmed("r")
    assert check.alarms() == [f"model m replica r: {ALARM_TEXT}"]
    assert rec.alarms == [("r", True)]
    check.expect("m", "r", [42])
    report(check, index, "r", KvDelta(stored=(41, 42)))
    assert not check.alarmed("r") and rec.alarms[-1] == ("r", False) and check.alarms() == []


def test_agreement_alarm_when_the_replica_already_cached_the_prefix_under_other_hashes() -> None:
    # A repeated prefix stores nothing new on the engine: only what the replica holds can tell.
    clock = Clock()
    rec = Recorder()
    check, index = agreement(clock, 2, rec)
    report(check, index, "r", KvDelta(reset=True, stored=(900, 901)))  # the prefix, as the engine names it
    for _ in range(2):
        check.expect("m", "r", [1, 2])  # the same prefix, as the router names it
        clock.now += 6
    check.observe("r", KvDelta())
    assert check.alarmed("r") and rec.mismatches == 2 and not check.stale("r")


def test_agreement_held_blocks_agree_at_once() -> None:
    clock = Clock()
    rec = Recorder()
    check, index = agreement(clock, 1, rec)
    report(check, index, "r", KvDelta(reset=True, stored=(1, 2)))
    for _ in range(3):
        check.expect("m", "r", [1, 2, 3])  # repeated prefix, nothing new stored
        clock.now += 6
    check.observe("r", KvDelta())
    assert rec.mismatches == 0 and not check.alarmed("r") and not check.stale("r")


def test_agreement_silence_is_not_a_mismatch() -> None:
    clock = Clock()
    check, index = agreement(clock, 1)
    for i in range(3):
        check.expect("m", "r", [i])
        clock.now += 6
    assert check.stale("r") and not check.alarmed("r")
    report(check, index, "r", KvDelta(stored=(77,)))
    assert not check.stale("r")


def test_make_policy_names() -> None:
    load = LoadTracker()
    assert isinstance(make_policy(RoutingConfig(policy="kv"), load), KvAwarePolicy)
    assert isinstance(make_policy(RoutingConfig(policy="least-load"), load), LeastOutstanding)
    assert isinstance(make_policy(RoutingConfig(policy="round-robin"), load), RoundRobin)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy(RoutingConfig(policy="random"), load)
    rr = RoundRobin()
    assert [rr.choose([A, B], chat()).id for _ in range(3)] == ["a", "b", "a"]


async def test_approximate_routing_learns_the_replicas_cache_from_the_engines_usage() -> None:
    p = policy(Clock())
    la, lb = Replica("a", "m", "http://x:1", engine="llama.cpp"), Replica("b", "m", "http://x:2", engine="llama.cpp")
    for i in range(40):  # 40 conversations' prompts in the tree, 10 nodes each
        p.route([la, lb], chat(f"conversation {i:02d} " * 80))  # no KV events: routed at once
    again = chat("conversation 00 " * 80)
    route = p.route([la, lb], again)  # the tree claims the whole prompt is held there
    assert isinstance(route, Route) and route.on_usage is not None
    held_at = route.replica.id
    size = p.tree.size(held_at)
    route.on_usage(Usage(prompt_tokens=330, completion_tokens=5))  # an engine that never says what it held
    assert p.tree.bound(held_at) == p.tree.max_nodes  # teaches nothing
    route.on_usage(Usage(prompt_tokens=330, completion_tokens=5, cached_tokens=0, cached_reported=True))
    assert p.tree.bound(held_at) == p.tree.size(held_at) == int(size * SHRINK_FACTOR)  # it had evicted it
    # Precise decisions are the KV index's, held to the engine's events, not to its usage.
    live(p, A, HASHES)
    live(p, B)
    assert (await p.route([A, B], chat())).on_usage is None
