"""API keys through the real CLI against a real `llmgw server` + agent + simulated engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import AsyncIterator

import httpx
import openai
import pytest

from tests.system.harness import Cluster, alive, engines_under, eventually, iter_replicas, ready_replicas

pytestmark = pytest.mark.system

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path, auth=True) as c:
        yield c


async def test_keys_tenants_usage_and_stop_through_ctl(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    assert cluster.ctl("models", "add", "m1", "--engine", "sim").returncode == 0

    await ready_replicas(cluster, "m1")

    tenant = cluster.ctl_json("tenants", "add", "acme", "--models", "m1", "--rpm", "1000")
    assert tenant["name"] == "acme" and tenant["models"] == ["m1"] and tenant["rpm"] == 1000
    created = cluster.ctl_json("keys", "create", "--tenant", "acme", "--name", "ci")
    key, key_id = created["key"], created["id"]
    assert key.startswith(f"llmgw_{key_id}_")
    refused = cluster.ctl("keys", "create", "--tenant", "nobody")
    assert refused.returncode != 0 and "tenants add nobody" in refused.stderr
    listed = cluster.ctl("keys", "list", "--json")
    assert key not in listed.stdout
    assert [(k["id"], k["tenant"], k["name"]) for k in json.loads(listed.stdout)] == [(key_id, "acme", "ci")]

    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=cluster.gateway, timeout=30) as http:
        missing = await http.post("/v1/chat/completions", json=BODY)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        # m2 is not in the catalog, but acme may not know that: 403 comes first.
        assert (await http.post("/v1/chat/completions", json={**BODY, "model": "m2"}, headers=headers)).status_code == 403

        client = openai.AsyncOpenAI(base_url=f"{cluster.gateway}/v1", api_key=key, max_retries=0, timeout=30)
        try:
            chat = await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=3)
            assert chat.usage is not None and chat.usage.completion_tokens == 3
            stream = await client.chat.completions.create(
                model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
            chunks = [c async for c in stream]
            assert all(c.usage is None for c in chunks)  # asked of the engine by the gateway, not shown
        finally:
            await client.close()

        usage = cluster.ctl_json("usage")
        assert [(u["tenant"], u["model"], u["requests"], u["completion_tokens"]) for u in usage] == [
            ("acme", "m1", 2, 7)]
        status = cluster.ctl_json("status")
        [acme] = [a for a in status["admission"] if a["tenant"] == "acme"]
        assert acme["admitted"] == 2 and acme["shed"] == 0

        updated = cluster.ctl_json("tenants", "update", "acme", "--models", "*")
        assert updated["models"] is None and updated["rpm"] == 1000
        assert (await http.post("/v1/chat/completions", json={**BODY, "model": "m2"}, headers=headers)).status_code == 404

        [before] = await ready_replicas(cluster, "m1")
        assert cluster.ctl_json("stop")["serving_stopped"] is True
        stopped = await http.post("/v1/chat/completions", json=BODY, headers=headers)
        assert stopped.status_code == 503 and stopped.json()["error"]["code"] == "system_stopped"
        assert int(stopped.headers["retry-after"]) > 0
        # Stopped: every replica is stopped and its engine ended (the model stays in the catalog).
        await eventually(lambda: not list(iter_replicas(cluster, "m1")) and not engines_under(cluster.root),
                         "every replica stopped")
        assert [m["name"] for m in cluster.ctl_json("models", "list")] == ["m1"]
        assert not alive(before["pid"])
        assert cluster.ctl_json("start")["serving_stopped"] is False
        [after_start] = await ready_replicas(cluster, "m1")
        assert after_start["id"] != before["id"]
        assert (await http.post("/v1/chat/completions", json=BODY, headers=headers)).status_code == 200

        revoked = cluster.ctl_json("keys", "revoke", key_id)
        assert revoked["revoked_at"]
        after = await http.post("/v1/chat/completions", json=BODY, headers=headers)
        assert after.status_code == 401
        assert [k["id"] for k in cluster.ctl_json("keys", "list", "--all")] == [key_id]

    assert cluster.ctl_json("tenants", "remove", "acme")["removed"] is True
    assert cluster.ctl_json("tenants", "list") == []
