"""Engine probing and installs seen from the control plane: ctl nodes, ctl engine-check, placement."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from llmgw.control.placement import StopReplica, plan
from llmgw.node.agent import Agent
from llmgw.node.install import Converger, SimInstaller
from llmgw.node.supervisor import Supervisor
from llmgw.rpc.kjtrio import capnp_runtime
from llmgw.rpc.tls import client_ssl_context, read_credentials
from tests.component.test_install_framework import FakeInstaller
from tests.system.harness import LLMGW, Cluster, eventually
from tests.unit.test_placement import fleet, model, node, shard

pytestmark = pytest.mark.system


async def _ctl(cluster: Cluster, *args: str) -> Any:
    """`llmgw ctl ... --json` run without blocking trio (an agent may live in this process)."""
    out = await trio.run_process(
        [*LLMGW, "ctl", "--server", cluster.rpc, "--tls-dir", str(cluster.admin_dir), *args, "--json"],
        capture_stdout=True, capture_stderr=True, check=False,
    )
    assert out.returncode == 0, out.stderr.decode()
    return json.loads(out.stdout)


async def test_engine_check_and_engines_of_a_real_agent(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        await cluster.init()
        await cluster.start_server()
        await cluster.start_agent("node-a")
        out = cluster.ctl("engine-check", "node-a", "sim")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("sim ") and "built into llmgw" in out.stdout

        unknown = cluster.ctl("engine-check", "node-a", "nosuch")
        assert unknown.returncode != 0 and "'nosuch' is not known to this node" in unknown.stderr
        ghost = cluster.ctl("engine-check", "ghost", "sim")
        assert ghost.returncode != 0 and "node 'ghost' is not connected" in ghost.stderr

        [row] = cluster.ctl_json("nodes")
        assert ("sim", True) in [(e["name"], e["installed"]) for e in row["engines"]]
        # The weights directory exists and its disk is reported from the first heartbeat on.
        assert (tmp_path / "node-a" / "state" / "weights").is_dir()
        assert row["hardware"]["disk_total_mb"] > 0
    finally:
        cluster.stop()


async def test_install_progress_reaches_ctl_nodes_and_placement(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        await cluster.init()
        await cluster.start_server()
        cluster.node_config("node-f")  # issues the node's certificate
        tls = tmp_path / "node-f" / "state" / "tls"
        creds = read_credentials(tls / "ca.pem", tls / "cert.pem", tls / "key.pem")
        fake = FakeInstaller()
        fake.name = "sglang"  # an engine the catalog knows; this fake stands in for its installer
        fake.gate = trio.Event()
        converger = Converger({"sglang": fake, "sim": SimInstaller()})
        async with capnp_runtime(), trio.open_nursery() as nursery:
            agent = Agent(
                node_id="node-f",
                control_planes=[cluster.rpc],
                context=client_ssl_context(creds.ca_pem, creds.cert_pem, creds.key_pem),
                supervisor=Supervisor(tmp_path / "node-f" / "state" / "shards"),
                engine_host="127.0.0.1",
                converger=converger,
            )
            await nursery.start(agent.run)
            converger.want({"sglang": ""})

            async def installing() -> dict[str, Any] | None:
                [row] = await _ctl(cluster, "nodes")
                engines = {e["name"]: e for e in row["engines"]}
                fake_row = engines.get("sglang")
                return fake_row if fake_row and fake_row["state"].startswith("installing: downloading") else None

            row = await eventually(installing, "install progress in ctl nodes")
            assert row["state"] == "installing: downloading fake-1.0.tar.gz (16 MB)" and not row["installed"]

            add = await trio.run_process(
                [*LLMGW, "ctl", "--server", cluster.rpc, "--tls-dir", str(cluster.admin_dir),
                 "models", "add", "m-fake", "--engine", "sglang", "--source", "/models/tiny"], capture_stdout=True, capture_stderr=True, check=False)
            assert add.returncode == 0, add.stderr.decode()

            async def refused() -> str | None:
                reasons = (await _ctl(cluster, "replicas"))["unplaceable"]
                return next((r for r in reasons if "m-fake" in r and "installing: downloading" in r), None)

            reason = await eventually(refused, "placement's refusal naming the install")
            assert "node node-f has sglang not installed yet (installing: downloading" in reason

            fake.gate.set()

            async def installed() -> bool | None:
                [row] = await _ctl(cluster, "nodes")
                return any(e["name"] == "sglang" and e["installed"] and not e["state"] for e in row["engines"]) or None

            await eventually(installed, "the engine reported installed")
            nursery.cancel_scope.cancel()
    finally:
        cluster.stop()


def test_node_that_reports_no_engines_keeps_its_replicas() -> None:
    # An agent whose probe found nothing (or an older agent) must not have its engines stopped.
    quiet = node("n1", engines=(), shards=(shard("s1", "m"),))
    actions = plan([model("m")], fleet(quiet), now=1000.0)
    assert not [a for a in actions if isinstance(a, StopReplica)]
