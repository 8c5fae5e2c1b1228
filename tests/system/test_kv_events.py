"""KV events end to end: simulated engines publish, each agent mirrors and relays net deltas
up the shard's reporter, and the server's gateway KV index holds exactly the blocks of the
replica that served a request; a stopped replica's blocks leave the index."""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from llmgw import kvhash
from tests.system.harness import Cluster, engine_auth, eventually, metric_sum, ready_replicas

pytestmark = pytest.mark.system

BS = 16


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path) as c:
        yield c


async def test_blocks_of_a_request_reach_the_gateway_index_of_its_replica(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    out = cluster.ctl("models", "add", "kv", "--engine", "sim", "--replicas", "2")
    assert out.returncode == 0, out.stderr

    first, second = await ready_replicas(cluster, "kv", 2)
    prompt = list(range(7, 7 + 4 * BS + 3))
    expected = len(kvhash.block_hashes(prompt, BS))
    async with httpx.AsyncClient(timeout=30) as http:
        # Straight to one replica, bypassing the router: only its events can explain the index.
        r = await http.post(first["endpoint"] + "/v1/completions", json={"model": "kv", "prompt": prompt, "max_tokens": 1},
                            headers=engine_auth(cluster, first))
        assert r.status_code == 200, r.text

        async def indexed() -> str | None:
            text = (await http.get(cluster.gateway + "/metrics")).text
            return text if metric_sum(text, "llmgw_gateway_kv_index_blocks") >= expected else None

        text = await eventually(indexed, "the request's blocks in the gateway's KV index")
        assert metric_sum(text, "llmgw_gateway_kv_index_blocks") == expected
        assert metric_sum(text, "llmgw_gateway_kv_events_applied_total", replica=first["id"]) >= 1
        assert metric_sum(text, "llmgw_gateway_kv_events_applied_total", replica=second["id"]) == 0
        assert metric_sum(text, "llmgw_gateway_kv_resyncs_total", replica=first["id"]) == 0

        # Stopping the replica drops its blocks from the index.
        assert cluster.ctl("models", "remove", "kv").returncode == 0

        async def emptied() -> bool:
            text = (await http.get(cluster.gateway + "/metrics")).text
            return metric_sum(text, "llmgw_gateway_kv_index_blocks") == 0

        await eventually(emptied, "the KV index emptied after the replicas stopped")
