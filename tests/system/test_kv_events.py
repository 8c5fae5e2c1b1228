"""KV events end to end: simulated engines publish, each agent mirrors and relays net deltas
up the shard's reporter, and the server's gateway KV index holds exactly the blocks of the
replica that served a request; a stopped replica's blocks leave the index."""

from __future__ import annotations

import re
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from llmgw import kvhash
from tests.system.harness import Cluster, eventually, iter_replicas

pytestmark = pytest.mark.system

BS = 16


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        await c.init()
        await c.start_server()
        yield c
    finally:
        c.stop()


def metric(text: str, name: str, replica: str | None = None) -> float:
    """Returns the value of ``name`` (with ``replica="..."`` when given) in a scrape, 0 if absent."""
    labels = "" if replica is None else r'\{[^}]*replica="' + re.escape(replica) + r'"[^}]*\}'
    m = re.search(rf"^{re.escape(name)}{labels}\s+(\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


async def test_blocks_of_a_request_reach_the_gateway_index_of_its_replica(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    out = cluster.ctl("models", "add", "kv", "--engine", "sim", "--replicas", "2")
    assert out.returncode == 0, out.stderr

    async def two_ready() -> list[dict] | None:
        rows = [r for r in iter_replicas(cluster, "kv") if r["state"] == "ready"]
        return rows if len(rows) == 2 else None

    first, second = await eventually(two_ready, "2 ready replicas of kv")
    prompt = list(range(7, 7 + 4 * BS + 3))
    expected = len(kvhash.block_hashes(prompt, BS))
    async with httpx.AsyncClient(timeout=30) as http:
        # Straight to one replica, bypassing the router: only its events can explain the index.
        r = await http.post(first["endpoint"] + "/v1/completions", json={"model": "kv", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text

        async def indexed() -> str | None:
            text = (await http.get(cluster.gateway + "/metrics")).text
            return text if metric(text, "llmgw_gateway_kv_index_blocks") >= expected else None

        text = await eventually(indexed, "the request's blocks in the gateway's KV index")
        assert metric(text, "llmgw_gateway_kv_index_blocks") == expected
        assert metric(text, "llmgw_gateway_kv_events_applied_total", first["id"]) >= 1
        assert metric(text, "llmgw_gateway_kv_events_applied_total", second["id"]) == 0
        assert metric(text, "llmgw_gateway_kv_resyncs_total", first["id"]) == 0

        # Stopping the replica drops its blocks from the index.
        assert cluster.ctl("models", "remove", "kv").returncode == 0

        async def emptied() -> bool:
            text = (await http.get(cluster.gateway + "/metrics")).text
            return metric(text, "llmgw_gateway_kv_index_blocks") == 0

        await eventually(emptied, "the KV index emptied after the replicas stopped")
