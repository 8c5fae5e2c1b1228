"""Several control planes on one PostgreSQL store: real processes on loopback.

Three ``llmgw server`` processes share the test's database and the cluster CA; two agents
list all three. One leads; the standbys' gateways route by the leader's stream; killing or
freezing the leader hands the lead to a standby without restarting an engine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest
import trio

from tests.system.harness import Cluster, ControlPlaneProc, engines_under, eventually, ready_replicas
from tests.system.test_restarts import Load, one_request

pytestmark = pytest.mark.postgres

#: Short, so a frozen leader is deposed within seconds (the default is 10 s).
LEASE = "2s"


@pytest.fixture
async def ha(tmp_path: Path, pg_dsn: str) -> AsyncIterator[tuple[Cluster, list[ControlPlaneProc]]]:
    """cp-1 (the first server, so the leader) and the standbys cp-2, cp-3; no agents yet."""
    cluster = Cluster(tmp_path, store_url=pg_dsn, extra={"leader_lease": LEASE})
    standbys: list[ControlPlaneProc] = []
    try:
        await cluster.init()
        await cluster.start_server()
        for name in ("cp-2", "cp-3"):
            standby = ControlPlaneProc(cluster, name)
            await standby.start()
            standbys.append(standby)
        yield cluster, standbys
    finally:
        for standby in standbys:
            standby.stop()
        cluster.stop()


async def start_agents(cluster: Cluster, standbys: list[ControlPlaneProc], *nodes: str) -> None:
    planes = [cluster.rpc, *(s.rpc for s in standbys)]
    for node in nodes:
        await cluster.start_agent(node, extra={"control_planes": planes})


def status_via(cluster: Cluster, rpc: str) -> dict[str, Any] | None:
    """``ctl status --json`` through the control plane at ``rpc`` (None if it failed)."""
    out = cluster.ctl("--server", rpc, "status", "--json")
    if out.returncode != 0:
        return None
    return json.loads(out.stdout)  # type: ignore[no-any-return]


async def served(http: httpx.AsyncClient, gateway: str) -> bool:
    response = await http.post(f"{gateway}/v1/completions", json={"model": "m1", "prompt": "hi", "max_tokens": 2})
    return response.status_code == 200


async def test_killing_the_leader_hands_the_lead_to_a_standby_with_no_engine_restarted(
    ha: tuple[Cluster, list[ControlPlaneProc]],
) -> None:
    cluster, standbys = ha
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(f"{cluster.gateway}/leader")).status_code == 200
        for standby in standbys:
            response = await http.get(f"{standby.gateway}/leader")
            assert response.status_code == 503 and response.json()["leader"] != standby.name
            assert (await http.get(f"{standby.gateway}/healthz")).status_code == 200

        await start_agents(cluster, standbys, "node-a", "node-b")
        assert cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "2").returncode == 0
        await ready_replicas(cluster, "m1", 2)
        # ctl pointed at a standby answers the same (the standby passes it to the leader).
        via_standby = status_via(cluster, standbys[0].rpc)
        assert via_standby is not None and via_standby["replicas_ready"] == 2
        roles = {p["name"]: p["role"] for p in via_standby["control_planes"]}
        assert roles["cp-2"] == roles["cp-3"] == "standby", roles
        old_leader, old_epoch = via_standby["leader"], via_standby["epoch"]
        # Every standby's gateway routes by the leader's table.
        for standby in standbys:
            await eventually(lambda s=standby: served(http, s.gateway), f"{standby.name} serves m1")
        engines = sorted(p.pid for p in engines_under(cluster.root))
        assert len(engines) == 2

        load = Load()
        stop = trio.Event()
        killed = trio.Event()

        async def requests_through_standby() -> None:
            index = 0
            while not stop.is_set():
                index += 1
                await one_request(http, standbys[0].gateway, index, load)
                if killed.is_set() and load.counts["ok"] >= 1000:
                    break

        async with trio.open_nursery() as nursery:
            nursery.start_soon(requests_through_standby)
            await eventually(lambda: load.counts["ok"] >= 20, "requests through cp-2 before the kill")
            assert cluster.server is not None
            cluster.server.kill()
            killed.set()

            async def new_leader() -> dict[str, Any] | None:
                st = status_via(cluster, standbys[0].rpc) or status_via(cluster, standbys[1].rpc)
                return st if st and st["leader"] in ("cp-2", "cp-3") and st["replicas_ready"] == 2 else None

            st = await eventually(new_leader, "a standby leads with both replicas adopted")
            after = load.counts["ok"]
            await eventually(lambda: load.counts["ok"] >= after + 20, "requests through cp-2 after the failover")
            stop.set()

        assert st["epoch"] > old_epoch and st["leader"] != old_leader
        assert load.counts["failed"] == 0, load.failures
        assert sorted(p.pid for p in engines_under(cluster.root)) == engines  # no engine restarted
        leader = next(s for s in standbys if s.name == st["leader"])
        assert (await http.get(f"{leader.gateway}/leader")).status_code == 200
        other = next(s for s in standbys if s.name != st["leader"])
        assert (await http.get(f"{other.gateway}/leader")).status_code == 503
        await eventually(lambda: served(http, other.gateway), "the other standby serves from the new leader")

        # Cluster settings through a standby: checked and stored by the leader, versioned.
        refused = cluster.ctl("--server", other.rpc, "config", "set", "agents.default.log_level", "loud")
        assert refused.returncode == 1 and "agents.default.log_level: expected one of" in refused.stderr
        assert cluster.ctl("--server", other.rpc, "config", "set", "agents.default.log_level", "debug").returncode == 0
        assert cluster.ctl("--server", other.rpc, "config", "set", "agents.nodes.node-a.llamacpp.threads", "8"
                           ).returncode == 0
        settings = {s["key"]: s for s in cluster.ctl_json("--server", leader.rpc, "config", "get")}
        assert settings["agents.default"]["value"] == {"log_level": "debug"}
        assert settings["agents.nodes.node-a"]["value"] == {"llamacpp": {"threads": 8}}
        assert settings["agents.default"]["actor"].endswith(f"(via {other.name})")
        history = cluster.ctl_json("--server", leader.rpc, "config", "history", "agents.default")
        assert [h["version"] for h in history] == [1]

        # Routing settings through a standby: every gateway routes by them, live.
        refused = cluster.ctl("--server", other.rpc, "config", "set", "routing.policy", "fastest")
        assert refused.returncode == 1 and "routing.policy: expected one of kv" in refused.stderr
        assert cluster.ctl("--server", other.rpc, "config", "set", "routing.policy", "round-robin").returncode == 0
        assert cluster.ctl_json("--server", other.rpc, "status")["routing"] == "round-robin"  # the leader's
        for gateway in (leader.gateway, other.gateway):
            await eventually(lambda g=gateway: routes_by(http, g, "round-robin"), f"{gateway} routes round-robin")
        assert cluster.ctl("--server", leader.rpc, "config", "unset", "routing").returncode == 0
        assert cluster.ctl_json("--server", other.rpc, "status")["routing"].startswith("kv (")
        await eventually(lambda: routes_by(http, other.gateway, "kv"), "the standby routes by server.yaml again")

        # The HTTP admin API through a standby: the leader answers, checks and audits.
        token = cluster.ctl("--server", other.rpc, "admin-tokens", "create", "ops-bot").stdout.strip()
        bearer = {"authorization": f"Bearer {token}"}
        answer = await http.get(f"{other.gateway}/api/v1/status", headers=bearer)
        assert answer.status_code == 200 and answer.json()["leader"] == leader.name, answer.text
        answer = await http.put(f"{other.gateway}/api/v1/settings/routing.policy", headers=bearer,
                                content=b'"least-load"')
        assert answer.status_code == 200 and answer.json()["actor"] == f"token ops-bot (via {other.name})", answer.text
        await eventually(lambda: routes_by(http, other.gateway, "least-load"), "the standby routes least-load")
        answer = await http.put(f"{other.gateway}/api/v1/settings/routing.policy", headers=bearer, content=b'"x"')
        assert answer.status_code == 400 and "routing.policy: expected one of" in answer.json()["error"]["message"]
        assert (await http.get(f"{other.gateway}/api/v1/status")).status_code == 401
        token_id = token.split("_")[1]
        assert cluster.ctl("--server", leader.rpc, "admin-tokens", "revoke", token_id).returncode == 0
        answer = await http.get(f"{other.gateway}/api/v1/status", headers=bearer)
        assert answer.status_code == 401 and "was revoked" in answer.json()["error"]["message"]

        # ctl stop through a standby: the leader stores it and every gateway answers 503.
        assert cluster.ctl("--server", other.rpc, "stop").returncode == 0
        for gateway in (leader.gateway, other.gateway):
            await eventually(lambda g=gateway: _stopped(http, g), f"{gateway} answers system_stopped")


async def test_a_frozen_leader_is_deposed_and_steps_down_when_it_wakes(
    ha: tuple[Cluster, list[ControlPlaneProc]],
) -> None:
    cluster, standbys = ha
    await start_agents(cluster, standbys, "node-a")
    assert cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "1").returncode == 0
    await ready_replicas(cluster, "m1", 1)
    engines = sorted(p.pid for p in engines_under(cluster.root))
    first = status_via(cluster, cluster.rpc)
    assert first is not None and first["epoch"] >= 1
    assert cluster.server is not None
    cluster.server.signal(signal.SIGSTOP)

    async def deposed() -> dict[str, Any] | None:
        st = status_via(cluster, standbys[0].rpc) or status_via(cluster, standbys[1].rpc)
        return st if st and st["leader"] in ("cp-2", "cp-3") and st["replicas_ready"] == 1 else None

    st = await eventually(deposed, "a standby leads while cp-1 is frozen")
    assert st["epoch"] > first["epoch"]
    cluster.server.signal(signal.SIGCONT)
    await cluster.server.wait_for_line(r"stopped leading \(epoch %d\)" % first["epoch"])
    async with httpx.AsyncClient(timeout=10) as http:
        await eventually(lambda: _is(http, f"{cluster.gateway}/leader", 503), "cp-1 says it does not lead")
        # The woken control plane is a standby now: ctl through it reaches the new leader.
        again = await eventually(lambda: status_via(cluster, cluster.rpc), "ctl through cp-1")
        assert again["leader"] == st["leader"] and again["epoch"] == st["epoch"]
        await eventually(lambda: served(http, cluster.gateway), "cp-1's gateway serves from the new leader")
    assert sorted(p.pid for p in engines_under(cluster.root)) == engines


async def test_an_agent_that_knows_one_control_plane_learns_the_others_and_fails_over(
    ha: tuple[Cluster, list[ControlPlaneProc]],
) -> None:
    cluster, standbys = ha
    await cluster.start_agent("node-a")  # its agent.yaml names cp-1 only
    learned = cluster.root / "node-a" / "state" / "control_planes.json"
    expected = [cluster.rpc, *(s.rpc for s in standbys)]

    def learned_all() -> bool:
        return learned.exists() and sorted(json.loads(learned.read_text())) == sorted(expected)

    await eventually(learned_all, "the agent learnt every control plane")
    assert json.loads(learned.read_text())[0] == cluster.rpc  # the leader first
    assert cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "1").returncode == 0
    [replica] = await ready_replicas(cluster, "m1", 1)
    assert cluster.server is not None
    cluster.server.kill()
    agent = cluster.agents["node-a"]
    await agent.wait_for_line(r"agent: joined 127\.0\.0\.1:(?!%s)\d+ as node 'node-a' \(1 shards\)"
                              % cluster.rpc.rsplit(":", 1)[1])

    async def adopted() -> dict[str, Any] | None:
        st = status_via(cluster, standbys[0].rpc) or status_via(cluster, standbys[1].rpc)
        return st if st and st["replicas_ready"] == 1 else None

    await eventually(adopted, "the new leader has the replica")
    assert [p.pid for p in engines_under(cluster.root)] == [replica["pid"]]


@pytest.fixture
def private_pg() -> Iterator[tuple[str, list[str]]]:
    """A throwaway PostgreSQL server of this test's own (scripts/ensure-postgres.sh):
    yields its DSN and the pg_ctl command line (without the action) that controls it."""
    out = subprocess.run(["scripts/ensure-postgres.sh"], env={**os.environ, "LLMGW_PG_FORCE_NEW": "1"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    match = re.search(r"stop it with: (.*) stop$", out.stderr, re.M)
    assert match, out.stderr
    pg_ctl = match.group(1).split()
    try:
        yield out.stdout.strip(), pg_ctl
    finally:
        subprocess.run([*pg_ctl, "stop", "-m", "immediate"], capture_output=True, timeout=60)
        data = Path(pg_ctl[pg_ctl.index("-D") + 1])
        shutil.rmtree(data.parent, ignore_errors=True)


async def test_the_control_planes_ride_out_a_postgresql_restart_under_load(
    tmp_path: Path, private_pg: tuple[str, list[str]],
) -> None:
    dsn, pg_ctl = private_pg
    cluster = Cluster(tmp_path, store_url=dsn, extra={"leader_lease": LEASE})
    standby: ControlPlaneProc | None = None
    try:
        await cluster.init()
        await cluster.start_server()
        standby = ControlPlaneProc(cluster, "cp-2")
        await standby.start()
        await start_agents(cluster, [standby], "node-a")
        assert cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "2").returncode == 0
        await ready_replicas(cluster, "m1", 2)
        engines = sorted(p.pid for p in engines_under(cluster.root))
        gateways = [cluster.gateway, standby.gateway]
        load = Load()
        restarted = trio.Event()
        async with httpx.AsyncClient(timeout=10) as http:
            await eventually(lambda: served(http, standby.gateway), "cp-2 serves m1")

            async def requests_through_both() -> None:
                index = 0
                while True:
                    index += 1
                    await one_request(http, gateways[index % 2], index, load)
                    if restarted.is_set() and load.counts["ok"] >= 200:
                        return

            async with trio.open_nursery() as nursery:
                nursery.start_soon(requests_through_both)
                await eventually(lambda: load.counts["ok"] >= 20, "requests before the restart")
                # -l: the restarted server must not hold pg_ctl's output open (it would never end).
                server_log = Path(pg_ctl[pg_ctl.index("-D") + 1]).parent / "server.log"
                restart = await trio.to_thread.run_sync(lambda: subprocess.run(
                    [*pg_ctl, "restart", "-m", "fast", "-l", str(server_log)], stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE, text=True, timeout=120))
                assert restart.returncode == 0, restart.stderr
                restarted.set()

                async def led_again() -> dict[str, Any] | None:
                    # The restart ended the leader's database session: the lead is taken again, at epoch 2.
                    st = status_via(cluster, cluster.rpc) or status_via(cluster, standby.rpc)
                    return st if st and st["epoch"] >= 2 and st["replicas_ready"] == 2 else None

                await eventually(led_again, "a control plane leads again, with both replicas")
        assert load.counts["failed"] == 0, load.failures
        assert sorted(p.pid for p in engines_under(cluster.root)) == engines
    finally:
        if standby is not None:
            standby.stop()
        cluster.stop()


async def routes_by(http: httpx.AsyncClient, gateway: str, policy: str) -> bool:
    """Whether ``gateway``'s /metrics says it routes by ``policy`` (and by no other)."""
    lines = (await http.get(f"{gateway}/metrics")).text.splitlines()
    return (f'llmgw_gateway_routing_policy{{policy="{policy}"}} 1.0' in lines
            and sum(line.startswith("llmgw_gateway_routing_policy{") and line.endswith(" 1.0") for line in lines) == 1)


async def _stopped(http: httpx.AsyncClient, gateway: str) -> bool:
    response = await http.post(f"{gateway}/v1/completions", json={"model": "m1", "prompt": "hi", "max_tokens": 2})
    return response.status_code == 503 and response.json()["error"]["code"] == "system_stopped"


async def _is(http: httpx.AsyncClient, url: str, status: int) -> bool:
    return (await http.get(url)).status_code == status



async def test_ctl_restart_restarts_agents_then_standbys_then_the_leader_with_engines_serving(
    ha: tuple[Cluster, list[ControlPlaneProc]],
) -> None:
    cluster, standbys = ha
    await start_agents(cluster, standbys, "node-a", "node-b")
    assert cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "2").returncode == 0
    await ready_replicas(cluster, "m1", 2)
    engines = sorted(p.pid for p in engines_under(cluster.root))
    cluster.pin_ports()  # each process comes back on the ports it has (the agents dial those)
    for standby in standbys:
        standby.pin_ports()
    # Through a standby: it passes the call on, and restarts last, after passing the answer back.
    out = cluster.ctl("--server", standbys[0].rpc, "restart", "--json")
    assert out.returncode == 0, out.stderr
    done = json.loads(out.stdout)
    assert (done["agents"], done["standbys"]) == (2, 2)
    for node in ("node-a", "node-b"):
        assert "agent: restarting (asked by llmgw ctl restart)" in cluster.agents[node].output()
    assert cluster.server is not None
    await cluster.server.wait_for_line(r"llmgw server: restarting \(llmgw ctl restart\)")
    for standby in standbys:
        assert standby.proc is not None
        await standby.proc.wait_for_line(r"llmgw server: restarting \(asked by the leader: llmgw ctl restart")
        await standby.proc.wait_for_line(r"(?s)restarting.*llmgw server: rpc")

    async def settled() -> dict[str, Any] | None:
        st = status_via(cluster, standbys[1].rpc)
        roles = sorted(p["role"] for p in st["control_planes"]) if st else []
        return st if st and st["replicas_ready"] == 2 and roles == ["leader", "standby", "standby"] else None

    await eventually(settled, "a leader, two standbys and both replicas after the restart")
    assert sorted(p.pid for p in engines_under(cluster.root)) == engines
