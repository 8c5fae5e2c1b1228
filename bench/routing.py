"""Routing quality benchmark: round-robin, least-load, approximate and precise KV routing against an oracle.

``python -m bench.routing [--quick]`` starts four simulated engines (``python -m llmgw.sim``
processes on 127.0.0.1, a small KV cache so placement matters, a prefill cost per uncached
token so cache hits show in time to first token, one prefill at a time per engine so prefill
work queues as on a compute-bound engine, KV events over ZMQ with a replay socket)
and one :class:`llmgw.node.kvevents.KvSubscriber` per engine (the agent's own class),
whose deltas feed the KV index of the policy under test.

Workload: a multi-turn, multi-tenant chat. Each tenant has a long system prompt; each
conversation grows turn by turn (user question, assistant answer, next question), and
``--concurrency`` conversations run at once, interleaved, each turn sent when the previous
one finished. Every policy sees the same conversations in the same order; engine caches are
cleared between runs. The hot-tenant variant gives one tenant most of the conversations. The two-gateway variant sends each request of the uniform
stream through one of two router instances at random (each with its own load count, as
separate gateway processes have): the KV events reach both, the prefix trees see half each.

Policies, all driven in this process on the same request stream (requests go over HTTP,
streamed, straight to the chosen engine, counted in a shared ``LoadTracker`` while in flight,
its first chunk reported to the lease as the gateway does):

* ``round-robin``, ``least-load``: the baselines;
* ``approximate``: :class:`~llmgw.router.kvrouting.KvAwarePolicy` fed no events (prefix tree only);
* ``precise``: the same policy fed the engines' KV events, tokenizing through ``/tokenize``;
* ``oracle``: the same pricing, but each candidate's hit read from the engine itself
  (``POST /debug/cached_blocks``) just before routing: the best a router that knows every
  cache can do. Its TTFT includes those lookups.
* ``pinned``: the client-side oracle: each tenant's conversations all go to one replica
  (tenant i to replica i mod 4). No replica ever holds another's tenants.

Figures per policy: prefix-cache hit rate (cached prompt tokens / prompt tokens, from the
engines' usage), mean and p99 TTFT (request start to first content chunk, routing included),
load spread (max/mean requests per replica), decisions by kind, routing time. Also the
router's cost in-process: a decision at an 8k-token prompt with a KV index of a million
blocks, hashing 8k tokens, ``/tokenize`` round trips. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import statistics
import sys
import time
from typing import Any, Sequence

import attrs
import httpx
import psutil
import trio

from llmgw import kvhash
from llmgw.node.kvevents import KvSubscriber
from llmgw.router.http.upstream import UpstreamClient
from llmgw.router.kvindex import KvIndex
from llmgw.router.kvrouting import KvAwarePolicy, RoundRobin
from llmgw.router.prefixtree import path_hashes, prompt_text
from llmgw.router.replicas import LeastOutstanding, LoadTracker, Replica, RequestInfo, Route, RoutingObserver, RoutingPolicy
from llmgw.sim.launch import DEFAULT_START_TIMEOUT_S, SimProcess, free_tcp_port, start_sim
from llmgw.spec import KvDelta

from bench.rpc import percentile

MODEL = "bench-routing"
HOST = "127.0.0.1"
REPLICAS = 4
BLOCK_SIZE = 16
#: Seconds allowed for any one benchmark HTTP call (engines are local and fast).
HTTP_TIMEOUT_S = 30.0
#: Seconds allowed for the engines' caches to clear (and the subscribers to see it) between runs.
SETTLE_TIMEOUT_S = 30.0
#: Conversations open at once per concurrent request (the rest of them wait on their users).
ACTIVE_PER_WORKER = 3
#: The fixed words conversations are made of (the sim's tokenizer gives one token per word).
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


@attrs.frozen
class Workload:
    """Shape of one run's request stream."""

    tenants: int
    conversations: int  # in all
    turns: int
    system_words: int
    user_words: int
    answer_words: int
    concurrency: int
    hot_share: float = 0.0  # share of conversations belonging to tenant 0 (0: uniform)


@attrs.frozen
class EngineShape:
    """How the simulated engines are started."""

    num_blocks: int
    prefill_us_per_token: float
    decode_us_per_token: float
    max_tokens: int
    prefill_concurrency: int = 1  # prefill queues per replica, as compute-bound prefill does


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def words(rng: random.Random, n: int, tag: str) -> str:
    return tag + " " + " ".join(rng.choice(WORDS) for _ in range(n))


def conversations(w: Workload, seed: int) -> list[list[dict[str, Any]]]:
    """Return each conversation as its list of request bodies (turn 0 first), in run order."""
    rng = random.Random(seed)
    systems = [f"You are the assistant of tenant {t}. " + words(rng, w.system_words, f"policy{t}")
               for t in range(w.tenants)]
    out = []
    for c in range(w.conversations):
        if w.hot_share > 0 and rng.random() < w.hot_share:
            tenant = 0
        else:
            tenant = rng.randrange(w.tenants)
        messages: list[dict[str, str]] = [{"role": "system", "content": systems[tenant]}]
        bodies = []
        for turn in range(w.turns):
            messages = messages + [{"role": "user", "content": words(rng, w.user_words, f"c{c}q{turn}")}]
            bodies.append({"model": MODEL, "messages": messages, "stream": True, "user": f"tenant{tenant}",
                           "stream_options": {"include_usage": True}})
            messages = messages + [{"role": "assistant", "content": words(rng, w.answer_words, f"c{c}a{turn}")}]
        out.append(bodies)
    return out


# -- engines and their events ------------------------------------------------------------


class EventSink:
    """Routes each engine's deltas to the KV indexes of the policies under test (or nowhere)."""

    def __init__(self) -> None:
        self.policies: list[KvAwarePolicy] = []

    def sender(self, replica_id: str) -> Any:
        async def send(delta: KvDelta) -> None:
            for policy in self.policies:
                policy.index.apply(replica_id, delta)
                policy.kv_applied(replica_id, delta)

        return send


def start_engines(shape: EngineShape, n: int) -> tuple[list[SimProcess], list[tuple[str, str]]]:
    """Start ``n`` sims with KV events; return them and their (events, replay) endpoints."""
    sims, endpoints = [], []
    env = {**os.environ, "PYTHONHASHSEED": kvhash.KV_HASH_SEED}
    try:
        for _ in range(n):
            ep = (f"tcp://{HOST}:{free_tcp_port()}", f"tcp://{HOST}:{free_tcp_port()}")
            args = ["--port", "0", "--model", MODEL, "--block-size", str(BLOCK_SIZE),
                    "--num-blocks", str(shape.num_blocks),
                    "--prefill-us-per-token", str(shape.prefill_us_per_token),
                    "--prefill-concurrency", str(shape.prefill_concurrency),
                    "--decode-us-per-token", str(shape.decode_us_per_token),
                    "--kv-events-endpoint", ep[0], "--kv-replay-endpoint", ep[1]]
            sims.append(start_sim(args, env=env, wait=False))  # all start at once; waited for below
            endpoints.append(ep)
        for sim in sims:
            sim.wait_listening(DEFAULT_START_TIMEOUT_S)
    except BaseException:
        for sim in sims:
            sim.stop()
        raise
    return sims, endpoints


# -- the oracle --------------------------------------------------------------------------


class OraclePolicy(KvAwarePolicy):
    """KvAwarePolicy whose per-candidate hit is read from the engines just before routing."""

    def __init__(self, load: LoadTracker, http: httpx.AsyncClient) -> None:
        super().__init__(load)
        self.http = http
        self._truth: dict[str, int] = {}

    def precise_capable(self, replica: Replica, adapter: str | None) -> bool:
        return True

    async def precise_hashes(self, candidates: Sequence[Replica], request: RequestInfo,
                             adapter: str | None) -> dict[str, tuple[int, ...]]:
        body = request.body
        r = await self.http.post(candidates[0].endpoint + "/tokenize",
                                 json={"model": MODEL, "messages": body["messages"], "add_generation_prompt": True})
        tokens = r.json()["tokens"]
        truth: dict[str, int] = {}

        async def ask(replica: Replica) -> None:
            answer = await self.http.post(replica.endpoint + "/debug/cached_blocks",
                                          json={"model": MODEL, "tokens": tokens})
            truth[replica.id] = answer.json()["cached_blocks"]

        async with trio.open_nursery() as nursery:
            for replica in candidates:
                nursery.start_soon(ask, replica)
        self._truth = truth
        total = tuple(range(len(tokens) // BLOCK_SIZE))
        return {replica.id: total for replica in candidates}

    def precise_match(self, replica: Replica, hashes: Sequence[int]) -> int:
        return self._truth.get(replica.id, 0)


class PinnedTenants(RoutingPolicy):
    """The client-side oracle: each tenant's conversations all go to one replica (tenant i to
    replica i mod n), so no replica ever holds another's tenants' prefixes. Best hit rate
    when tenants are many and even; a hot spot when one tenant dominates."""

    def choose(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica:
        tenant = int(str(request.body.get("user", "tenant0")).removeprefix("tenant"))
        return candidates[tenant % len(candidates)]


class Kinds(RoutingObserver):
    """Counts decisions by kind, and the router's hit-share estimate (the gateway's
    ``routing_matched_blocks`` / ``routing_prompt_blocks`` metrics)."""

    def __init__(self) -> None:
        self.kinds: collections.Counter[str] = collections.Counter()
        self.matched = self.total = 0

    def decision(self, model: str, kind: str, matched: int, total: int) -> None:
        self.kinds[kind] += 1
        self.matched += matched
        self.total += total


# -- one run -----------------------------------------------------------------------------


def p99(values: list[float]) -> float:
    """Return the nearest-rank 99th percentile of ``values`` (bench.rpc's rule), 0 if none."""
    return percentile(sorted(values), 0.99) if values else 0.0


async def settle(http: httpx.AsyncClient, replicas: list[Replica], subs: list[KvSubscriber]) -> None:
    """Clear every engine's cache and wait until every subscriber's mirror is empty."""
    for replica in replicas:
        (await http.post(replica.endpoint + "/reset_prefix_cache")).raise_for_status()
    with trio.fail_after(SETTLE_TIMEOUT_S):
        while any(s.mirror.blocks or s.mirror.has_pending for s in subs):
            await trio.sleep(0.02)


async def run_policy(name: str, make: Any, convs: list[list[dict[str, Any]]], w: Workload, shape: EngineShape,
                     replicas: list[Replica], subs: list[KvSubscriber], sink: EventSink,
                     http: httpx.AsyncClient, gateways: int = 1) -> dict[str, Any]:
    """Run the request stream under one policy (one instance per gateway, each with its own
    load tracker; requests spread over gateways at random); return its figures."""
    await settle(http, replicas, subs)
    routers = [(make(load), load) for load in (LoadTracker() for _ in range(gateways))]
    kinds = Kinds()
    upstream = UpstreamClient()
    for policy, _ in routers:
        if isinstance(policy, KvAwarePolicy):
            policy.attach_observer(kinds)
            policy.bind_upstream(upstream)
            if name == "precise":
                for replica, sub in zip(replicas, subs):
                    policy.index.apply(replica.id, sub.full_copy())
                sink.policies.append(policy)
    pick = random.Random(5)
    ttfts: list[float] = []
    route_s: list[float] = []
    cached = prompt = 0
    per_replica: collections.Counter[str] = collections.Counter()
    queue = iter(convs)
    failures = 0

    async def one(body: dict[str, Any]) -> None:
        nonlocal cached, prompt, failures
        body = {**body, "max_tokens": shape.max_tokens}
        info = RequestInfo("/v1/chat/completions", MODEL, stream=True, body=body)
        policy, load = routers[pick.randrange(gateways)]
        t0 = time.perf_counter()
        route = policy.route(replicas, info)
        route = route if isinstance(route, Route) else await route
        replica = route.replica
        route_s.append(time.perf_counter() - t0)
        per_replica[replica.id] += 1
        lease = load.acquire(replica.id, route.prefill_tokens, route.on_first_token)
        try:
            first: float | None = None
            async with http.stream("POST", replica.endpoint + "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    failures += 1
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk.get("choices"):
                        first = time.perf_counter()
                        lease.first_token()
                    usage = chunk.get("usage")
                    if usage:
                        prompt += usage["prompt_tokens"]
                        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            ttfts.append((first or time.perf_counter()) - t0)
        finally:
            lease.release()

    # Interleaving: ACTIVE_PER_WORKER x concurrency conversations are open at once; a worker
    # takes the next due turn of any of them, and a conversation's next turn goes to the back
    # of the line (the user's think time), so consecutive turns are separated by others.
    due: collections.deque[tuple[list[dict[str, Any]], int]] = collections.deque()
    for _ in range(ACTIVE_PER_WORKER * w.concurrency):
        bodies = next(queue, None)
        if bodies is not None:
            due.append((bodies, 0))

    async def worker() -> None:
        while due:
            bodies, turn = due.popleft()
            await one(bodies[turn])
            if turn + 1 < len(bodies):
                due.append((bodies, turn + 1))
            else:
                following = next(queue, None)
                if following is not None:
                    due.append((following, 0))

    started = time.perf_counter()
    try:
        async with trio.open_nursery() as nursery:
            for _ in range(w.concurrency):
                nursery.start_soon(worker)
    finally:
        sink.policies = []
        await upstream.aclose()
    elapsed = time.perf_counter() - started
    counts = [per_replica.get(r.id, 0) for r in replicas]
    mean = sum(counts) / len(counts)
    result = {
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_mean_ms": round(statistics.fmean(ttfts) * 1000, 2) if ttfts else 0.0,
        "ttft_p99_ms": round(p99(ttfts) * 1000, 2),
        "load_spread": round(max(counts) / mean, 3) if mean else 0.0,
        "requests_per_replica": counts,
        "route_mean_ms": round(statistics.fmean(route_s) * 1000, 3) if route_s else 0.0,
        "route_p99_ms": round(p99(route_s) * 1000, 3),
        "decisions": dict(kinds.kinds),
        "requests": len(ttfts),
        "failures": failures,
        "seconds": round(elapsed, 2),
    }
    if name == "precise":
        result["tokenize_calls"] = sum(p.hasher.calls for p, _ in routers)
        result["tokenize_failures"] = sum(p.hasher.failures for p, _ in routers)
        result["hash_alarms"] = [a for p, _ in routers for a in p.alarms()]
        # What the gateway's metrics would claim, beside the engines' own hit rate above.
        result["router_estimated_hit_rate"] = round(kinds.matched / kinds.total, 4) if kinds.total else None
    log(f"  {name}: hit {result['hit_rate']:.3f}, ttft mean {result['ttft_mean_ms']} ms "
        f"p99 {result['ttft_p99_ms']} ms, spread {result['load_spread']}, {counts}, {result['seconds']} s")
    return result


POLICY_NAMES = ("round-robin", "least-load", "approximate", "precise", "oracle", "pinned")


def policy_factory(name: str, http: httpx.AsyncClient) -> Any:
    if name == "round-robin":
        return lambda load: RoundRobin()
    if name == "least-load":
        return lambda load: LeastOutstanding(load)
    if name in ("approximate", "precise"):
        return lambda load: KvAwarePolicy(load)
    if name == "oracle":
        return lambda load: OraclePolicy(load, http)
    if name == "pinned":
        return lambda load: PinnedTenants()
    raise ValueError(name)


# -- router cost -------------------------------------------------------------------------


class CachedHasher:
    """Hands back precomputed hashes: the decision's cost without the /tokenize round trip."""

    def __init__(self, hashes: tuple[int, ...]) -> None:
        self.value = hashes
        self.calls = self.failures = 0

    def bind(self, client: Any) -> None:
        pass

    async def hashes(self, replica: Replica, request: RequestInfo, block_size: int, lora: Any) -> tuple[int, ...]:
        return self.value


def timed(fn: Any, runs: int) -> float:
    """Return the median seconds of ``fn()`` over ``runs`` calls."""
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


async def router_cost(quick: bool, replicas: list[Replica], http: httpx.AsyncClient) -> dict[str, Any]:
    """Measure the router's per-request costs at 8k-token prompts and a 1,000,000-block index."""
    runs = 50 if quick else 200
    rng = random.Random(7)
    tokens = [rng.randrange(100, 50_000) for _ in range(8192)]
    hashes = tuple(kvhash.event_hashes(kvhash.block_hashes(tokens, BLOCK_SIZE, seed=kvhash.KV_HASH_SEED)))
    rss0 = psutil.Process().memory_info().rss
    index = KvIndex()
    per_replica = 1_000_000 // REPLICAS
    cands = [Replica(f"c{i}", MODEL, f"http://{HOST}:{i + 1}", engine="vllm") for i in range(REPLICAS)]
    for i, r in enumerate(cands):
        own = hashes[: len(hashes) // (i + 1)]  # c0 holds the whole prompt, c1 half, ...
        filler = tuple(rng.getrandbits(64) for _ in range(per_replica - len(own)))
        index.apply(r.id, KvDelta(reset=True, stored=filler + own, block_size=BLOCK_SIZE))
    gc.collect()
    index_mb = (psutil.Process().memory_info().rss - rss0) / 2**20
    load = LoadTracker()
    policy = KvAwarePolicy(load, index=index, hasher=CachedHasher(hashes))  # type: ignore[arg-type]
    text = " ".join(WORDS[t % len(WORDS)] for t in tokens)  # ~8k tokens of chat text
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    info = RequestInfo("/v1/chat/completions", MODEL, body=body)

    def decide() -> None:
        coro = policy.decide(cands, info)
        try:
            coro.send(None)  # nothing in it awaits: it finishes on the first step
        except StopIteration:
            return
        raise RuntimeError("decide() suspended")

    least = LeastOutstanding(load)

    memo = kvhash.BlockHashMemo()
    memo.event_hashes(tokens[:-512], BLOCK_SIZE, seed=kvhash.KV_HASH_SEED)
    tails = iter([[rng.randrange(100, 50_000) for _ in range(512)] for _ in range(runs)])

    figures = {
        "index_blocks": len(index),
        "index_rss_mb": round(index_mb, 1),
        "prompt_tokens": len(tokens),
        "prompt_blocks": len(hashes),
        "index_match_4_replicas_us": round(timed(lambda: [index.leading_match(r.id, hashes) for r in cands], runs) * 1e6, 1),
        "prefix_tree_path_us": round(timed(lambda: path_hashes(prompt_text(body)), runs) * 1e6, 1),
        "decision_us": round(timed(decide, runs) * 1e6, 1),
        "hash_8k_tokens_ms": round(timed(lambda: kvhash.event_hashes(
            kvhash.block_hashes(tokens, BLOCK_SIZE, seed=kvhash.KV_HASH_SEED)), max(5, runs // 10)) * 1e3, 2),
        # A conversation's next turn: the earlier turns' 7,680 tokens were hashed before
        # (BlockHashMemo, as the router's TokenHasher keeps it), 512 new tokens are not.
        "hash_8k_next_turn_ms": round(timed(lambda: memo.event_hashes(
            tokens[:-512] + next(tails), BLOCK_SIZE, seed=kvhash.KV_HASH_SEED), runs) * 1e3, 3),
        "single_candidate_choose_us": round(timed(lambda: policy.choose(cands[:1], info), runs * 10) * 1e6, 2),
        "least_load_choose_us": round(timed(lambda: least.choose(cands, info), runs * 10) * 1e6, 2),
    }
    # /tokenize round trips on a simulated engine (loopback HTTP), short and 8k-token chat prompts.
    for label, content in (("short", "what is the capital of france?"), ("8k", text)):
        samples = []
        for _ in range(10 if quick else 30):
            t0 = time.perf_counter()
            r = await http.post(replicas[0].endpoint + "/tokenize",
                                json={"model": MODEL, "messages": [{"role": "user", "content": content}],
                                      "add_generation_prompt": True})
            r.raise_for_status()
            samples.append(time.perf_counter() - t0)
        figures[f"tokenize_{label}_ms"] = round(statistics.median(samples) * 1e3, 2)
    return figures


# -- main --------------------------------------------------------------------------------


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    shape = EngineShape(num_blocks=args.num_blocks, prefill_us_per_token=args.prefill_us,
                        decode_us_per_token=args.decode_us, max_tokens=8)
    normal = Workload(tenants=args.tenants, conversations=40 if quick else 120, turns=5 if quick else 6,
                      system_words=args.system_words, user_words=args.user_words, answer_words=args.answer_words,
                      concurrency=args.concurrency)
    hot = attrs.evolve(normal, hot_share=0.7)
    log(f"starting {REPLICAS} engines ({shape})")
    sims, endpoints = await trio.to_thread.run_sync(lambda: start_engines(shape, REPLICAS))
    replicas = [Replica(f"r{i}", MODEL, sim.url, "bench", engine="sim") for i, sim in enumerate(sims)]
    subs = [KvSubscriber(ep, replay, block_size=BLOCK_SIZE) for ep, replay in endpoints]
    sink = EventSink()
    result: dict[str, Any] = {"quick": quick, "replicas": REPLICAS, "engine": attrs.asdict(shape),
                              "workload": attrs.asdict(normal), "hot_workload": attrs.asdict(hot)}
    try:
        async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
            for replica, sub in zip(replicas, subs):
                await nursery.start(sub.run, sink.sender(replica.id))
            uniform = conversations(normal, seed=11)  # also the two-gateway pass's stream
            for label, workload, convs in (("uniform", normal, uniform),
                                           ("hot_tenant", hot, conversations(hot, seed=11))):
                log(f"{label}: {len(convs)} conversations x {workload.turns} turns, concurrency {workload.concurrency}")
                result[label] = {}
                for name in POLICY_NAMES:
                    result[label][name] = await run_policy(name, policy_factory(name, http), convs, workload, shape,
                                                           replicas, subs, sink, http)
            convs = uniform
            log("two_gateways: the uniform stream, each request through one of two routers at random")
            result["two_gateways"] = {}
            for name in ("least-load", "approximate", "precise"):
                result["two_gateways"][name] = await run_policy(name, policy_factory(name, http), convs, normal, shape,
                                                                replicas, subs, sink, http, gateways=2)
            log("router cost")
            result["router_cost"] = await router_cost(quick, replicas, http)
            nursery.cancel_scope.cancel()
    finally:
        for sim in sims:
            sim.stop()
    uni, hot_run = result["uniform"], result["hot_tenant"]
    oracle = uni["oracle"]["hit_rate"]
    result["precise_vs_oracle_hit_rate"] = round(uni["precise"]["hit_rate"] / oracle, 4) if oracle else 0.0
    result["hot_precise_vs_oracle_hit_rate"] = (round(hot_run["precise"]["hit_rate"] / hot_run["oracle"]["hit_rate"], 4)
                                                if hot_run["oracle"]["hit_rate"] else 0.0)
    result["hot_precise_load_spread"] = hot_run["precise"]["load_spread"]
    result["precise_vs_round_robin_ttft_mean"] = (round(uni["precise"]["ttft_mean_ms"] / uni["round-robin"]["ttft_mean_ms"], 3)
                                                  if uni["round-robin"]["ttft_mean_ms"] else 0.0)
    two = result["two_gateways"]
    result["two_gateways_precise_vs_approximate_hit_rate"] = (
        round(two["precise"]["hit_rate"] / two["approximate"]["hit_rate"], 4) if two["approximate"]["hit_rate"] else 0.0)
    result["targets_met"] = {
        "precise_vs_oracle_hit_rate>=0.95": result["precise_vs_oracle_hit_rate"] >= 0.95,
        "hot_tenant_max_load<=1.5x_mean": result["hot_precise_load_spread"] <= 1.5,
    }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer conversations (under five minutes)")
    parser.add_argument("--concurrency", type=int, default=8, help="conversations in flight at once")
    parser.add_argument("--num-blocks", type=int, default=256, help="KV blocks per engine")
    parser.add_argument("--tenants", type=int, default=12, help="tenants (each with its own system prompt)")
    parser.add_argument("--system-words", type=int, default=250, help="words in each tenant's system prompt")
    parser.add_argument("--user-words", type=int, default=40, help="words in each question")
    parser.add_argument("--answer-words", type=int, default=80, help="words in each earlier answer")
    parser.add_argument("--prefill-us", type=float, default=400.0, help="engine prefill time per uncached token (us)")
    parser.add_argument("--decode-us", type=float, default=2000.0, help="engine time per generated token (us)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = trio.run(main_async, args)
    result["total_seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
