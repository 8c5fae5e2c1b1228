"""GatewayPool: real gateway worker processes on one port, fed by a master gateway object.

One simulated engine (``python -m llmgw.sim``) behind a pool of 2 workers; every request
opens a fresh connection, so the kernel spreads them over the workers (SO_REUSEPORT).
"""

from __future__ import annotations

import os
import re
import signal
from typing import AsyncIterator

import httpx
import pytest
import trio

from llmgw.control.gateway_pool import (
    GatewayPool, ObservedAuthTable, ObservedTable, PooledAdmission, WorkerSettings, WorkerStartError,
)
from llmgw.router.admission import AdmissionLimits
from llmgw.router.app import Gateway, create_app, gateway_of
from llmgw.router.auth import KeyEntry, Tenant, generate_key
from llmgw.router.replicas import Replica
from llmgw.sim.launch import start_sim

from tests.system.harness import alive, eventually

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


@pytest.fixture
async def pooled(engine: str) -> AsyncIterator[Pooled]:
    table = ObservedTable()
    table.set_model_replicas("m", [Replica("r1", "m", engine)])
    master = gateway_of(create_app(table, auth=ObservedAuthTable(enabled=False),
                                   admission=PooledAdmission(AdmissionLimits())))
    pool = GatewayPool(master, "127.0.0.1", 2, WorkerSettings(auth_enabled=False))
    async with trio.open_nursery() as nursery:
        with trio.fail_after(60):
            port = await nursery.start(pool.run, 0)
        handle = Pooled(master, pool)
        handle.url = f"http://127.0.0.1:{port}"
        try:
            yield handle
        finally:
            pids = list(pool.pids.values())
            nursery.cancel_scope.cancel()
    assert pids and not any(alive(pid) for pid in pids), "a worker outlived the pool"


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

    master.stopped = True
    pool.state_changed()
    assert await pool.synced()
    assert await statuses() == {503}
    master.stopped = False
    pool.state_changed()
    assert await pool.synced()
    assert await statuses() == {200}


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
        table = ObservedTable()
        master = gateway_of(create_app(table, auth=ObservedAuthTable(enabled=False),
                                       admission=PooledAdmission(AdmissionLimits())))
        pool = GatewayPool(master, "127.0.0.1", 2, WorkerSettings(auth_enabled=False))
        with pytest.raises(WorkerStartError, match="cannot bind the gateway"), trio.fail_after(60):
            await pool.run(taken.getsockname()[1])
        assert not pool.slots
    finally:
        taken.close()
