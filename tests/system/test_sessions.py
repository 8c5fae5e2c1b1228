"""Sessions survive what operators do to a cluster: control plane restarts, failover lists, PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.system.harness import LLMGW, alive, Cluster, engines_under, Proc, ready_replicas

pytestmark = pytest.mark.system


async def test_agent_fails_over_and_rejoins_a_restarted_control_plane(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        await cluster.init()
        await cluster.start_server()
        config = cluster.node_config("node-a")
        # The first control plane of the list is dead: the agent must move on to the next.
        raw = yaml.safe_load(config.read_text())
        raw["control_planes"] = ["127.0.0.1:1", cluster.rpc]
        config.write_text(yaml.safe_dump(raw))
        agent = Proc([*LLMGW, "agent", "-c", str(config)], tmp_path / "agent.log")
        cluster.agents["node-a"] = agent
        await agent.wait_for_line(r"agent: joined \S+ as node 'node-a'")
        assert "cannot reach 127.0.0.1:1" in agent.output()

        assert cluster.ctl("models", "add", "m1", "--engine", "sim").returncode == 0
        [before] = await ready_replicas(cluster, "m1", 1)

        # Restart the control plane on the same ports: the agent reconnects, reports its
        # running engine, and the control plane re-binds it instead of starting another.
        assert cluster.server is not None
        cluster.server.kill()
        rpc, gateway = cluster.rpc, cluster.gateway
        cluster.pin_ports()
        await cluster.start_server()
        assert (cluster.rpc, cluster.gateway) == (rpc, gateway)
        await agent.wait_for_line(r"(?s)joined .*joined \S+ as node 'node-a' \(1 shards\)")
        [after] = await ready_replicas(cluster, "m1", 1)
        assert (after["id"], after["pid"]) == (before["id"], before["pid"])
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(f"{gateway}/v1/completions", json={"model": "m1", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        cluster.stop()


@pytest.mark.postgres
async def test_control_plane_on_postgresql_keeps_its_catalog(tmp_path: Path, pg_dsn: str) -> None:
    cluster = Cluster(tmp_path, store_url=pg_dsn)
    try:
        await cluster.init()
        await cluster.start_server()
        await cluster.start_agent("node-a")
        assert cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "2").returncode == 0
        await ready_replicas(cluster, "m1", 2)
        assert cluster.server is not None
        cluster.server.kill()
        await cluster.start_server()
        models = cluster.ctl_json("models", "list")
        assert [(m["name"], m["profile"]["replicas"]) for m in models] == [("m1", 2)]
    finally:
        cluster.stop()


async def test_up_serves_the_demo_model_and_ctl_finds_it(tmp_path: Path) -> None:
    env = {"XDG_DATA_HOME": str(tmp_path / "xdg")}
    up = Proc([*LLMGW, "up", "--http-port", "0", "--rpc-port", "0"], tmp_path / "up.log", env=env)
    try:
        m = await up.wait_for_line(r"OpenAI endpoint : (\S+)/v1 .*1 ready replica")
        gateway = m.group(1)
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(f"{gateway}/v1/chat/completions",
                                json={"model": "demo", "messages": [{"role": "user", "content": "Hello!"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        out = subprocess.run([*LLMGW, "ctl", "replicas", "--json"], capture_output=True, text=True,
                             env={**os.environ, **env}, timeout=60)
        assert out.returncode == 0, out.stderr
        [replica] = json.loads(out.stdout)["replicas"]
        assert replica["model"] == "demo" and replica["state"] == "ready"
        assert alive(replica["pid"])
        up.signal(signal.SIGINT)
        assert await up.wait_exit() == 0  # Ctrl-C drains and ends `up` cleanly, like SIGTERM
        assert not alive(replica["pid"]), "llmgw up stops its engines on Ctrl-C"
        assert engines_under(tmp_path) == []
    finally:
        up.kill()


def test_llmgw_runs_as_a_module() -> None:
    out = subprocess.run([sys.executable, "-m", "llmgw", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "llmgw" in out.stdout


async def test_up_stops_its_engines_on_sigterm(tmp_path: Path) -> None:
    env = {"XDG_DATA_HOME": str(tmp_path / "xdg")}
    up = Proc([*LLMGW, "up", "--engine", "sim", "--http-port", "0", "--rpc-port", "0"], tmp_path / "up.log", env=env)
    try:
        await up.wait_for_line(r"OpenAI endpoint : (\S+)/v1 .*1 ready replica")
        assert engines_under(tmp_path), "the demo engine runs under the cluster's state directory"
        up.signal(signal.SIGTERM)
        assert await up.wait_exit() == 0
        assert engines_under(tmp_path) == []
    finally:
        up.kill()
