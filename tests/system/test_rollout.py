"""A changed model rolls out (issue 12): `ctl models add --replace` says what will happen,
two simulated replicas are replaced one at a time under a load loop whose failures are
counted exactly, `ctl replicas` marks the outdated ones, and an agent restart keeps the
fingerprint (its engines are adopted, nothing is rolled out again). Real processes on
loopback; no timing is asserted."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml

from tests.system.harness import Cluster, eventually, iter_replicas, ready_replicas
from tests.system.test_restarts import AFTER, Load, agent_proc, run_load

pytestmark = pytest.mark.system

# The old definition decodes slowly so that one stream on it outlasts the old fixed 5 s drain:
# LONG_STREAM_TOKENS tokens (the simulator's shortest natural answer) at 0.5 s each: 12 s.
OLD_ARG = "--arg=--decode-us-per-token=500000"
NEW_ARG = "--arg=--decode-us-per-token=200"
LONG_STREAM_TOKENS = 24


def add_m1(cluster: Cluster, *args: str) -> Any:
    """`ctl models add m1` on the simulated engine with 2 replicas; returns its --json answer."""
    return cluster.ctl_json("models", "add", "m1", "--engine", "sim", "--replicas", "2", *args)


def shard_state_fingerprints(cluster: Cluster, node_id: str) -> dict[str, str]:
    """Shard id -> the fingerprint the agent persisted in its state directory."""
    state = Path(yaml.safe_load((cluster.root / node_id / "agent.yaml").read_text())["state_dir"])
    return {p.parent.name: json.loads(p.read_text())["spec"]["fingerprint"]
            for p in state.rglob("state.json")}


async def long_stream(gateway: str, done: list[str]) -> None:
    """Streams LONG_STREAM_TOKENS tokens of m1 through the gateway; appends the whole body to ``done``."""
    body = {"model": "m1", "prompt": "a long one", "max_tokens": LONG_STREAM_TOKENS, "stream": True}
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", f"{gateway}/v1/completions", json=body) as response:
            done.append(f"HTTP {response.status_code}\n" + (await response.aread()).decode(errors="replace"))


async def test_replace_rolls_out_one_replica_at_a_time_without_a_failed_request(tmp_path: Path) -> None:
    async with Cluster(tmp_path, lost_after="30s", replace_grace="60s") as cluster:
        config = cluster.node_config("node-a")
        agent = agent_proc(cluster, "node-a", config, 0)
        await agent.wait_for_line(r"agent: joined \S+ as node 'node-a'")
        added = add_m1(cluster, OLD_ARG)
        assert added["rollout"]["kind"] == "new"
        old = {r["id"]: r for r in await ready_replicas(cluster, "m1", 2)}
        (old_fp,) = {r["fingerprint"] for r in old.values()}
        assert old_fp and not any(r["outdated"] for r in old.values())

        load, stop = Load(), trio.Event()
        outdated_seen: set[str] = set()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_load, cluster.gateway, load, stop)
            await eventually(lambda: load.total >= AFTER, "the load loop under way")
            long_done: list[str] = []  # on an old replica: every replica is old yet
            nursery.start_soon(long_stream, cluster.gateway, long_done)

            out = cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "2", NEW_ARG, "--replace")
            assert out.returncode == 0, out.stderr
            assert ("m1: definition changed: 2 replica(s) will be replaced one at a time "
                    "(new ready before old stops)") in out.stdout

            async def rolled_out() -> list[dict[str, Any]] | None:
                rows = list(iter_replicas(cluster, "m1"))
                outdated_seen.update(r["id"] for r in rows if r["outdated"])
                done = (len(rows) == 2 and all(r["state"] == "ready" and r["id"] not in old for r in rows)
                        and not any(r["outdated"] for r in rows))
                return rows if done else None

            new = await eventually(rolled_out, "both replicas replaced by the new definition")
            at_done = load.total
            await eventually(lambda: load.total >= at_done + AFTER, "requests after the rollout")
            stop.set()
        assert load.counts == {"ok": load.total}, load.failures
        # The rollout drained that replica at its engine: the long stream ended, not cut.
        (long_body,) = long_done
        assert long_body.startswith("HTTP 200") and long_body.rstrip().endswith("data: [DONE]"), long_body[-300:]
        assert '"error"' not in long_body, long_body[-300:]
        assert long_body.count('"text":') == LONG_STREAM_TOKENS, long_body[-300:]
        (new_fp,) = {r["fingerprint"] for r in new}
        assert new_fp != old_fp
        assert outdated_seen <= set(old), "only replicas of the old definition were marked outdated"
        assert outdated_seen, "ctl replicas marked the old replicas outdated during the rollout"
        table = cluster.ctl("replicas").stdout
        assert "(outdated)" not in table and new_fp[:8] in table
        assert cluster.server is not None
        server_log = cluster.server.output()
        assert "rollout: draining" in server_log and "rollout in place" not in server_log
        assert server_log.count("rollout: drained") == 2, server_log

        # The agent keeps the fingerprint: persisted, reported again after a kill -9 and an
        # adoption, so the same definition saved again has nothing to roll out.
        assert shard_state_fingerprints(cluster, "node-a") == {r["id"]: new_fp for r in new}
        agent.signal(signal.SIGKILL)
        await agent.wait_exit()
        agent = agent_proc(cluster, "node-a", config, 1)
        await agent.wait_for_line(r"agent: joined \S+ as node 'node-a' \(2 shards\)")
        adopted = await ready_replicas(cluster, "m1", 2)
        assert {(r["id"], r["pid"], r["fingerprint"], r["outdated"]) for r in adopted} == {
            (r["id"], r["pid"], new_fp, False) for r in new}
        again = add_m1(cluster, NEW_ARG, "--replace")
        assert again["rollout"] == {"kind": "unchanged", "outdated": 0, "message": "m1: unchanged: nothing to roll out"}
        assert again["model"]["profile"]["engine_args"] == ["--decode-us-per-token=200"]



async def test_no_room_for_a_surge_rolls_out_in_place_and_says_so(tmp_path: Path) -> None:
    async with Cluster(tmp_path) as cluster:
        await cluster.start_agent("node-a")
        (node,) = cluster.ctl_json("nodes")
        # Each replica reserves just under half the node's memory: two fit, a third (a surge) does not.
        half = str(node["hardware"]["memory_total_mb"] // 2 - 1)
        add_m1(cluster, OLD_ARG, "--memory-mb", half)
        old = {r["id"] for r in await ready_replicas(cluster, "m1", 2)}

        load, stop = Load(), trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_load, cluster.gateway, load, stop)
            await eventually(lambda: load.total >= AFTER, "the load loop under way")
            saved = add_m1(cluster, NEW_ARG, "--memory-mb", half, "--replace")
            assert saved["rollout"]["kind"] == "in-place" and saved["rollout"]["outdated"] == 2
            assert "in place: no room for a surge" in saved["rollout"]["message"]

            async def rolled_out() -> list[dict[str, Any]] | None:
                rows = list(iter_replicas(cluster, "m1"))
                done = len(rows) == 2 and all(r["state"] == "ready" and r["id"] not in old and not r["outdated"]
                                              for r in rows)
                return rows if done else None

            await eventually(rolled_out, "both replicas replaced in place")
            at_done = load.total
            await eventually(lambda: load.total >= at_done + AFTER, "requests after the rollout")
            stop.set()
        assert load.counts == {"ok": load.total}, load.failures
        assert cluster.server is not None
        stops = [line for line in cluster.server.output().splitlines()
                 if "reconciler: stopping" in line and "rollout in place: model m1 changed" in line]
        assert len(stops) == 2, stops
