"""A real cluster on loopback: `llmgw server`, `llmgw agent` processes, simulated engines, ctl and the gateway."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import AsyncIterator

import httpx
import openai
import pytest

from llmgw.client import ClientError, connect
from tests.system.harness import alive, Cluster, eventually, iter_replicas, ready_replicas

pytestmark = pytest.mark.system


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path, lost_after="3s", replace_grace="2s") as c:
        yield c


async def test_two_nodes_serve_a_model_through_the_gateway(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    nodes = cluster.ctl_json("nodes")
    assert sorted(n["id"] for n in nodes) == ["node-a", "node-b"]
    assert all(n["state"] == "online" and n["hardware"]["cpu_count"] > 0 for n in nodes)
    assert all(n["hardware"]["gpu_note"].startswith("no NVIDIA GPUs: ") for n in nodes)

    out = cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "2")
    assert out.returncode == 0, out.stderr
    replicas = await ready_replicas(cluster, "m1", 2)
    assert sorted(r["node_id"] for r in replicas) == ["node-a", "node-b"], "replicas are spread over both nodes"

    client = openai.AsyncOpenAI(base_url=f"{cluster.gateway}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        chat = await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content
        stream = await client.chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=5
        )
        pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
        assert len([p for p in pieces if p]) == 5
        models = await client.models.list()
        assert [m.id for m in models.data] == ["m1"]
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    finally:
        await client.close()

    # Removing the model stops its engines.
    pids = [r["pid"] for r in replicas]
    assert cluster.ctl("models", "remove", "m1").returncode == 0
    await eventually(lambda: _async(not list(iter_replicas(cluster, "m1"))), "replicas of m1 gone")
    await eventually(lambda: _async(not any(alive(pid) for pid in pids)), "engines of m1 stopped")


async def _async(value):  # type: ignore[no-untyped-def]
    return value


async def test_restarted_agent_adopts_its_running_engine(cluster: Cluster) -> None:
    agent = await cluster.start_agent("node-a")
    assert cluster.ctl("models", "add", "m1", "--engine", "sim").returncode == 0
    [before] = await ready_replicas(cluster, "m1", 1)

    agent.kill()  # SIGKILL: no clean shutdown at all
    assert alive(before["pid"]), "the engine outlives its agent"
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(f"{before['endpoint']}/health")).status_code == 200

    await cluster.start_agent("node-a")
    [after] = await ready_replicas(cluster, "m1", 1)
    assert (after["id"], after["pid"], after["endpoint"]) == (before["id"], before["pid"], before["endpoint"])
    assert after["restarts"] == 0
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"{cluster.gateway}/v1/completions", json={"model": "m1", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text


async def test_crashed_engine_is_restarted_and_reported(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    assert cluster.ctl("models", "add", "m1", "--engine", "sim").returncode == 0
    [before] = await ready_replicas(cluster, "m1", 1)
    os.kill(before["pid"], signal.SIGKILL)

    async def restarted() -> dict | None:
        rows = [r for r in iter_replicas(cluster, "m1") if r["restarts"] >= 1 and r["state"] == "ready"]
        return rows[0] if rows else None

    after = await eventually(restarted, "the crashed engine to be restarted")
    assert after["id"] == before["id"] and after["pid"] != before["pid"]
    logs = cluster.ctl("logs", after["id"])
    assert logs.returncode == 0 and "llmgw-sim: serving m1" in logs.stdout


async def test_silent_node_is_lost_and_its_replica_replaced_without_touching_it(cluster: Cluster) -> None:
    agent_a = await cluster.start_agent("node-a")
    assert cluster.ctl("models", "add", "m1", "--engine", "sim").returncode == 0
    [first] = await ready_replicas(cluster, "m1", 1)
    await cluster.start_agent("node-b")
    silent = agent_a if first["node_id"] == "node-a" else cluster.agents["node-b"]
    other = "node-b" if first["node_id"] == "node-a" else "node-a"

    silent.signal(signal.SIGSTOP)  # a hung agent: no heartbeats, connection open

    async def lost() -> bool:
        return any(n["id"] == first["node_id"] and n["state"] == "lost" for n in cluster.ctl_json("nodes"))

    await eventually(lost, f"{first['node_id']} marked lost")

    async def replaced() -> dict | None:
        rows = [r for r in iter_replicas(cluster, "m1") if r["node_id"] == other and r["state"] == "ready"]
        return rows[0] if rows else None

    await eventually(replaced, f"a replacement replica on {other}")
    assert alive(first["pid"]), "the lost node's engine was not touched"

    # The node comes back: one of the two replicas is surplus and is stopped.
    silent.signal(signal.SIGCONT)
    await eventually(lambda: _async(len(list(iter_replicas(cluster, "m1"))) == 1), "the surplus replica stopped")


async def test_certificates_carry_role_and_name(cluster: Cluster, tmp_path: Path) -> None:
    await cluster.start_agent("node-a")
    node_tls = tmp_path / "node-a" / "state" / "tls"

    # A node certificate cannot act as admin.
    out = cluster.ctl("nodes", tls_dir=node_tls)
    assert out.returncode != 0 and "certificate of node 'node-a' cannot act as admin" in out.stderr

    # A node certificate cannot join as another node.
    from llmgw.rpc import convert, net, schema
    from llmgw.rpc.connection import open_client
    from llmgw.rpc.kjtrio import capnp_runtime
    from llmgw.rpc.tls import client_ssl_context, read_credentials
    from llmgw.spec import Hardware

    creds = read_credentials(node_tls)
    context = client_ssl_context(creds.ca_pem, creds.cert_pem, creds.key_pem)
    async with capnp_runtime():
        stream = await net.connect(cluster.rpc, context)
        async with open_client(stream) as client:
            cap = client.bootstrap().cast_as(schema.load().Cluster)
            with pytest.raises(Exception, match="certificate is for node 'node-a', but it tried to join as node 'node-b'"):
                await cap.join({"nodeId": "node-b", "address": "x", "hardware": convert.hardware_dict(Hardware(1, 1, 1))})

    # A certificate from another cluster's CA is refused, with a clear message on both sides.
    from llmgw.rpc.tls import Credentials
    from tests.system.harness import standalone_pki

    standalone_pki(tmp_path / "other")
    with pytest.raises(ClientError, match="not issued by this cluster's CA"):
        async with connect(cluster.rpc, tls_dir=tmp_path / "other" / "admin"):
            pass  # pragma: no cover
    foreign = read_credentials(tmp_path / "other" / "admin")
    mixed = Credentials(creds.ca_pem, foreign.cert_pem, foreign.key_pem, foreign.identity)
    with pytest.raises(ClientError, match="refuse"):
        async with connect(cluster.rpc, credentials=mixed):
            pass  # pragma: no cover
    await cluster.server.wait_for_line(r"refused a connection: .*not issued by (this|the) cluster's CA")  # type: ignore[union-attr]


async def test_ctl_reports_clear_errors(cluster: Cluster) -> None:
    out = cluster.ctl("models", "add", "bad", "--engine", "vlm")
    assert out.returncode == 1 and "engine: unknown engine 'vlm'" in out.stderr
    out = cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "-1")
    assert out.returncode == 1 and "profile.replicas" in out.stderr
    assert cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "0").returncode == 0
    out = cluster.ctl("models", "add", "m1", "--engine", "sim")
    assert out.returncode == 1 and "already exists" in out.stderr
    out = cluster.ctl("models", "remove", "nope")
    assert out.returncode == 1 and "no model 'nope'" in out.stderr
    out = cluster.ctl("models", "add", "m2", "--engine", "sim", "--gpus", "1")
    assert out.returncode == 0

    def gpu_reason() -> bool:  # the reconciler's next pass says why m2 cannot be placed
        return any("m2" in reason and "GPU" in reason for reason in cluster.ctl_json("status")["unplaceable"])

    await eventually(gpu_reason, "status says m2 needs a GPU")
    out = cluster.ctl("nodes", tls_dir=cluster.root / "missing")
    assert out.returncode == 1 and "missing" in out.stderr
