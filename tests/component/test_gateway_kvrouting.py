"""KV-aware routing end to end: the gateway in front of in-process ``llmgw.sim`` replicas whose KV
events reach the gateway's index through real ZMQ sockets and the agent's KvSubscriber.

Proves: repeated-prefix requests land on the replica holding the prefix (the engine reports
the prompt as cached); a warm replica with a long prefill queue is bypassed; engines hashing with
another seed raise the hash-agreement alarm (metric and words), not a silent 0% hit rate; the
gateway tokenizes with the engines' own tokenizer files once it has them, and files that
disagree with the engine's /tokenize raise the tokenizer alarm and send the replica back to it.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Callable

import attrs
import httpx
import pytest
import trio

from llmgw import kvhash
from llmgw.config import RoutingConfig
from llmgw.node.kvevents import KvSubscriber
from llmgw.router import LoadTracker, Replica, ReplicaTable, create_app, serve_gateway
from llmgw.router.app import Gateway, gateway_of
from llmgw.router.kvrouting import ALARM_TEXT, KvAwarePolicy, RoundRobin
from llmgw.sim import SimConfig, serve
from llmgw.sim.launch import free_tcp_port
from llmgw.spec import KvDelta

MODEL = "m"
BS = 16
DEADLINE_S = 30.0
AGREEMENT_WINDOW_S = 10.0
TOKENIZERS = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer"


@attrs.define
class Cluster:
    http: httpx.AsyncClient
    policy: KvAwarePolicy
    load: LoadTracker
    engines: list  # llmgw.sim.engine.Engine, one per replica
    replicas: list[Replica]
    gateway: Gateway


class ManualClock:
    """The policy's clock, moved on by the test (agreement windows pass without waiting)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def cluster(n: int = 3, *, seed: str = kvhash.KV_HASH_SEED, clock: Callable[[], float] = time.monotonic,
                  tokenizer: Path | None = None, served: Path | None = None, feed_events: bool = True,
                  num_blocks: int = 512) -> AsyncIterator[Cluster]:
    """Run ``n`` sims with KV events, their subscribers feeding the gateway, and the gateway.

    ``tokenizer``: the sims tokenize with it and serve its files (``served``'s instead, if given);
    ``feed_events`` False: their events never reach the gateway (it routes approximately);
    ``num_blocks``: each sim's KV cache, in blocks of :data:`BS` tokens."""
    async with trio.open_nursery() as nursery:
        load = LoadTracker()
        settings = RoutingConfig(agreement_window=AGREEMENT_WINDOW_S, mismatch_alarm_after=2)
        policy = KvAwarePolicy(load, settings=settings, clock=clock)
        table = ReplicaTable()
        app = create_app(table, load=load, policy=policy)
        gateway = gateway_of(app)
        engines, replicas = [], []
        for i in range(n):
            events, replay = f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}"
            rid = f"r{i}"
            sub = KvSubscriber(events, replay, block_size=BS)

            async def send(delta: KvDelta, rid: str = rid) -> None:
                if feed_events:
                    gateway.kv_update(rid, delta)

            await nursery.start(sub.run, send)
            if feed_events:
                gateway.kv_update(rid, sub.full_copy())  # what the agent sends when its session starts
            cfg = SimConfig(model=MODEL, port=0, block_size=BS, num_blocks=num_blocks, hash_seed=seed,
                            prefill_us_per_token=0, kv_events_endpoint=events, kv_replay_endpoint=replay,
                            tokenizer=str(tokenizer) if tokenizer else None,
                            served_tokenizer=str(served or tokenizer) if tokenizer else None)
            engine, port = await nursery.start(serve, cfg)
            engines.append(engine)
            replicas.append(Replica(rid, MODEL, f"http://127.0.0.1:{port}", "node", engine="sim"))
        table.set_model_replicas(MODEL, replicas)
        port = await nursery.start(serve_gateway, app, "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as http:
            yield Cluster(http, policy, load, engines, replicas, gateway)
        nursery.cancel_scope.cancel()


def conversation(tenant: int, turn: int) -> dict:
    system = f"You are the assistant of tenant {tenant}. " + " ".join(f"rule{tenant}-{k}" for k in range(60))
    messages = [{"role": "system", "content": system}]
    for t in range(turn):
        messages += [{"role": "user", "content": f"question {t} of tenant {tenant} " * 5},
                     {"role": "assistant", "content": f"answer {t} " * 5}]
    messages.append({"role": "user", "content": f"question {turn} of tenant {tenant} " * 5})
    return {"model": MODEL, "messages": messages, "max_tokens": 4}


async def cached_tokens(c: Cluster, body: dict) -> int:
    response = await c.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens", 0)


async def held_everywhere(c: Cluster) -> None:
    """Wait until the index holds what every engine holds (events have caught up)."""
    with trio.fail_after(DEADLINE_S):
        while True:
            if all(len(c.policy.index.replica(r.id).blocks) == len(e.cache) for r, e in zip(c.replicas, c.engines)):
                return
            await trio.sleep(0.01)


def metric_value(text: str, sample: str) -> float:
    """Return the value of the exposition line starting with ``sample`` (fails if absent)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(sample + " ")]
    assert len(values) == 1, f"{sample} not in /metrics"
    return values[0]


async def test_repeated_prefixes_go_where_the_prefix_is() -> None:
    async with cluster() as c:
        for tenant in range(4):
            await cached_tokens(c, conversation(tenant, 0))
        await held_everywhere(c)
        for turn in (1, 2):
            for tenant in range(4):
                hit = await cached_tokens(c, conversation(tenant, turn))
                assert hit >= 4 * BS, f"tenant {tenant} turn {turn}: only {hit} tokens were cached"
            await held_everywhere(c)
        metrics = (await c.http.get("/metrics")).text
        assert 'llmgw_gateway_routing_decisions_total{kind="precise",model="m"}' in metrics
        assert "llmgw_gateway_kv_index_blocks" in metrics
        # the engines' own hit share is published beside the router's estimate
        engine_cached = metric_value(metrics, 'llmgw_gateway_engine_cached_prompt_tokens_total{model="m"}')
        engine_prompt = metric_value(metrics, 'llmgw_gateway_engine_prompt_tokens_total{model="m"}')
        assert 0 < engine_cached < engine_prompt
        assert engine_cached == sum(e.cache.hits for e in c.engines)  # what the engines counted
        assert c.policy.alarms() == []  # same seed: router and engines agree


async def test_approximate_routing_learns_each_replicas_cache_size_from_the_engines_usage() -> None:
    async with cluster(2, feed_events=False, num_blocks=24) as c:  # a cache of about one tenant's prompt
        tree = c.policy.tree
        for tenant in range(6):  # twice each: the second is held where the first went, and the engine says so
            await cached_tokens(c, conversation(tenant, 0))
            assert await cached_tokens(c, conversation(tenant, 0)) > 0
        assert [tree.bound(r.id) for r in c.replicas] == [tree.max_nodes] * 2  # borne out: nothing to learn
        for tenant in range(6):  # long evicted: the tree claims what the engines no longer hold
            assert await cached_tokens(c, conversation(tenant, 0)) == 0
        assert min(tree.bound(r.id) for r in c.replicas) < tree.max_nodes
        assert all(tree.size(r.id) <= tree.bound(r.id) for r in c.replicas)
        metrics = (await c.http.get("/metrics")).text  # what the operator sees
        for r in c.replicas:
            assert metric_value(metrics, f'llmgw_gateway_prefix_tree_bound_nodes{{replica="{r.id}"}}') == tree.bound(r.id)
            assert metric_value(metrics, f'llmgw_gateway_prefix_tree_nodes{{replica="{r.id}"}}') == tree.size(r.id)


async def test_overloaded_warm_replica_is_bypassed() -> None:
    async with cluster() as c:
        assert await cached_tokens(c, conversation(7, 0)) == 0
        await held_everywhere(c)
        warm = next(r for r, e in zip(c.replicas, c.engines) if len(e.cache))
        # a backlog of uncached prefill on the warm replica: waiting there costs more than
        # prefilling the whole prompt elsewhere
        leases = [c.load.acquire(warm.id, prefill_tokens=100_000)]
        try:
            assert await cached_tokens(c, conversation(7, 1)) == 0  # sent to a cold replica
        finally:
            for lease in leases:
                lease.release()
        await held_everywhere(c)
        assert sum(1 for e in c.engines if len(e.cache)) == 2


@pytest.mark.parametrize("repeat", [False, True], ids=["new-prefixes", "one-repeated-prefix"])
async def test_wrong_seed_raises_the_alarm(repeat: bool) -> None:
    # new prefixes: the engine keeps storing blocks, never the router's; one repeated prefix:
    # after the first request the engine stores nothing new, it holds the prefix under its own hashes
    clock = ManualClock()
    async with cluster(2, seed="not-the-router-seed", clock=clock) as c:
        with trio.fail_after(DEADLINE_S):
            i = 0
            while not c.policy.alarms():
                await cached_tokens(c, conversation(100 + (0 if repeat else i), 0))
                i += 1
                clock.now += AGREEMENT_WINDOW_S + 1  # the request's agreement window has passed
        assert ALARM_TEXT in c.policy.alarms()[0]
        metrics = (await c.http.get("/metrics")).text
        assert any(line.startswith("llmgw_gateway_kv_hash_alarm{") and line.endswith(" 1.0")
                   for line in metrics.splitlines())


async def test_routing_settings_apply_live_without_losing_the_index() -> None:
    """The cluster setting ``routing`` reaches a serving gateway: another policy takes over
    on the same KV index (the old one's alarms cleared), parameters retune the policy in place."""
    clock = ManualClock()
    async with cluster(2, seed="not-the-router-seed", clock=clock) as c:
        with trio.fail_after(DEADLINE_S):
            i = 0
            while not c.policy.alarms():
                await cached_tokens(c, conversation(200 + i, 0))
                i += 1
                clock.now += AGREEMENT_WINDOW_S + 1
        blocks = {r.id: len(c.gateway.kv_index.replica(r.id).blocks) for r in c.replicas}

        c.gateway.apply_routing({"policy": "round-robin"})
        assert isinstance(c.gateway.policy, RoundRobin) and c.gateway.routing.policy == "round-robin"
        metrics = (await c.http.get("/metrics")).text
        assert metric_value(metrics, 'llmgw_gateway_routing_policy{policy="round-robin"}') == 1
        assert metric_value(metrics, 'llmgw_gateway_routing_policy{policy="kv"}') == 0
        assert not any(line.startswith("llmgw_gateway_kv_hash_alarm{") and line.endswith(" 1.0")
                       for line in metrics.splitlines())  # the KV policy's alarm went with it
        before = [len(e.cache) for e in c.engines]
        for _ in range(2):  # in turn: one request each, whatever they hold
            await cached_tokens(c, conversation(300, 0))
        assert [len(e.cache) > b for e, b in zip(c.engines, before)] == [True, True]

        c.gateway.apply_routing({"policy": "kv", "mismatch_alarm_after": 5})
        kv = c.gateway.policy
        assert isinstance(kv, KvAwarePolicy) and kv is not c.policy
        assert kv.index is c.gateway.kv_index and kv.agreement.threshold == 5
        assert all(len(kv.index.replica(rid).blocks) >= n for rid, n in blocks.items())  # nothing relearnt
        c.gateway.apply_routing({"policy": "kv", "mismatch_alarm_after": 7, "tokenize_timeout": 0.25})
        assert c.gateway.policy is kv  # retuned, not replaced
        assert kv.agreement.threshold == 7 and kv.hasher.timeout == 0.25
        c.gateway.apply_routing({})  # the setting removed: server.yaml's routing again
        assert c.gateway.policy is kv and kv.agreement.threshold == c.gateway.routing_base.mismatch_alarm_after


async def test_the_gateway_tokenizes_with_the_engines_own_tokenizer() -> None:
    async with cluster(2, tokenizer=TOKENIZERS / "chatml") as c:
        hasher = c.policy.hasher
        with trio.fail_after(DEADLINE_S):
            tenant = 0
            while hasher.shelf.agreed < 2:  # both replicas' files fetched, then checked against /tokenize
                await cached_tokens(c, conversation(tenant, 0))
                tenant += 1
        await held_everywhere(c)
        local_before = hasher.local
        for turn in (1, 2):
            for t in range(tenant):
                hit = await cached_tokens(c, conversation(t, turn))
                assert hit >= 4 * BS, f"tenant {t} turn {turn}: only {hit} tokens were cached"
            await held_everywhere(c)
        assert hasher.local - local_before == 2 * tenant  # every later request tokenized in the gateway
        assert hasher.turns.resumed > 0  # turn 2 resumed turn 1's chain
        assert hasher.shelf.mismatches == 0 and c.policy.alarms() == []


async def test_tokenizer_files_that_disagree_raise_the_alarm_and_fall_back_to_tokenize() -> None:
    # the engines tokenize without a BOS; the files they hand out add one to completions
    async with cluster(2, tokenizer=TOKENIZERS / "chatml", served=TOKENIZERS / "bos") as c:
        hasher = c.policy.hasher
        body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 8, "max_tokens": 2}
        with trio.fail_after(DEADLINE_S):
            while not hasher.alarms():
                response = await c.http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
        assert "disagrees with the engine's /tokenize at token 0" in hasher.alarms()[0]
        assert hasher.alarms()[0] in c.policy.alarms()  # what ctl status shows
        metrics = (await c.http.get("/metrics")).text
        assert any(line.startswith("llmgw_gateway_tokenizer_alarm{") and line.endswith(" 1.0")
                   for line in metrics.splitlines())
        local, calls = hasher.local, hasher.calls
        for i in range(3):
            response = await c.http.post("/v1/completions", json={**body, "prompt": f"again {i} " + body["prompt"]})
            assert response.status_code == 200
        assert hasher.local == local and hasher.calls == calls + 3  # the engine's /tokenize again
