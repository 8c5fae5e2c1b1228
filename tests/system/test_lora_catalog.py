"""LoRA adapters from the catalog to the engine: ctl, store, placement, agent, engine argv, gateway.

Real `llmgw server`/`agent`/`ctl` processes with the simulated engine (it starts in a second;
its adapters are labels, not files). The real engines are in tests/engines/test_*_lora.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from tests.system.harness import Cluster, engine_auth, ready_replicas

pytestmark = pytest.mark.system


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path) as c:
        await c.start_agent("node-a")
        yield c


async def ready_endpoint(cluster: Cluster, model: str) -> tuple[str, dict[str, str]]:
    """Returns the endpoint of ``model``'s one ready replica and the header its engine wants."""
    [replica] = await ready_replicas(cluster, model)
    return str(replica["endpoint"]), engine_auth(cluster, replica)


async def test_adapters_reach_the_engine_and_share_the_model_namespace(cluster: Cluster) -> None:
    out = cluster.ctl("models", "add", "base", "--engine", "sim", "--adapter", "sql=sql-v1",
                      "--adapter", "chat=chat-v2")
    assert out.returncode == 0, out.stderr
    [listed] = cluster.ctl_json("models", "list")
    assert listed["adapters"] == [{"name": "sql", "source": "sql-v1"}, {"name": "chat", "source": "chat-v2"}]
    assert listed["max_loaded_adapters"] == 0
    table = cluster.ctl("models", "list")
    assert "ADAPTERS" in table.stdout and "sql, chat" in table.stdout

    endpoint, auth = await ready_endpoint(cluster, "base")
    async with httpx.AsyncClient(timeout=30) as http:
        # Loaded at start (max_loaded_adapters 0): the engine itself lists them under their parent.
        cards = (await http.get(f"{endpoint}/v1/models", headers=auth)).json()["data"]
        assert {c["id"]: c["parent"] for c in cards} == {"base": None, "sql": "base", "chat": "base"}
        # Through the gateway, the adapter's name is a model of its own.
        reply = await http.post(f"{cluster.gateway}/v1/chat/completions", json={
            "model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "sql"
        names = {m["id"]: m.get("parent") for m in (await http.get(f"{cluster.gateway}/v1/models")).json()["data"]}
        assert names["sql"] == "base" and names["chat"] == "base"

        # The adapter a request named is the one that answered (the simulator answers per adapter).
        async def answer(url: str, model: str, headers: dict[str, str] | None = None) -> str:
            r = await http.post(f"{url}/v1/chat/completions", headers=headers, json={
                "model": model, "messages": [{"role": "user", "content": "which adapter?"}], "max_tokens": 8})
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["message"]["content"])

        through = {m: await answer(cluster.gateway, m) for m in ("base", "sql", "chat")}
        assert through == {m: await answer(endpoint, m, auth) for m in ("base", "sql", "chat")}
        assert len(set(through.values())) == 3

    clash = cluster.ctl("models", "add", "sql", "--engine", "sim")
    assert clash.returncode != 0
    assert "model name 'sql' is already taken by an adapter of model 'base'" in clash.stderr
    own = cluster.ctl("models", "add", "other", "--engine", "sim", "--adapter", "other=x")
    assert own.returncode != 0 and "is the model's own name" in own.stderr
    llama = cluster.ctl("models", "add", "gguf", "--engine", "llama.cpp", "--source", "/m.gguf",
                        "--adapter", "a=/a.gguf", "--max-loaded-adapters", "1")
    assert llama.returncode != 0 and "loads every adapter at start" in llama.stderr
    bad = cluster.ctl("models", "add", "x", "--engine", "sim", "--adapter", "noequals")
    assert bad.returncode != 0 and "expected NAME=SOURCE" in bad.stderr


async def test_on_demand_adapters_are_not_registered_at_start(cluster: Cluster) -> None:
    out = cluster.ctl("models", "add", "lazy", "--engine", "sim", "--adapter", "a=a-v1", "--adapter", "b=b-v1",
                      "--max-loaded-adapters", "1")
    assert out.returncode == 0, out.stderr
    assert "(1 loaded at a time)" in cluster.ctl("models", "list").stdout
    endpoint, auth = await ready_endpoint(cluster, "lazy")
    async with httpx.AsyncClient(timeout=30) as http:
        cards = (await http.get(f"{endpoint}/v1/models", headers=auth)).json()["data"]
        assert [c["id"] for c in cards] == ["lazy"]
        # The gateway loads an adapter where a request for it goes (llmgw/router/adapters.py).
        reply = await http.post(f"{cluster.gateway}/v1/chat/completions", json={
            "model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert reply.status_code == 200, reply.text
        cards = (await http.get(f"{endpoint}/v1/models", headers=auth)).json()["data"]
        assert {c["id"] for c in cards} == {"lazy", "b"}
