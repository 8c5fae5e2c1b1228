"""``llmgw ctl nodes add|remove`` and ``llmgw agent join``, as an operator onboards a node.

A control plane mints a node token; ``llmgw agent join`` (a real process with nothing but
the control plane's address and the token; a fresh state directory stands for a new machine)
writes the TLS files and an agent.yaml; the agent started from them joins and serves a
replica. The token works once; a token naming no node takes ``--name``; a token's labels and
disabled engines reach the node's agent.yaml, its registration and placement; removing a node
revokes its certificate, so its agent is refused from then on, and its replica is placed
on another node. Without ``--no-start`` the join installs and starts the agent unit (through
a stand-in systemctl: systemd cannot run here).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

from llmgw import __version__

from tests.system.harness import LLMGW, WAIT, Cluster, Proc, eventually, ready_replicas
from tests.system.test_service import STAND_IN


def agent_join(tmp_path: Path, node: str, token: str, server: str, *extra: str,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LLMGW, "agent", "--config", str(tmp_path / f"{node}.yaml"), "join", "--server", server, "--token", token,
         "--state-dir", str(tmp_path / node), "--engine-user", "", *extra],
        capture_output=True, text=True, timeout=WAIT, env={**os.environ, **(env or {})},
    )


def online(cluster: Cluster) -> set[str]:
    return {n["id"] for n in cluster.ctl_json("nodes") if n["state"] == "online"}


async def test_a_node_joins_with_a_token_once_serves_and_is_refused_once_removed(tmp_path: Path) -> None:
    async with Cluster(tmp_path) as cluster:
        added = cluster.ctl_json("nodes", "add", "n1", "--ttl", "10m")
        token = added["token"]
        assert added["command"] == f"sudo llmgw agent join --server {cluster.rpc} --token {token}"
        refused = cluster.ctl("nodes", "add", "not a name")
        assert refused.returncode != 0 and "cannot name a node" in refused.stderr

        out = agent_join(tmp_path, "n1", token, cluster.rpc, "--no-start")
        assert out.returncode == 0, out.stderr + out.stdout
        assert "node n1" in out.stdout and "this node has " in out.stdout and " CPUs, " in out.stdout
        written = yaml.safe_load((tmp_path / "n1.yaml").read_text())
        assert written["control_planes"] == [cluster.rpc] and written["node_id"] == "n1"
        assert written["tls"]["key"] == str(tmp_path / "n1" / "tls" / "key.pem") and written["engine_user"] == ""
        assert "engines run as the agent's own user" in out.stdout
        assert "  llmgw doctor:\n" in out.stdout and " failure(s), " in out.stdout  # onboarding runs the doctor
        assert (tmp_path / "n1" / "tls" / "key.pem").stat().st_mode & 0o777 == 0o600
        again = agent_join(tmp_path, "n1", token, cluster.rpc, "--no-start")
        assert again.returncode == 0 and "joined this cluster already, as node n1" in again.stdout, again.stderr
        reused = agent_join(tmp_path, "n9", token, cluster.rpc, "--no-start")
        assert reused.returncode != 0 and "used already" in reused.stderr, reused.stderr

        # A token naming no node: the node asks for its name (--name here; the host name by default).
        # It carries labels and a disabled engine into the node's agent.yaml.
        bad = cluster.ctl("nodes", "add", "--disable-engine", "trtllm")
        assert bad.returncode != 0 and '--disable-engine: "trtllm" is not an engine llmgw runs' in bad.stderr
        unnamed = cluster.ctl_json("nodes", "add", "--labels", "rack=r2,zone=eu", "--disable-engine", "vllm")
        assert unnamed["labels"] == {"rack": "r2", "zone": "eu"} and unnamed["disabled_engines"] == ["vllm"]
        listed = cluster.ctl("servers", "list")
        assert "(labels rack=r2,zone=eu; vllm disabled)" in listed.stdout, listed.stdout
        out = agent_join(tmp_path, "n2", unnamed["token"], cluster.rpc, "--name", "n2", "--no-start")
        assert out.returncode == 0 and "node n2" in out.stdout, out.stderr
        assert "labels rack=r2,zone=eu; vllm disabled" in out.stdout
        written = yaml.safe_load((tmp_path / "n2.yaml").read_text())
        assert written["labels"] == {"rack": "r2", "zone": "eu"} and written["disabled_engines"] == ["vllm"]

        agents = [Proc([*LLMGW, "agent", "-c", str(tmp_path / f"{n}.yaml")], tmp_path / f"agent-{n}.log")
                  for n in ("n1", "n2")]
        cluster.agents.update(zip(("n1", "n2"), agents))
        await eventually(lambda: online(cluster) == {"n1", "n2"}, "both joined nodes online")
        # The doctor on a joined node: the control plane answers its certificate; --json has the facts.
        doctor = subprocess.run([*LLMGW, "doctor", "-c", str(tmp_path / "n1.yaml"), "--json", "--no-engine-checks"],
                                capture_output=True, text=True, timeout=WAIT)
        report = json.loads(doctor.stdout)
        assert doctor.returncode == (0 if report["ok"] else 1), doctor.stderr
        planes = [f for f in report["findings"] if f["topic"] == "control-plane"]
        assert planes == [{"severity": "ok", "topic": "control-plane", "fix": "",
                           "message": f"reachable with this node's certificate: {cluster.rpc}"}], planes
        assert report["facts"]["control_planes"][0]["reachable"] and report["facts"]["cpus"] == os.cpu_count()
        nodes = {n["id"]: n for n in cluster.ctl_json("nodes")}
        assert nodes["n2"]["labels"] == {"rack": "r2", "zone": "eu"} and nodes["n1"]["labels"] == {}
        vllm_on_n2 = next(e for e in nodes["n2"]["engines"] if e["name"] == "vllm")
        assert not vllm_on_n2["installed"] and "disabled on this node" in vllm_on_n2["detail"]
        # A model asking for rack=r2 lands on n2 alone.
        assert cluster.ctl("models", "add", "pinned", "--engine", "sim", "--node-labels", "rack=r2").returncode == 0
        [pinned] = await ready_replicas(cluster, "pinned", 1)
        assert pinned["node_id"] == "n2"
        assert cluster.ctl("models", "remove", "pinned").returncode == 0
        assert cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "2").returncode == 0
        replicas = await ready_replicas(cluster, "m1", 2)

        # Logs without ssh: the agent's own (kept in memory) and an engine's, over the session.
        agent_log = cluster.ctl_json("logs", "n1", "-n", "2000")["lines"]
        assert any("agent: joined" in line and "as node 'n1'" in line for line in agent_log), agent_log
        on_n1 = next(r for r in replicas if r["node_id"] == "n1")
        engine_log = cluster.ctl("logs", "n1", "--source", on_n1["id"])
        assert engine_log.returncode == 0 and engine_log.stdout.strip(), engine_log.stderr
        assert cluster.ctl("logs", on_n1["id"]).stdout == engine_log.stdout  # by replica id, as before
        unknown = cluster.ctl("logs", "n1", "--source", "nope")
        assert unknown.returncode != 0 and "it has agent, " in unknown.stderr, unknown.stderr
        assert "-----BEGIN" not in "\n".join(agent_log)

        follower = Proc([*LLMGW, "ctl", "--server", cluster.rpc, "--tls-dir", str(cluster.admin_dir), "logs", "n1",
                         "-f", "-n", "1"], tmp_path / "follow-n1.log")
        await follower.wait_for_line(r"\S")  # following: the last line, then what comes

        removed = cluster.ctl_json("nodes", "remove", "n2")
        assert removed["removed"] and removed["certificates_revoked"] == 1
        await agents[1].wait_for_line(r"it refused this node's certificate")
        assert cluster.server is not None
        await cluster.server.wait_for_line(r"refused connect from node 'n2': .*certificate was revoked")
        assert "n2" not in online(cluster)

        async def both_on_n1() -> bool:
            replicas = cluster.ctl_json("replicas")["replicas"]
            return len(replicas) == 2 and {r["node_id"] for r in replicas} == {"n1"} and \
                all(r["state"] == "ready" for r in replicas)

        await eventually(both_on_n1, "n2's replica placed on n1")
        [moved] = [r["id"] for r in cluster.ctl_json("replicas")["replicas"] if r["id"] != on_n1["id"]]
        await follower.wait_for_line(rf"shard {moved}: ready")  # written after the follow began
        follower.kill()
        gone = cluster.ctl("nodes", "remove", "n2")
        assert gone.returncode != 0 and "no node or pending join token named n2" in gone.stderr

        # Without --no-start: the unit is installed and started through systemctl. A node's token
        # given to `server join` is refused before it is spent.
        token = cluster.ctl_json("nodes", "add", "n3")["token"]
        wrong = subprocess.run(
            [*LLMGW, "server", "--config", str(tmp_path / "cp.yaml"), "join", "--server", cluster.rpc, "--token", token,
             "--state-dir", str(tmp_path / "cp"), "--no-start"], capture_output=True, text=True, timeout=WAIT)
        assert wrong.returncode != 0 and "is for a node (n3), not a control" in wrong.stderr, wrong.stderr
        assert "llmgw agent join" in wrong.stderr
        bin_dir, units, calls = tmp_path / "bin", tmp_path / "units", tmp_path / "systemctl-calls"
        bin_dir.mkdir()
        (bin_dir / "systemctl").write_text(STAND_IN)
        (bin_dir / "systemctl").chmod(0o755)
        root = tmp_path / "opt-llmgw"  # laid out for `ctl upgrade` (a copy of this environment)
        out = agent_join(tmp_path, "n3", token, cluster.rpc, "--unit-dir", str(units), "--release-root", str(root),
                         env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls)})
        assert out.returncode == 0, out.stderr + out.stdout
        unit = (units / "llmgw-agent.service").read_text()
        assert f" agent --config {tmp_path / 'n3.yaml'}\n" in unit and "KillMode=process\n" in unit
        assert f"ExecStart={root}/current/bin/python -m llmgw agent" in unit
        assert os.readlink(root / "current") == f"releases/{__version__}"
        assert (root / "current" / "bin" / "python").exists()
        assert calls.read_text().splitlines() == ["show -p LimitMEMLOCK --value llmgw-agent.service",  # the doctor
                                                  "is-system-running", "daemon-reload",
                                                  "enable --now llmgw-agent.service"]
