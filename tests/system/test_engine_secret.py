"""Nobody but the gateway is let into an engine (issue 12): each shard's engine has a secret
the control plane minted, the agent handed over in the engine's environment and the gateway
sends as its Bearer token. Real server, agent and simulated engine on loopback."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from tests.system.harness import WAIT, Cluster, engine_secret, eventually, ready_replicas

pytestmark = pytest.mark.system

MODEL = "m1"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path) as c:
        yield c


async def complete(http: httpx.AsyncClient, cluster: Cluster) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    return await http.post(f"{cluster.gateway}/v1/completions", json=body)


async def test_only_the_gateway_reaches_the_engine_and_the_secret_shows_nowhere(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    assert cluster.ctl("models", "add", MODEL, "--engine", "sim").returncode == 0
    [replica] = await ready_replicas(cluster, MODEL, 1)
    secret = engine_secret(cluster, replica)
    assert len(secret) >= 43
    endpoint = replica["endpoint"]
    async with httpx.AsyncClient(timeout=30) as http:
        served = await complete(http, cluster)
        assert served.status_code == 200, served.text
        streamed = await http.post(f"{cluster.gateway}/v1/completions",
                                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True})
        assert streamed.status_code == 200 and "data: [DONE]" in streamed.text, streamed.text

        # Straight to the engine: refused without the secret, with a wrong one, or with a
        # gateway-style key; only its liveness check is open.
        body = {"model": MODEL, "prompt": "sneak", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {secret[:-1]}"}):
            refused = await http.post(f"{endpoint}/v1/completions", json=body, headers=headers)
            assert refused.status_code == 401, (headers, refused.text)
            assert refused.json()["error"]["code"] == "invalid_api_key"
        assert (await http.get(f"{endpoint}/v1/models")).status_code == 401
        assert (await http.post(f"{endpoint}/tokenize", json={"model": MODEL, "prompt": "x"})).status_code == 401
        assert (await http.get(f"{endpoint}/health")).status_code == 200
        ok = await http.post(f"{endpoint}/v1/completions", json=body, headers={"Authorization": f"Bearer {secret}"})
        assert ok.status_code == 200, ok.text

    # The secret is in the engine's environment (readable by its own user only), not its argv.
    pid = replica["pid"]
    assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert f"LLMGW_SIM_API_KEY={secret}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert stat.S_IMODE(os.stat(f"/proc/{pid}/environ").st_mode) & 0o044 == 0

    # Not in ctl output (tables or JSON), nor in any log.
    for args in (("replicas", "--json"), ("replicas",), ("nodes", "--json"), ("status", "--json")):
        out = cluster.ctl(*args)
        assert out.returncode == 0, out.stderr
        assert secret not in out.stdout + out.stderr, args
    assert "api_key" not in json.dumps(cluster.ctl_json("replicas"))
    for log in [*cluster.root.glob("*.log"), *cluster.root.rglob("engine.log*")]:
        assert secret not in log.read_text(errors="replace"), log

    # The agent keeps it where only its user can read it.
    [state] = (cluster.root / "node-a" / "state").rglob(f"{replica['id']}/state.json")
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert stat.S_IMODE(state.parent.stat().st_mode) == 0o700  # the shard's directory
    assert stat.S_IMODE(state.parent.parent.stat().st_mode) == 0o700  # the supervisor's shards/


async def test_a_restarted_control_plane_learns_the_secret_of_an_adopted_engine(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    assert cluster.ctl("models", "add", MODEL, "--engine", "sim").returncode == 0
    [before] = await ready_replicas(cluster, MODEL, 1)
    assert cluster.server is not None
    cluster.server.kill()
    cluster.pin_ports()
    await cluster.start_server()
    [after] = await ready_replicas(cluster, MODEL, 1)
    assert (after["id"], after["pid"]) == (before["id"], before["pid"])  # the same engine, adopted
    async with httpx.AsyncClient(timeout=30) as http:

        async def served() -> httpx.Response | None:
            response = await complete(http, cluster)
            return response if response.status_code == 200 else None

        # The new control plane knows the secret only from the agent's registration.
        await eventually(served, "a request served by the adopted engine", WAIT)
        assert engine_secret(cluster, after) == engine_secret(cluster, before)
