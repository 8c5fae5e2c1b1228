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
cleared between runs. The hot-tenant variant gives one tenant most of the conversations.

Several gateways (``--gateways N ...``, default 1 2 3): with several control planes every
one runs a gateway, each with its own router (its own ``KvAwarePolicy``: prefix tree,
routed-but-unconfirmed blocks, TTFT fit) and its own in-flight counts (``LoadTracker``),
while all of them get every replica's KV deltas (the leader's ``FeedTee`` streams them to
the standbys, llmgw/control/peers.py). The gateways section runs the uniform stream through
N such routers, request i to gateway i mod N (a round-robin load balancer in front of
them), every delta applied to every router's own ``KvIndex`` (after the same full copy a
standby attaches with), and compares each N's hit rate with N = 1's
(``ratios.gateways_<N>_vs_1_hit_rate``). Per N it also reports what the routers could not
see of each other: decisions where another gateway had routed more of the request's prefix
to some replica (its unconfirmed blocks) than this one knew anywhere, and the share of the
queued prefill work on the candidates that the deciding gateway counted.

Policies, all driven in this process on the same request stream (requests go over HTTP,
streamed, straight to the chosen engine, counted in the deciding gateway's ``LoadTracker``
while in flight, its first chunk reported to the lease as the gateway does):

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
blocks, hashing 8k tokens, ``/tokenize`` round trips. ``--only SECTION ...`` runs some of
the sections (uniform, hot_tenant, gateways, router_cost). Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
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
from llmgw.router.tokens import TokenHasher
from llmgw.router.kvrouting import KvAwarePolicy, RoundRobin
from llmgw.router.prefixtree import path_hashes, prompt_text
from llmgw.router.replicas import LeastOutstanding, LoadTracker, Replica, RequestInfo, Route, RoutingObserver, RoutingPolicy
from llmgw.router.usage import usage_of
from llmgw.sim.launch import DEFAULT_START_TIMEOUT_S, SimProcess, free_tcp_port, start_sim
from llmgw.spec import KvDelta

from bench import localtokens
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


class Blindness:
    """What the gateways of one run could not see of each other (summed over decisions)."""

    def __init__(self) -> None:
        self.decisions = 0
        self.peer_unseen = 0  # decisions where a peer had routed more of the prefix somewhere
        self.peer_unseen_blocks = 0  # blocks of those decisions' prompts the peer knew and this one did not
        self.prompt_blocks = 0
        self.diverted = 0  # chose a replica holding less of the prefix than its best (by its own view)
        self.own_work = 0.0  # queued prefill work on the candidates, counted by the deciding gateway
        self.all_work = 0.0  # ... and counted by all gateways together (what the engines really queue)

    def figures(self) -> dict[str, Any]:
        n = self.decisions
        return {
            "peer_unseen_decisions": self.peer_unseen,
            "peer_unseen_decision_share": round(self.peer_unseen / n, 4) if n else 0.0,
            "peer_unseen_block_share": round(self.peer_unseen_blocks / self.prompt_blocks, 4) if self.prompt_blocks else 0.0,
            "diverted_decisions": self.diverted,
            "queued_work_visible_share": round(self.own_work / self.all_work, 3) if self.all_work else 1.0,
        }


class GatewayRouter(KvAwarePolicy):
    """One gateway's :class:`KvAwarePolicy`, unchanged, with a look at its peers before each
    decision: how much of the request's prefix each peer's view (KV index plus its routed but
    unconfirmed blocks) puts on each candidate against this router's own view, and how much of
    the candidates' queued prefill work this router's own load tracker counts. Only reads."""

    def __init__(self, load: LoadTracker, peers: list[GatewayRouter], blind: Blindness) -> None:
        super().__init__(load)
        self.peers = peers  # every gateway's router, this one included
        self.blind = blind
        self._views: dict[str, tuple[int, int]] | None = None  # replica -> (own match, best peer's match)

    async def precise_hashes(self, candidates: Sequence[Replica], request: RequestInfo,
                             adapter: str | None) -> dict[str, tuple[int, ...]]:
        out = await super().precise_hashes(candidates, request, adapter)
        # decide() prices and records right after this returns, with no await in between: the
        # views below are the ones it decides on.
        blind = self.blind
        blind.decisions += 1
        for r in candidates:
            blind.own_work += self.load.prefill.work_ahead(r.id)
            blind.all_work += sum(p.load.prefill.work_ahead(r.id) for p in self.peers)
        self._views = None
        hashes = next(iter(out.values()), None)
        if hashes:
            self._views = {r.id: (self.precise_match(r, hashes),
                                  max((p.precise_match(r, hashes) for p in self.peers if p is not self), default=0))
                           for r in candidates}
            blind.prompt_blocks += len(hashes)
        return out

    async def decide(self, candidates: Sequence[Replica], request: RequestInfo) -> Any:
        self._views = None
        decision = await super().decide(candidates, request)
        views = self._views
        if views and decision.replica.id in views:
            own_best = max(own for own, _ in views.values())
            peer_best = max(peer for _, peer in views.values())
            chosen_own = views[decision.replica.id][0]
            if own_best > chosen_own:
                self.blind.diverted += 1
            if peer_best > own_best and views[decision.replica.id][1] < peer_best:
                self.blind.peer_unseen += 1
                self.blind.peer_unseen_blocks += peer_best - chosen_own
        return decision


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
                     http: httpx.AsyncClient, gateways: int = 1, label: str = "") -> dict[str, Any]:
    """Run the request stream under one policy, as ``gateways`` gateways: one policy instance
    per gateway (``make(load)``, each on its own load tracker; with the precise policy each is
    fed every KV delta into its own index), request i through gateway i mod ``gateways``;
    return its figures."""
    await settle(http, replicas, subs)
    routers = [(make(load), load) for load in (LoadTracker() for _ in range(gateways))]
    kinds = [Kinds() for _ in routers]
    upstream = UpstreamClient()
    for (policy, _), observer in zip(routers, kinds):
        if isinstance(policy, KvAwarePolicy):
            policy.attach_observer(observer)
            policy.bind_upstream(upstream)
            if name == "precise":
                # A standby attaching to the leader's feed gets a full copy, then every delta.
                for replica, sub in zip(replicas, subs):
                    policy.index.apply(replica.id, sub.full_copy())
                sink.policies.append(policy)
    sent = itertools.count()
    ttfts: list[float] = []
    route_s: list[float] = []
    cached = prompt = 0
    per_replica: collections.Counter[str] = collections.Counter()
    per_gateway: collections.Counter[int] = collections.Counter()
    by_seq: list[tuple[int, int, int]] = []  # (request number, cached tokens, prompt tokens)
    queue = iter(convs)
    failures = 0

    async def one(body: dict[str, Any]) -> None:
        nonlocal cached, prompt, failures
        body = {**body, "max_tokens": shape.max_tokens}
        info = RequestInfo("/v1/chat/completions", MODEL, stream=True, body=body)
        seq = next(sent)
        gateway = seq % gateways  # a round-robin load balancer in front of the gateways
        policy, load = routers[gateway]
        t0 = time.perf_counter()
        route = policy.route(replicas, info)
        route = route if isinstance(route, Route) else await route
        replica = route.replica
        route_s.append(time.perf_counter() - t0)
        per_replica[replica.id] += 1
        per_gateway[gateway] += 1
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
                    usage = usage_of(chunk.get("usage"))
                    if usage is not None:
                        if route.on_usage is not None:  # as the gateway tells the policy (app.py)
                            route.on_usage(usage)
                        prompt += usage.prompt_tokens
                        cached += usage.cached_tokens
                        by_seq.append((seq, usage.cached_tokens, usage.prompt_tokens))
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
    decisions: collections.Counter[str] = sum((k.kinds for k in kinds), collections.Counter())
    matched, total = sum(k.matched for k in kinds), sum(k.total for k in kinds)
    result = {
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_mean_ms": round(statistics.fmean(ttfts) * 1000, 2) if ttfts else 0.0,
        "ttft_p99_ms": round(p99(ttfts) * 1000, 2),
        "load_spread": round(max(counts) / mean, 3) if mean else 0.0,
        "hit_rate_by_quarter": quarters(by_seq),
        "requests_per_replica": counts,
        "route_mean_ms": round(statistics.fmean(route_s) * 1000, 3) if route_s else 0.0,
        "route_p99_ms": round(p99(route_s) * 1000, 3),
        "decisions": dict(decisions),
        "requests": len(ttfts),
        "failures": failures,
        "seconds": round(elapsed, 2),
    }
    if name == "precise":
        result["tokenize_calls"] = sum(p.hasher.calls for p, _ in routers)
        result["tokenize_failures"] = sum(p.hasher.failures for p, _ in routers)
        result["hash_alarms"] = [a for p, _ in routers for a in p.alarms()]
        # What the gateway's metrics would claim, beside the engines' own hit rate above.
        result["router_estimated_hit_rate"] = round(matched / total, 4) if total else None
    if gateways > 1:
        result["gateways"] = gateways
        result["per_gateway"] = [{"requests": per_gateway[g], "decisions": dict(k.kinds)} for g, k in enumerate(kinds)]
    blind = getattr(routers[0][0], "blind", None)
    extra = ""
    if isinstance(blind, Blindness):
        result.update(blind.figures())
        extra = (f", peer-unseen {result['peer_unseen_decisions']}, diverted {result['diverted_decisions']}, "
                 f"queue visible {result['queued_work_visible_share']}")
    log(f"  {label or name}: hit {result['hit_rate']:.3f}, ttft mean {result['ttft_mean_ms']} ms "
        f"p99 {result['ttft_p99_ms']} ms, spread {result['load_spread']}, {counts}, {result['seconds']} s{extra}")
    return result


def quarters(by_seq: list[tuple[int, int, int]]) -> list[float]:
    """Return the hit rate of each quarter of the run's requests, in the order they were sent
    (the first quarter includes every router's warm-up: TTFT fits still near their prior)."""
    n = max((seq for seq, _, _ in by_seq), default=-1) + 1
    cached, prompt = [0] * 4, [0] * 4
    for seq, hit, tokens in by_seq:
        q = min(3, seq * 4 // n)
        cached[q] += hit
        prompt[q] += tokens
    return [round(c / p, 4) if p else 0.0 for c, p in zip(cached, prompt)]


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


def gateway_factory(name: str, http: httpx.AsyncClient) -> Any:
    """Return a factory of one run's gateways under policy ``name``: for the KV-aware
    policies each made router is a :class:`GatewayRouter` that knows its peers (one list
    and one :class:`Blindness` per run, so the factory is made afresh for every run)."""
    if name not in ("approximate", "precise"):
        return policy_factory(name, http)
    peers: list[GatewayRouter] = []
    blind = Blindness()

    def make(load: LoadTracker) -> GatewayRouter:
        router = GatewayRouter(load, peers, blind)
        peers.append(router)
        return router

    return make


#: Figures of a gateways run whose median over rounds is reported (the rest are per round).
ROUND_MEDIANS = ("hit_rate", "ttft_mean_ms", "ttft_p99_ms", "load_spread", "route_mean_ms", "router_estimated_hit_rate",
                 "peer_unseen_decisions", "peer_unseen_decision_share", "peer_unseen_block_share",
                 "diverted_decisions", "queued_work_visible_share", "seconds")


def over_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Return one run's figures as they are, several runs' medians (with each run under ``by_round``)."""
    if len(runs) == 1:
        return runs[0]
    out: dict[str, Any] = {key: round(statistics.median(run[key] for run in runs), 4)
                           for key in ROUND_MEDIANS if all(isinstance(run.get(key), (int, float)) for run in runs)}
    out["by_round"] = runs
    return out


def ratio(a: float | None, b: float | None, digits: int = 4) -> float:
    return round(a / b, digits) if a is not None and b else 0.0


# -- router cost -------------------------------------------------------------------------


class CachedHasher(TokenHasher):
    """Hands back precomputed hashes: the decision's cost without the /tokenize round trip."""

    def __init__(self, hashes: tuple[int, ...]) -> None:
        super().__init__()
        self.value = hashes

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
    # The gateway tokenizing itself (bench/localtokens.py): a 4k-token conversation's next turn.
    figures["local_tokenizer"] = localtokens.measure(runs)
    return figures


# -- main --------------------------------------------------------------------------------


SECTIONS = ("uniform", "hot_tenant", "gateways", "router_cost")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    sections = set(args.only or SECTIONS)
    shape = EngineShape(num_blocks=args.num_blocks, prefill_us_per_token=args.prefill_us,
                        decode_us_per_token=args.decode_us, max_tokens=8)
    normal = Workload(tenants=args.tenants, conversations=args.conversations or (40 if quick else 120),
                      turns=5 if quick else 6, system_words=args.system_words, user_words=args.user_words,
                      answer_words=args.answer_words, concurrency=args.concurrency)
    hot = attrs.evolve(normal, hot_share=0.7)
    counts = sorted({1, *args.gateways})  # 1 is the baseline, always run
    log(f"starting {REPLICAS} engines ({shape})")
    sims, endpoints = await trio.to_thread.run_sync(lambda: start_engines(shape, REPLICAS))
    replicas = [Replica(f"r{i}", MODEL, sim.url, "bench", engine="sim") for i, sim in enumerate(sims)]
    subs = [KvSubscriber(ep, replay, block_size=BLOCK_SIZE) for ep, replay in endpoints]
    sink = EventSink()
    result: dict[str, Any] = {"quick": quick, "replicas": REPLICAS, "engine": attrs.asdict(shape),
                              "workload": attrs.asdict(normal), "hot_workload": attrs.asdict(hot),
                              "sections": [name for name in SECTIONS if name in sections]}
    try:
        async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
            for replica, sub in zip(replicas, subs):
                await nursery.start(sub.run, sink.sender(replica.id))
            uniform = conversations(normal, seed=args.seed)  # also the gateways section's stream
            for label, workload, convs in (("uniform", normal, uniform),
                                           ("hot_tenant", hot, conversations(hot, seed=args.seed))):
                if label not in sections:
                    continue
                log(f"{label}: {len(convs)} conversations x {workload.turns} turns, concurrency {workload.concurrency}")
                result[label] = {}
                for name in args.policies:
                    result[label][name] = await run_policy(name, policy_factory(name, http), convs, workload, shape,
                                                           replicas, subs, sink, http)
            if "gateways" in sections:
                log(f"gateways: the uniform stream through N = {counts} gateways (request i to gateway i mod N), "
                    f"{args.gateway_rounds} round(s), policies {args.gateway_policies}")
                runs: dict[str, dict[int, list[dict[str, Any]]]] = {
                    name: {n: [] for n in counts} for name in args.gateway_policies}
                for round_no in range(args.gateway_rounds):
                    for n in counts:  # interleaved, so every N sees the same machine state
                        for name in args.gateway_policies:
                            runs[name][n].append(await run_policy(
                                name, gateway_factory(name, http), uniform, normal, shape, replicas, subs, sink, http,
                                gateways=n, label=f"{name}, {n} gateway(s), round {round_no + 1}"))
                result["gateways"] = {"counts": counts, "rounds": args.gateway_rounds, "dispatch": "round-robin",
                                      **{name: {str(n): over_rounds(runs[name][n]) for n in counts}
                                         for name in args.gateway_policies}}
                result["gateways"]["summary"] = {
                    name: {str(n): {key: result["gateways"][name][str(n)].get(key)
                                    for key in ("hit_rate", "ttft_mean_ms", "ttft_p99_ms", "load_spread",
                                                "peer_unseen_decision_share", "queued_work_visible_share")}
                           for n in counts}
                    for name in args.gateway_policies}
            if "router_cost" in sections:
                log("router cost")
                result["router_cost"] = await router_cost(quick, replicas, http)
            nursery.cancel_scope.cancel()
    finally:
        for sim in sims:
            sim.stop()
    targets: dict[str, bool] = {}
    if "uniform" in result and {"precise", "oracle", "round-robin"} <= result["uniform"].keys():
        uni = result["uniform"]
        result["precise_vs_oracle_hit_rate"] = ratio(uni["precise"]["hit_rate"], uni["oracle"]["hit_rate"])
        result["precise_vs_round_robin_ttft_mean"] = ratio(uni["precise"]["ttft_mean_ms"],
                                                           uni["round-robin"]["ttft_mean_ms"], 3)
        targets["precise_vs_oracle_hit_rate>=0.95"] = result["precise_vs_oracle_hit_rate"] >= 0.95
    if "hot_tenant" in result and {"precise", "oracle"} <= result["hot_tenant"].keys():
        hot_run = result["hot_tenant"]
        result["hot_precise_vs_oracle_hit_rate"] = ratio(hot_run["precise"]["hit_rate"], hot_run["oracle"]["hit_rate"])
        result["hot_precise_load_spread"] = hot_run["precise"]["load_spread"]
        targets["hot_tenant_max_load<=1.5x_mean"] = result["hot_precise_load_spread"] <= 1.5
    if "gateways" in result:
        gw = result["gateways"]
        ratios: dict[str, float] = {}
        by_round: dict[str, float] = {}
        for name in args.gateway_policies:
            prefix = "gateways" if name == "precise" else f"gateways_{name}"
            base = gw[name]["1"]
            for n in counts[1:]:
                this = gw[name][str(n)]
                ratios[f"{prefix}_{n}_vs_1_hit_rate"] = ratio(this["hit_rate"], base["hit_rate"])
                ratios[f"{prefix}_{n}_vs_1_ttft_mean"] = ratio(this["ttft_mean_ms"], base["ttft_mean_ms"], 3)
                if args.gateway_rounds > 1:  # the median of each round's own ratio (N and 1 ran minutes apart)
                    by_round[f"{prefix}_{n}_vs_1_hit_rate"] = round(statistics.median(
                        ratio(a["hit_rate"], b["hit_rate"]) for a, b in zip(runs[name][n], runs[name][1])), 4)
        if "approximate" in args.gateway_policies and "precise" in args.gateway_policies:
            for n in counts:
                ratios[f"gateways_{n}_precise_vs_approximate_hit_rate"] = ratio(gw["precise"][str(n)]["hit_rate"],
                                                                                gw["approximate"][str(n)]["hit_rate"])
        result["ratios"] = ratios
        if by_round:
            result["ratios_by_round"] = by_round
        if "gateways_3_vs_1_hit_rate" in ratios:
            targets["gateways_3_vs_1_hit_rate>=0.95"] = ratios["gateways_3_vs_1_hit_rate"] >= 0.95
    result["targets_met"] = targets
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
    parser.add_argument("--conversations", type=int, default=0, help="conversations per run (default 40 quick, 120 full)")
    parser.add_argument("--seed", type=int, default=11, help="seed of the conversations")
    parser.add_argument("--gateways", type=int, nargs="*", default=[2, 3], metavar="N",
                        help="gateway counts of the gateways section (1, the baseline, is always added; "
                             "default and given without values: 1 2 3)")
    parser.add_argument("--gateway-policies", nargs="+", default=["precise"], choices=("precise", "approximate", "least-load"),
                        help="policies the gateways section runs at every N (default: precise)")
    parser.add_argument("--gateway-rounds", type=int, default=0,
                        help="rounds of the gateways section, N interleaved, medians over them (default 3; quick 2)")
    parser.add_argument("--policies", nargs="+", choices=POLICY_NAMES, default=list(POLICY_NAMES), metavar="POLICY",
                        help=f"policies the uniform and hot-tenant sections run (default: all of {', '.join(POLICY_NAMES)})")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, metavar="SECTION",
                        help=f"run only these sections ({', '.join(SECTIONS)}; default: all)")
    args = parser.parse_args(argv)
    if not args.gateways:
        args.gateways = [2, 3]
    args.gateway_rounds = args.gateway_rounds or (2 if args.quick else 3)
    if any(n < 1 for n in args.gateways) or args.gateway_rounds < 1:
        parser.error("--gateways and --gateway-rounds take positive counts")
    started = time.perf_counter()
    result = trio.run(main_async, args)
    result["total_seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
