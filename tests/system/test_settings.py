"""Cluster settings pushed to agents: an agent restarts on settings that change it, its engines
kept; agent.yaml edits that load restart it too, ones that do not are refused and logged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw.node.install.llamacpp import find_installed
from tests.system.harness import Cluster, Proc, engines_under, eventually, ready_replicas


def joins(agent: Proc) -> int:
    return agent.output().count("as node 'node-a'")


async def test_an_agent_restarts_on_its_new_settings_and_keeps_its_engines(tmp_path: Path) -> None:
    async with Cluster(tmp_path) as cluster:
        agent = await cluster.start_agent("node-a")
        assert cluster.ctl("models", "add", "m1", "--engine", "sim").returncode == 0
        [replica] = await ready_replicas(cluster, "m1")
        pid = agent.pid

        out = cluster.ctl("config", "set", "agents.nodes.node-a.log_level", "debug")
        assert out.returncode == 0, out.stderr
        await agent.wait_for_line(r"agent: restarting \(the cluster settings changed\)")
        await agent.wait_for_line(r"(?s)restarting.*agent: joined \S+ as node 'node-a' \(1 shards\)")
        assert agent.pid == pid  # the same process, the same service: exec'd, not forked
        kept = cluster.root / "node-a" / "state" / "cluster_settings.json"
        assert json.loads(kept.read_text()) == {"log_level": "debug"}
        await agent.wait_for_line(r" DEBUG ")  # it runs on them
        assert [p.pid for p in engines_under(cluster.root)] == [replica["pid"]]
        [again] = await ready_replicas(cluster, "m1")
        assert again["id"] == replica["id"]

        # A default that the node's own layer overrides changes nothing there: no restart.
        restarts = agent.output().count("agent: restarting")
        assert cluster.ctl("config", "set", "agents.default.log_level", "info").returncode == 0
        assert cluster.ctl("config", "set", "agents.nodes.node-a.heartbeat_interval", "0.4s").returncode == 0
        await eventually(lambda: agent.output().count("agent: restarting") == restarts + 1, "one restart more")
        await eventually(lambda: joins(agent) == restarts + 2, "the agent back")
        assert json.loads(kept.read_text()) == {"log_level": "debug", "heartbeat_interval": "0.4s"}

        # agent.yaml edited: one that does not load is refused, one that loads restarts the agent.
        config = cluster.root / "node-a" / "agent.yaml"
        good = config.read_text()
        config.write_text(good + "\nreconnect_backoff_max: soon\n")
        await agent.wait_for_line(r"agent\.yaml changed but does not load: .*reconnect_backoff_max")
        await eventually(lambda: "reconnect_backoff_max" in config_problem(cluster, "node-a"),
                         "ctl nodes says why node-a runs on its old configuration")
        assert "node-a runs on its previous configuration" in cluster.ctl("nodes").stdout
        restarts = agent.output().count("agent: restarting")
        raw = yaml.safe_load(good)
        raw["reconnect_backoff_max"] = "3s"
        config.write_text(yaml.safe_dump(raw))
        await eventually(lambda: agent.output().count("agent: restarting") == restarts + 1, "a restart on the file")
        assert "agent.yaml changed" in agent.output()
        assert [p.pid for p in engines_under(cluster.root)] == [replica["pid"]]
        await eventually(lambda: joins(agent) == restarts + 2, "the agent back on the new file")
        assert config_problem(cluster, "node-a") == ""


def config_problem(cluster: Cluster, node: str) -> str:
    """Returns ``ctl nodes``' account of why ``node`` runs on an older configuration."""
    return str({n["id"]: n for n in cluster.ctl_json("nodes")}[node]["config_problem"])


async def test_an_engine_named_in_the_clusters_node_settings_wins_over_the_installed_one(tmp_path: Path) -> None:
    built = find_installed()
    if built is None:
        pytest.fail("llama-server is not built: run `make test` (it builds and caches it first)")
    server = tmp_path / "opt" / "llama-server"  # the operator's own, elsewhere than the installed one
    server.parent.mkdir()
    server.write_text(f'#!/bin/sh\nexec {built.binary} "$@"\n')
    server.chmod(0o755)
    async with Cluster(tmp_path) as cluster:
        agent = await cluster.start_agent("node-a")
        out = cluster.ctl("config", "set", "agents.nodes.node-a.engines.llamacpp.server", str(server))
        assert out.returncode == 0, out.stderr
        await eventually(lambda: joins(agent) == 2, "the agent back on its new settings")

        async def named() -> dict[str, Any] | None:
            [node] = cluster.ctl_json("nodes")
            llama = next(e for e in node["engines"] if e["name"] == "llama.cpp")
            return llama if llama["installed"] and llama["path"] == str(server) else None

        llama = await eventually(named, "node-a runs the llama-server its node settings name")
        assert llama["version"] == built.version
