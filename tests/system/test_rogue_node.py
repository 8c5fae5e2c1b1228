"""A node certificate is not a licence to route: a node reports shards only on its own address
and only shard ids of its own (issue 12). A real server and agent; the rogue node is this test,
speaking Cap'n Proto over mutual TLS with a valid node certificate of the cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import capnp
import httpx
import pytest
import trio

from llmgw.cli.pki import issue_to
from llmgw.rpc import convert, net, schema
from llmgw.rpc.connection import open_client
from llmgw.rpc.kjtrio import capnp_runtime
from llmgw.rpc.tls import client_ssl_context
from llmgw.spec import Hardware, ShardSpec, ShardState, ShardStatus
from tests.system.harness import WAIT, Cluster, eventually, iter_replicas, ready_replicas

pytestmark = pytest.mark.system

#: An address no node of the test cluster has (TEST-NET-1, never routed).
ELSEWHERE = "http://192.0.2.1:80"


def rogue_agent(reporters: dict[str, Any], adopted: trio.Event) -> Any:
    """The rogue's ``Agent`` capability: keeps the reporters the control plane hands it."""
    s = schema.load()

    class Shard(s.Shard.Server):
        async def stop(self, graceMs: int, **_: Any) -> None:
            return None

    class Agent(s.Agent.Server):
        async def adopt(self, id: str, reporter: Any, _context: Any, **_: Any) -> None:
            reporters[str(id)] = reporter
            adopted.set()
            _context.results.shard = Shard()

        async def ping(self, **_: Any) -> None:
            return None

    return Agent()


def registration(node_id: str, version: str, features: list[str], shards: list[dict[str, Any]],
                 agent: Any) -> dict[str, Any]:
    """A capnp ``Registration`` of a one-CPU node at 127.0.0.1 with no engines."""
    return {
        "nodeId": node_id, "address": "127.0.0.1", "version": version,
        "hardware": convert.hardware_dict(Hardware(cpu_count=1, memory_total_mb=1024, memory_available_mb=1024)),
        "engines": [], "features": features, "shards": shards, "agent": agent,
    }


def shard(sid: str, state: ShardState, endpoint: str) -> dict[str, Any]:
    spec = ShardSpec(id=sid, model="m1", engine="sim", source="sim://m1")
    return {"spec": convert.shard_spec_dict(spec),
            "status": convert.shard_status_dict(ShardStatus(id=sid, state=state, endpoint=endpoint))}


async def test_a_rogue_node_cannot_route_elsewhere_or_claim_shards(tmp_path: Path) -> None:
    async with Cluster(tmp_path) as cluster:
        await cluster.start_agent("node-a")
        assert cluster.ctl("models", "add", "m1", "--engine", "sim").returncode == 0
        [legit] = await ready_replicas(cluster, "m1", 1)

        creds = issue_to(cluster.ca(), "node", "rogue", tmp_path / "rogue-tls")
        context = client_ssl_context(creds.ca_pem, creds.cert_pem, creds.key_pem)
        reporters: dict[str, Any] = {}
        adopted = trio.Event()
        async with capnp_runtime():
            stream = await net.connect(cluster.rpc, context)
            async with open_client(stream) as client:
                cluster_cap = client.bootstrap().cast_as(schema.load().Cluster)
                shards = [
                    shard("m1-elsewhere", ShardState.READY, ELSEWHERE),  # another host
                    shard(legit["id"], ShardState.READY, "http://127.0.0.1:1"),  # node-a's shard id
                    shard("m1-own", ShardState.STARTING, ""),  # its own: accepted
                ]
                with trio.fail_after(WAIT):
                    await cluster_cap.join(registration("rogue", "0", ["adopt"], shards,
                                                        rogue_agent(reporters, adopted)))
                    await adopted.wait()
                assert sorted(reporters) == ["m1-own"], "refused shards are not adopted"

                # Through the reporter of its own shard: READY, but on another host.
                ready_elsewhere = ShardStatus(id="m1-own", state=ShardState.READY, endpoint=ELSEWHERE)
                with pytest.raises(capnp.KjException, match="is not this node's address"):
                    with trio.fail_after(WAIT):
                        await reporters["m1-own"].status(convert.shard_status_dict(ready_elsewhere))

                rows = {r["id"]: r for r in iter_replicas(cluster, "m1")}
                assert "m1-elsewhere" not in rows
                assert rows[legit["id"]]["node_id"] == "node-a" and rows[legit["id"]]["endpoint"] == legit["endpoint"]
                assert all(r["endpoint"] != ELSEWHERE for r in rows.values())
                async with httpx.AsyncClient(timeout=30) as http:
                    for _ in range(10):
                        r = await http.post(f"{cluster.gateway}/v1/completions",
                                            json={"model": "m1", "prompt": "hi", "max_tokens": 2})
                        assert r.status_code == 200, r.text

        assert cluster.server is not None
        log = await eventually(lambda: _found(cluster, "refused a status of shard 'm1-own'"), "the refusals logged")
        assert "node rogue: refused shard 'm1-elsewhere' of 'm1' at join: endpoint host '192.0.2.1'" in log
        assert f"node rogue: refused shard '{legit['id']}' at join: that shard id runs on node node-a" in log


async def _found(cluster: Cluster, text: str) -> str | None:
    assert cluster.server is not None
    output = cluster.server.output()
    return output if text in output else None


async def test_an_agent_of_another_node_protocol_is_refused_with_both_releases_named(tmp_path: Path) -> None:
    async with Cluster(tmp_path) as cluster:
        creds = issue_to(cluster.ca(), "node", "future", tmp_path / "future-tls")
        context = client_ssl_context(creds.ca_pem, creds.cert_pem, creds.key_pem)
        async with capnp_runtime():
            stream = await net.connect(cluster.rpc, context)
            async with open_client(stream) as client:
                cluster_cap = client.bootstrap().cast_as(schema.load().Cluster)
                future = registration("future", "9.0.0", ["protocol:2", "adopt"], [],
                                      rogue_agent({}, trio.Event()))
                refused = (r"node future runs llmgw 9\.0\.0, whose node protocol 2 this control plane "
                           r"\(llmgw .*, protocol 1\) cannot speak: "
                           r"upgrade the control planes to llmgw 9\.0\.0 or later")
                with pytest.raises(capnp.KjException, match=refused):
                    with trio.fail_after(WAIT):
                        await cluster_cap.join(future)
        assert "future" not in {n["id"] for n in cluster.ctl_json("nodes")}
