"""GatewayPool: real gateway worker processes on one port, fed by a master gateway object.

One simulated engine (``python -m llmgw.sim``) behind a pool of 2 workers
(``build_gateway`` with ``gateway.workers: 2``); every request opens a fresh connection,
so the kernel spreads them over the workers (SO_REUSEPORT). The KV-routing tests use two
more engines as two replicas of one model and feed the pool KV deltas as the control
plane does (through the gateway interface).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest
import trio

from llmgw import kvhash
from llmgw.catalog import generate_key
from llmgw.config import AuthConfig, GatewayConfig, RoutingConfig
from llmgw.router.app import Gateway
from llmgw.router.auth import KeyEntry, Tenant
from llmgw.router.build import build_gateway
from llmgw.router.interface import AccessState, AdmissionShares
from llmgw.router.kvindex import KvIndex
from llmgw.router.kvrouting import ALARM_TEXT
from llmgw.router.replicas import ModelInfo, Replica
from llmgw.router.settings import GatewaySettings
from llmgw.router.workers import pool as gateway_pool
from llmgw.router.workers.channel import Message
from llmgw.router.workers.pool import GatewayPool, WorkerStartError
from llmgw.router.workers.protocol import decode_kv_delta
from llmgw.sim.launch import start_sim
from llmgw.spec import MAX_HASHES_PER_DELTA, KvDelta

from tests.system.harness import alive, eventually, metric_sum

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
#: Fresh connections per check: with 2 workers, all landing on one is a 2^-29 chance.
CONNECTIONS = 30


@pytest.fixture(scope="module")
def engine() -> AsyncIterator[str]:
    sim = start_sim(["--model", "m", "--port", "0", "--prefill-us-per-token", "0", "--decode-us-per-token", "0"])
    try:
        yield f"http://{sim.host}:{sim.port}"
    finally:
        sim.stop()


class Pooled:
    def __init__(self, master: Gateway, pool: GatewayPool) -> None:
        self.master = master
        self.pool = pool
        self.url = ""

    async def post(self, headers: dict[str, str] | None = None, body: dict | None = None) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as http:  # one connection per request
            return await http.post("/v1/chat/completions", json=body or BODY, headers=headers or {})

    async def get(self, path: str) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as http:
            return await http.get(path)


def new_pool(routing: RoutingConfig = RoutingConfig()) -> GatewayPool:
    """Return a 2-worker pool, keys off, routing by ``routing``, as the server builds it."""
    pool = build_gateway(GatewaySettings(gateway=GatewayConfig(workers=2), auth=AuthConfig(enabled=False),
                                         routing=routing))
    assert isinstance(pool, GatewayPool)
    return pool


@contextlib.asynccontextmanager
async def running_pool(replicas: list[Replica], routing: RoutingConfig = RoutingConfig()) -> AsyncIterator[Pooled]:
    """A 2-worker pool serving model "m" on ``replicas`` with ``routing``; on exit, checks that
    no worker outlived it."""
    pool = new_pool(routing)
    pool.master.table.set_model_replicas("m", replicas)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(60):
            port = await nursery.start(pool.serve, "127.0.0.1", 0)
        handle = Pooled(pool.master, pool)
        handle.url = f"http://127.0.0.1:{port}"
        try:
            yield handle
        finally:
            pids = list(pool.pids.values())
            nursery.cancel_scope.cancel()
    assert pids and not any(alive(pid) for pid in pids), "a worker outlived the pool"


@pytest.fixture
async def pooled(engine: str) -> AsyncIterator[Pooled]:
    async with running_pool([Replica("r1", "m", engine)]) as handle:
        yield handle


async def test_each_worker_enforces_its_part_of_the_gateways_share_and_demand_comes_back(pooled: Pooled) -> None:
    pool = pooled.pool
    made = generate_key()
    pooled.master.auth.replace([KeyEntry(made.key_id, bytes.fromhex(made.secret_hash), Tenant("acme", rpm=40))])
    assert await pool.synced()
    # This gateway's share of acme's limits is half: each worker allows ceil(ceil(40 x 0.5) / 2) = 10 a minute.
    await pool.apply_admission_shares(AdmissionShares(0.5))
    assert all(slot.shares_applied >= 1 for slot in pool.slots.values())
    headers = {"authorization": f"Bearer {made.key}"}
    responses = [await pooled.post(headers) for _ in range(CONNECTIONS)]  # >= 15 on one worker: it sheds
    refused = [r.json()["error"]["message"] for r in responses if r.status_code == 429]
    assert refused and all("limit of 10 requests per minute (this gateway's share of 40)" in m for m in refused)
    await pool.collect()
    demand = pool.admission_demand()["acme"]
    assert demand.admitted + demand.shed == CONNECTIONS and demand.shed == len(refused)
    assert pool.admission_demand() == {}  # since the last call: nothing new


async def test_both_workers_serve_and_metrics_and_usage_add_up(pooled: Pooled) -> None:
    seen = set()
    for _ in range(CONNECTIONS):
        response = await pooled.post()
        assert response.status_code == 200, response.text
        seen.add(response.headers["x-llmgw-worker"])
    assert seen == {"0", "1"}

    metrics = await pooled.get("/metrics")
    assert metrics.status_code == 200
    count = re.search(r'llmgw_gateway_requests_total\{model="m",status="200",tenant="anonymous"\} (\S+)',
                      metrics.text)
    assert count is not None and float(count.group(1)) == CONNECTIONS, metrics.text

    await pooled.pool.collect()  # what `ctl usage` does first
    usage = pooled.master.usage.pending()[("anonymous", "m")]
    assert usage.requests == CONNECTIONS and usage.completion_tokens == 2 * CONNECTIONS
    admitted = pooled.master.admission.snapshot()["anonymous"]
    assert admitted.admitted == CONNECTIONS and admitted.in_flight == 0


async def test_state_changes_reach_every_worker_before_synced_returns(pooled: Pooled, engine: str) -> None:
    master, pool = pooled.master, pooled.pool

    async def statuses(headers: dict[str, str] | None = None) -> set[int]:
        return {(await pooled.post(headers)).status_code for _ in range(CONNECTIONS)}

    master.table.remove_model("m")  # catalog change
    assert await pool.synced()
    assert await statuses() == {404}
    master.table.set_model_replicas("m", [])  # replica change: in the catalog, none ready
    assert await pool.synced()
    assert await statuses() == {503}
    master.table.set_model_replicas("m", [Replica("r2", "m", engine)])
    assert await pool.synced()
    assert await statuses() == {200}
    # model info travels too: an adapter of "m" is listed (and so routable) by every worker
    master.table.replace_all({"m": [Replica("r2", "m", engine, "n", "sim", (("a1", "a1-v1"),))]},
                             {"m": ModelInfo("sim", ("a1",), 0)})
    assert await pool.synced()
    listings = set()
    for _ in range(CONNECTIONS):
        cards = (await pooled.get("/v1/models")).json()["data"]
        listings.add(tuple(sorted((c["id"], c["parent"]) for c in cards)))
    assert listings == {(("a1", "m"), ("m", None))}

    made = generate_key()
    master.auth.enabled = True  # the workers' switch is their own; here only keys travel
    master.auth.replace([KeyEntry(made.key_id, bytes.fromhex(made.secret_hash), Tenant("acme"))])
    assert await pool.synced()
    assert await statuses({"authorization": f"Bearer {made.key}"}) == {200}
    master.auth.replace([])  # revoked
    assert await pool.synced()
    # auth is off in these workers: a revoked key is served as anonymous, not as acme
    await pool.collect()
    before = master.usage.pending().get(("acme", "m"))
    await statuses({"authorization": f"Bearer {made.key}"})
    await pool.collect()
    assert master.usage.pending().get(("acme", "m")) == before

    await pool.apply_access(AccessState(stopped=True))  # as AccessSync.reload does
    assert master.stopped and await pool.synced()
    assert await statuses() == {503}
    await pool.apply_access(AccessState(stopped=False))
    assert not master.stopped and await pool.synced()
    assert await statuses() == {200}

    pool.set_readiness("rebuilding the replica table")  # as a starting control plane does
    assert await pool.synced()
    readyz = [await pooled.get("/readyz") for _ in range(CONNECTIONS)]
    assert {(r.status_code, r.json()["reason"]) for r in readyz} == {(503, "rebuilding the replica table")}
    assert await statuses() == {200}, "readiness is for load balancers; requests are still served"
    pool.set_readiness(None)
    assert await pool.synced()
    assert {(await pooled.get("/readyz")).status_code for _ in range(CONNECTIONS)} == {200}


async def test_a_killed_worker_is_restarted(pooled: Pooled) -> None:
    pool = pooled.pool
    victim = pool.pids[1]
    os.kill(victim, signal.SIGKILL)

    async def restarted() -> bool:
        slot = pool.slots.get(1)
        return slot is not None and slot.ready and pool.pids[1] != victim

    await eventually(restarted, "worker 1 restarted")
    seen = set()
    for _ in range(CONNECTIONS):
        response = await pooled.post()
        assert response.status_code == 200
        seen.add(response.headers["x-llmgw-worker"])
    assert seen == {"0", "1"}


async def test_a_worker_that_cannot_bind_fails_the_start(engine: str) -> None:
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # no SO_REUSEPORT: nobody may share it
    taken.listen()
    try:
        pool = new_pool()
        with pytest.raises(WorkerStartError, match="cannot bind the gateway"), trio.fail_after(60):
            await pool.serve("127.0.0.1", taken.getsockname()[1])
        assert not pool.slots
    finally:
        taken.close()


# -- KV-aware routing in the workers -----------------------------------------------------

#: The engines' block size (the sim's default, passed explicitly so the hashes agree).
BLOCK_SIZE = 16
#: A prompt of several full blocks.
KV_PROMPT = "Tell me everything about the history of the printing press in Europe, " * 6
#: Generous: /tokenize on a loaded 2-core machine must not turn a precise decision into
#: an approximate one (the test is about the KV index, not the tokenizer deadline).
KV_ROUTING = RoutingConfig(tokenize_timeout=10.0)


@pytest.fixture(scope="module")
def kv_engines() -> Iterator[tuple[str, str]]:
    """Two simulated engines serving model "m": replicas "ra" and "rb"."""
    args = ["--model", "m", "--port", "0", "--block-size", str(BLOCK_SIZE),
            "--prefill-us-per-token", "0", "--decode-us-per-token", "0"]
    a = start_sim(args)
    try:
        b = start_sim(args)
        try:
            yield a.url, b.url
        finally:
            b.stop()
    finally:
        a.stop()


@contextlib.asynccontextmanager
async def kv_pool(engines: tuple[str, str], routing: RoutingConfig = KV_ROUTING) -> AsyncIterator[Pooled]:
    """A 2-worker pool routing model "m" over ["ra", "rb"] (in that order: with no KV
    state, a prompt's first request goes to "ra" and sticks there) with ``routing``."""
    async with running_pool([Replica("ra", "m", engines[0]), Replica("rb", "m", engines[1])], routing) as handle:
        yield handle


def feed(pooled: Pooled, replica_id: str, delta: KvDelta | None) -> None:
    """Hand a KV delta (None: a forget) over as the control plane does (the gateway interface)."""
    if delta is None:
        pooled.pool.kv_forget(replica_id)
    else:
        pooled.pool.kv_update(replica_id, delta)


def chat(content: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2}


async def prompt_hashes(engine: str, content: str) -> list[int]:
    """Return the event hashes of ``content``'s full blocks as the router computes them
    (the engine's /tokenize with the chat template, seed KV_HASH_SEED)."""
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(f"{engine}/tokenize", json={
            "model": "m", "messages": [{"role": "user", "content": content}], "add_generation_prompt": True})
    response.raise_for_status()
    tokens = response.json()["tokens"]
    return kvhash.event_hashes(kvhash.block_hashes(tokens, BLOCK_SIZE, seed=kvhash.KV_HASH_SEED))


async def served(engine: str) -> float:
    """Return the requests ``engine`` has finished (its own vLLM-style /metrics)."""
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{engine}/metrics")).text
    return metric_sum(text, "vllm:request_success_total")


def family(report: Message, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Return one metric family of a worker's report as {sorted labels: value}."""
    for fname, _help, _type, samples in report["metrics"]:
        if fname == name:
            return {tuple(sorted(labels.items())): value for _sample, labels, value in samples}
    return {}


def kv_view(report: Message) -> tuple[float, dict[str, float]]:
    """Return a worker's KV index as its metrics show it: (entries, events applied per replica)."""
    blocks = family(report, "llmgw_gateway_kv_index_blocks").get((), 0.0)
    events = {dict(labels)["replica"]: value
              for labels, value in family(report, "llmgw_gateway_kv_events_applied").items()}
    return blocks, events


def master_view(master: Gateway) -> tuple[float, dict[str, float]]:
    index = master.kv_index
    events = {}
    for rid in index.replica_ids():
        entry = index.replica(rid)
        assert entry is not None
        events[rid] = float(entry.events_applied)
    return float(len(index)), events


async def workers_caught_up(pooled: Pooled) -> None:
    """Wait (deadline: eventually's) until every worker's KV index matches the master's."""
    async def check() -> bool:
        reports = await pooled.pool.collect(metrics=True)
        want = master_view(pooled.master)
        return len(reports) == pooled.pool.workers and all(kv_view(r) == want for r in reports)

    await eventually(check, "every worker's KV index equals the master's")


async def route_prompt(pooled: Pooled, engines: tuple[str, str], content: str) -> tuple[set[str], float, float]:
    """Send CONNECTIONS requests for ``content``; return (workers that answered, requests ra
    served, requests rb served)."""
    before = [await served(e) for e in engines]
    workers = set()
    for _ in range(CONNECTIONS):
        response = await pooled.post(body=chat(content))
        assert response.status_code == 200, response.text
        workers.add(response.headers["x-llmgw-worker"])
    after = [await served(e) for e in engines]
    return workers, after[0] - before[0], after[1] - before[1]


async def test_every_worker_routes_by_the_kv_deltas_it_was_sent(kv_engines: tuple[str, str]) -> None:
    hashes = await prompt_hashes(kv_engines[1], KV_PROMPT)
    assert len(hashes) >= 4
    async with kv_pool(kv_engines) as pooled:
        feed(pooled, "ra", KvDelta(reset=True, stored=(11, 12, 13), block_size=BLOCK_SIZE, events_applied=3))
        feed(pooled, "rb", KvDelta(reset=True, stored=tuple(hashes[:2]), block_size=BLOCK_SIZE, events_applied=2))
        feed(pooled, "rb", KvDelta(stored=tuple(hashes[2:]), removed=(99,), block_size=BLOCK_SIZE,
                                   events_applied=len(hashes) + 1))
        await workers_caught_up(pooled)

        workers, on_a, on_b = await route_prompt(pooled, kv_engines, KV_PROMPT)
        assert workers == {"0", "1"}
        assert (on_a, on_b) == (0, CONNECTIONS)

        metrics = (await pooled.get("/metrics")).text
        assert metric_sum(metrics, "llmgw_gateway_routing_decisions_total", kind="precise", model="m") == CONNECTIONS
        # The index is the same in both workers: its size is reported once, not summed.
        size = metric_sum(metrics, "llmgw_gateway_kv_index_blocks")
        assert size == len(pooled.master.kv_index) == 3 + len(hashes), metrics


async def test_a_restarted_worker_gets_a_full_copy_first(kv_engines: tuple[str, str]) -> None:
    hashes = await prompt_hashes(kv_engines[1], KV_PROMPT)
    async with kv_pool(kv_engines) as pooled:
        pool = pooled.pool
        feed(pooled, "ra", KvDelta(reset=True, stored=(11, 12), block_size=BLOCK_SIZE, events_applied=2))
        feed(pooled, "gone", KvDelta(reset=True, stored=tuple(hashes), block_size=BLOCK_SIZE, events_applied=1))
        feed(pooled, "rb", KvDelta(reset=True, stored=tuple(hashes), block_size=BLOCK_SIZE, events_applied=5))
        feed(pooled, "gone", None)
        await workers_caught_up(pooled)

        victim = pool.pids[1]
        os.kill(victim, signal.SIGKILL)
        events = iter(range(3, 1_000_000))

        async def restarted() -> bool:
            # Deltas keep coming before, while and after the new worker gets its copy.
            n = next(events)
            feed(pooled, "ra", KvDelta(stored=(100 + n,), block_size=BLOCK_SIZE, events_applied=n))
            slot = pool.slots.get(1)
            return slot is not None and slot.ready and pool.pids[1] != victim

        await eventually(restarted, "worker 1 restarted")
        feed(pooled, "ra", KvDelta(stored=(99,), block_size=BLOCK_SIZE, events_applied=next(events)))
        await workers_caught_up(pooled)  # the new worker 1: the full copy and what came after it
        workers, on_a, on_b = await route_prompt(pooled, kv_engines, KV_PROMPT)
        assert workers == {"0", "1"}
        assert (on_a, on_b) == (0, CONNECTIONS)


async def test_an_overflowing_kv_queue_is_replaced_by_a_full_copy(
    kv_engines: tuple[str, str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gateway_pool, "KV_QUEUE_MAX", 5)
    async with kv_pool(kv_engines) as pooled:
        feed(pooled, "gone", KvDelta(reset=True, stored=(1, 2, 3), block_size=BLOCK_SIZE, events_applied=3))
        await workers_caught_up(pooled)
        # No checkpoint in between: the feeds cannot drain, every queue overflows.
        feed(pooled, "gone", None)
        for n in range(1, 21):
            feed(pooled, "rb", KvDelta(stored=(1000 + n,), block_size=BLOCK_SIZE, events_applied=n))
        assert all(slot.kv_resync and not slot.kv_queue for slot in pooled.pool.slots.values())
        feed(pooled, "rb", KvDelta(removed=(1001,), block_size=BLOCK_SIZE, events_applied=21))
        await workers_caught_up(pooled)
        assert master_view(pooled.master) == (19.0, {"rb": 21.0})


async def test_hash_alarms_of_the_workers_reach_ctl_status(kv_engines: tuple[str, str]) -> None:
    # Every expectation is judged at the next look, and one mismatch raises the alarm.
    routing = RoutingConfig(tokenize_timeout=10.0, agreement_window=0.0, mismatch_alarm_after=1)
    async with kv_pool(kv_engines, routing) as pooled:
        # Both replicas report blocks, never the prompt's: as with a wrong hash seed.
        feed(pooled, "ra", KvDelta(reset=True, stored=(11,), block_size=BLOCK_SIZE, events_applied=1))
        feed(pooled, "rb", KvDelta(reset=True, stored=(21,), block_size=BLOCK_SIZE, events_applied=1))
        await workers_caught_up(pooled)
        workers = set()
        for _ in range(CONNECTIONS):
            response = await pooled.post(body=chat(KV_PROMPT))
            assert response.status_code == 200, response.text
            workers.add(response.headers["x-llmgw-worker"])
        assert workers == {"0", "1"}
        # More blocks, still not the prompt's: every worker's pending expectation is a mismatch.
        feed(pooled, "ra", KvDelta(stored=(12,), block_size=BLOCK_SIZE, events_applied=2))
        feed(pooled, "rb", KvDelta(stored=(22,), block_size=BLOCK_SIZE, events_applied=2))

        async def raised() -> list[Message] | None:
            reports = await pooled.pool.collect(metrics=True)
            done = len(reports) == pooled.pool.workers and all(r["kv_alarms"] for r in reports)
            return reports if done else None

        reports = await eventually(raised, "every worker's alarm reported")
        alarms = pooled.pool.kv_alarms()
        assert alarms == sorted({a for r in reports for a in r["kv_alarms"]})
        assert alarms and all(a in (f"model m replica {r}: {ALARM_TEXT}" for r in ("ra", "rb")) for a in alarms)
        assert list(pooled.pool.status().kv_alarms) == alarms  # what `ctl status` shows
        metrics = (await pooled.get("/metrics")).text
        raised_gauges = re.findall(r'^llmgw_gateway_kv_hash_alarm\{model="m",replica="(\w+)"\} (\S+)$', metrics, re.M)
        # One alarm per replica however many workers raised it (the gauges are not summed).
        assert sorted(r for r, v in raised_gauges if float(v) > 0) == [a.split()[3].rstrip(":") for a in alarms]
        assert all(float(v) in (0.0, 1.0) for _, v in raised_gauges), metrics


async def test_a_full_kv_copy_and_the_queue_after_it_make_the_masters_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """No processes: the copy holds exactly what came before it, the queue what came after."""
    pool = new_pool()
    master = pool.master
    handle = Pooled(master, pool)
    slot = gateway_pool._Slot(0, 0, None, None)  # type: ignore[arg-type]  # never started
    pool.slots[0] = slot
    big = tuple(range(1, 2 * MAX_HASHES_PER_DELTA + 100))
    feed(handle, "big", KvDelta(reset=True, stored=big, block_size=16, events_applied=5, gaps=1, resyncs=1))
    feed(handle, "small", KvDelta(reset=True, stored=(7, 8), block_size=32, events_applied=2))
    feed(handle, "gone", KvDelta(reset=True, stored=(9,), block_size=16, events_applied=1))
    feed(handle, "gone", None)
    assert not slot.kv_queue  # waiting for its copy: nothing queued

    copy = list(pool._kv_copy(slot))
    feed(handle, "small", KvDelta(stored=(10,), removed=(7,), block_size=32, events_applied=3))
    feed(handle, "big", None)
    assert copy[0] == {"t": "kvcopy", "replicas": ["big", "small"]}
    assert all(len(m["delta"][1]) <= MAX_HASHES_PER_DELTA for m in copy[1:])
    assert [m["t"] for m in slot.kv_queue] == ["kv", "kvforget"]

    # A worker's index that had a replica the master forgot meanwhile.
    worker = KvIndex()
    worker.apply("stale", KvDelta(reset=True, stored=(1,), block_size=16))
    for message in [*copy, *slot.kv_queue]:
        if message["t"] == "kvcopy":
            for rid in set(worker.replica_ids()) - set(message["replicas"]):
                worker.forget(rid)
        elif message["t"] == "kv":
            worker.apply(message["replica"], decode_kv_delta(message["delta"]))
        else:
            worker.forget(message["replica"])
    assert worker.replica_ids() == master.kv_index.replica_ids() == ["small"]
    got, want = worker.replica("small"), master.kv_index.replica("small")
    assert got is not None and want is not None
    assert (list(got.blocks), got.block_size, got.events_applied) == (list(want.blocks), 32, 3)

    monkeypatch.setattr(gateway_pool, "KV_QUEUE_MAX", 3)
    for n in range(4):
        feed(handle, "small", KvDelta(stored=(100 + n,), block_size=32, events_applied=4 + n))
    assert slot.kv_resync and not slot.kv_queue  # overflowed: a fresh copy instead
