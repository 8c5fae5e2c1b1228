"""`gateway.workers: 2` on a real `llmgw server` + agent + simulated engine, driven through ctl."""

from __future__ import annotations

import re
from pathlib import Path
from typing import AsyncIterator

import httpx
import psutil
import pytest

from tests.system.harness import alive, Cluster, eventually, ready_replicas

pytestmark = pytest.mark.system

#: Fresh connections per check: with 2 workers, all landing on one is a 2^-19 chance.
CONNECTIONS = 20


def body(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path, auth=True, extra={"gateway": {"workers": 2}}) as c:
        yield c


def worker_pids(cluster: Cluster) -> dict[int, int]:
    """Return the pid of each gateway worker by index, from the server's log (latest wins)."""
    assert cluster.server is not None
    found = re.findall(r"gateway worker (\d+) listening on \S+ \(pid (\d+)\)", cluster.server.output())
    return {int(i): int(pid) for i, pid in found}


async def post(cluster: Cluster, model: str, key: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=cluster.gateway, timeout=30) as http:  # a fresh connection
        return await http.post("/v1/chat/completions", json=body(model), headers={"authorization": f"Bearer {key}"})


async def through_many(cluster: Cluster, model: str, key: str) -> tuple[set[int], set[str]]:
    """Return the statuses and the workers seen over CONNECTIONS fresh connections."""
    responses = [await post(cluster, model, key) for _ in range(CONNECTIONS)]
    return {r.status_code for r in responses}, {r.headers.get("x-llmgw-worker", "?") for r in responses}


async def test_two_workers_share_state_usage_metrics_and_restart(cluster: Cluster) -> None:
    pids = worker_pids(cluster)
    assert sorted(pids) == [0, 1]
    server = psutil.Process(cluster.server.pid)  # type: ignore[union-attr]
    assert {p.pid for p in server.children()} >= set(pids.values())

    await cluster.start_agent("node-a")
    assert cluster.ctl("models", "add", "m1", "--engine", "sim").returncode == 0

    await ready_replicas(cluster, "m1")
    cluster.ctl_json("tenants", "add", "acme")
    key = cluster.ctl_json("keys", "create", "--tenant", "acme")["key"]
    key_id = key.split("_")[1]

    # The replica reached both workers' tables (registry -> feed -> pool -> workers).
    async def served_everywhere() -> bool:
        statuses, workers = await through_many(cluster, "m1", key)
        return statuses == {200} and workers == {"0", "1"}

    await eventually(served_everywhere, "m1 served through both workers")
    def acme_usage() -> dict:
        rows = [u for u in cluster.ctl_json("usage") if u["tenant"] == "acme" and u["model"] == "m1"]
        return rows[0] if rows else {"requests": 0, "completion_tokens": 0}

    before = acme_usage()
    statuses, workers = await through_many(cluster, "m1", key)
    assert statuses == {200} and workers == {"0", "1"}
    row = acme_usage()  # both workers' counts, collected when ctl asks
    assert row["requests"] - before["requests"] == CONNECTIONS
    assert row["completion_tokens"] - before["completion_tokens"] == 3 * CONNECTIONS
    [acme] = [a for a in cluster.ctl_json("status")["admission"] if a["tenant"] == "acme"]
    assert acme["admitted"] == row["requests"]

    async with httpx.AsyncClient(base_url=cluster.gateway, timeout=30) as http:
        metrics = (await http.get("/metrics")).text
    count = re.search(r'llmgw_gateway_requests_total\{model="m1",status="200",tenant="acme"\} (\S+)', metrics)
    assert count is not None and float(count.group(1)) == row["requests"], metrics

    # A catalog change reaches every worker: a new model is 503 (no replica yet) not 404.
    assert cluster.ctl("models", "add", "m2", "--engine", "sim").returncode == 0
    statuses, _ = await through_many(cluster, "m2", key)
    assert 404 not in statuses
    await ready_replicas(cluster, "m2")

    async def m2_served() -> bool:
        return (await through_many(cluster, "m2", key))[0] == {200}

    await eventually(m2_served, "m2 served through every connection")

    # A revoked key is refused by every worker as soon as ctl returns.
    assert cluster.ctl("keys", "revoke", key_id).returncode == 0
    statuses, workers = await through_many(cluster, "m1", key)
    assert statuses == {401} and workers == {"0", "1"}

    # The routing setting reaches every worker as soon as ctl returns.
    assert cluster.ctl("config", "set", "routing.policy", "round-robin").returncode == 0
    assert await routing_workers(cluster) == {"round-robin": 2.0}

    # Every worker passes /api/v1/* to the control plane's process.
    token = cluster.ctl("admin-tokens", "create", "ops").stdout.strip()
    async with httpx.AsyncClient(base_url=cluster.gateway, timeout=30) as http:
        answers = [await http.get("/api/v1/settings/routing", headers={"authorization": f"Bearer {token}",
                                                                       "connection": "close"})
                   for _ in range(CONNECTIONS)]
    assert {a.status_code for a in answers} == {200}
    assert {a.headers.get("x-llmgw-worker") for a in answers} == {"0", "1"}
    assert answers[0].json() == [{"key": "routing", "value": {"policy": "round-robin"}, "version": 1,
                                  "updated_at": answers[0].json()[0]["updated_at"], "actor": "admin"}]

    # A killed worker is restarted and serves again.
    victim = pids[1]
    psutil.Process(victim).kill()

    async def restarted() -> dict[int, int] | None:
        now = worker_pids(cluster)
        return now if now.get(1) not in (None, victim) else None

    now = await eventually(restarted, "gateway worker 1 restarted")
    assert not alive(victim) and alive(now[1])
    key2 = cluster.ctl_json("keys", "create", "--tenant", "acme")["key"]
    await eventually(lambda: served_everywhere_with(cluster, key2), "both workers serving after the restart")
    assert await routing_workers(cluster) == {"round-robin": 2.0}  # the new worker got it before it listened

    # Stopping the server stops its workers (no orphans).
    cluster.server.signal(2)  # type: ignore[union-attr]  SIGINT: a clean stop
    await cluster.server.wait_exit()  # type: ignore[union-attr]
    assert not any(alive(pid) for pid in now.values()), "a gateway worker outlived the server"


async def routing_workers(cluster: Cluster) -> dict[str, float]:
    """Return how many workers route by each policy, from the merged /metrics (policies with none left out)."""
    async with httpx.AsyncClient(base_url=cluster.gateway, timeout=30) as http:
        metrics = (await http.get("/metrics")).text
    found = re.findall(r'^llmgw_gateway_routing_policy\{policy="([^"]+)"\} (\S+)$', metrics, re.MULTILINE)
    return {policy: float(n) for policy, n in found if float(n) > 0}


async def served_everywhere_with(cluster: Cluster, key: str) -> bool:
    statuses, workers = await through_many(cluster, "m1", key)
    return statuses == {200} and workers == {"0", "1"}
