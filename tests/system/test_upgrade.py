"""``llmgw ctl upgrade``: a control plane and an agent upgraded over the cluster's sessions from
the current tree to a wheel built here with a higher version, engines kept; a broken release
refused by the first to get it; a release that never joins rolled back by the node itself;
``--rollback`` puts the previous release back.

Both run from one release root laid out as docs/operations.md says (``ROOT/releases/V`` a copy
of this test run's environment, ``ROOT/current`` pointing at it), each under a small supervisor
that stands in for systemd: it starts ``ROOT/current/bin/python -m llmgw ...`` again whenever
the process exits with 75 (the units' ``RestartForceExitStatus=75``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llmgw import __version__
from llmgw.sim.launch import free_tcp_port
from tests.system.harness import (LLMGW, WAIT, Cluster, ControlPlaneProc, Proc, eventually, iter_replicas, pin_ports,
                                  ready_replicas)

REPO = Path(__file__).resolve().parents[2]
GOOD, BROKEN, MUTE = f"{__version__}.post1", f"{__version__}.post2", f"{__version__}.post3"
#: Seconds a whole upgrade run may take here: copying the environment, pip, the agent's restart.
UPGRADE_WAIT = 240.0
#: The supervisor standing in for systemd: restart on 75, else exit as the agent did.
#: From "/", as systemd starts it (``python -m`` would import llmgw from the working directory).
SUPERVISOR = (
    "import os, subprocess, sys\n"
    "os.chdir('/')\n"
    "while True:\n"
    "    rc = subprocess.call(sys.argv[1:])\n"
    "    print(f'supervisor: exited with {rc}', flush=True)\n"
    "    if rc != 75:\n"
    "        sys.exit(rc)\n"
)


def build_wheel(version: str, out: Path, work: Path, *, broken: bool = False, mute: bool = False) -> Path:
    """Build llmgw ``version`` from this tree (the files git does not ignore) into ``out``; ``broken``: a
    release whose package fails to import; ``mute``: one whose agent speaks a node protocol no
    control plane takes (it starts, but never joins)."""
    src = work / f"src-{version}"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    for name, pattern in (("pyproject.toml", r'(?m)^version = "[^"]+"'), ("llmgw/__init__.py", r'__version__ = "[^"]+"')):
        text = (src / name).read_text()
        replaced = re.sub(pattern, f'{"version" if name == "pyproject.toml" else "__version__"} = "{version}"', text,
                          count=1)
        assert replaced != text, f"no version in {name}"
        (src / name).write_text(replaced)
    if broken:
        with open(src / "llmgw" / "__init__.py", "a") as f:
            f.write('\nraise ImportError("this release is deliberately broken")\n')
    if mute:
        protocol = src / "llmgw" / "nodeprotocol.py"
        text = protocol.read_text()
        assert "NODE_PROTOCOL = 1\n" in text
        protocol.write_text(text.replace("NODE_PROTOCOL = 1\n", "NODE_PROTOCOL = 99\n"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--wheel-dir", str(out), str(src)], capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 0, done.stdout + done.stderr
    [wheel] = out.glob(f"llmgw-{version}-*.whl")
    return wheel


def release_root(root: Path) -> Path:
    """Lay out ``root`` as a machine's release root holding this test run's environment."""
    shutil.copytree(sys.prefix, root / "releases" / __version__, symlinks=True)
    os.symlink(f"releases/{__version__}", root / "current")
    return root


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("releases")
    return {"root": release_root(work / "opt-llmgw"), "good": build_wheel(GOOD, work / "wheels", work),
            "broken": build_wheel(BROKEN, work / "broken", work, broken=True),
            "mute": build_wheel(MUTE, work / "mute", work, mute=True)}


def node_row(cluster: Cluster, node: str) -> dict[str, Any]:
    return next(n for n in cluster.ctl_json("nodes") if n["id"] == node)


def engine_pids(cluster: Cluster) -> dict[str, int]:
    return {r["id"]: r["pid"] for r in iter_replicas(cluster) if r["state"] == "ready"}


def supervised(root: Path, log: Path, *args: str) -> Proc:
    """``ROOT/current/bin/python -m llmgw ARGS`` under the supervisor (restarted on 75)."""
    return Proc([sys.executable, "-c", SUPERVISOR, str(root / "current" / "bin" / "python"), "-m", "llmgw", *args], log)


async def supervised_server(root: Path, config: Path, log: Path) -> tuple[Proc, str]:
    """Start the control plane of ``config`` from ``root`` (ports pinned: it restarts on them);
    return it and its RPC address once it listens."""
    pin_ports(config, f"127.0.0.1:{free_tcp_port()}", f"http://127.0.0.1:{free_tcp_port()}")
    proc = supervised(root, log, "server", "-c", str(config))
    m = await proc.wait_for_line(r"llmgw server: rpc (\S+), gateway (\S+)/v1")
    return proc, m.group(1)


async def test_the_cluster_is_upgraded_over_its_sessions_and_rolled_back(tmp_path: Path,
                                                                         releases: dict[str, Path]) -> None:
    """One machine, one release root: the control plane and the agent both run from it."""
    root = releases["root"]
    cluster = Cluster(tmp_path)
    procs: list[Proc] = []
    try:
        await cluster.init()
        server, cluster.rpc = await supervised_server(root, cluster.server_yaml, tmp_path / "server.log")
        procs.append(server)
        cluster.server = server
        agent = supervised(root, tmp_path / "agent-node-a.log", "agent", "-c", str(cluster.node_config("node-a")))
        procs.append(agent)
        cluster.agents["node-a"] = agent
        await upgrade_and_roll_back(cluster, server, agent, root, releases)
    finally:  # each supervisor and what it runs (its child, in its process group)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        cluster.stop()


def run_ctl(cluster: Cluster, *args: str, servers: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMGW, "ctl", "--server", servers or cluster.rpc, "--tls-dir", str(cluster.admin_dir),
                           *args], capture_output=True, text=True, timeout=UPGRADE_WAIT)


async def upgrade_and_roll_back(cluster: Cluster, server: Proc, agent: Proc, root: Path,
                                releases: dict[str, Path]) -> None:
    await agent.wait_for_line(r"agent: joined \S+ as node 'node-a'")
    out = cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "2")
    assert out.returncode == 0, out.stderr
    await ready_replicas(cluster, "m1", 2)
    pids = engine_pids(cluster)
    assert node_row(cluster, "node-a")["version"] == __version__

    # A release that does not import is refused by the control plane, the first to get it; nothing is switched.
    out = run_ctl(cluster, "upgrade", str(releases["broken"]), "--timeout", "2m")
    assert out.returncode == 1
    assert "deliberately broken" in out.stderr and "stopped before the nodes" in out.stderr, out.stderr
    assert os.readlink(root / "current") == f"releases/{__version__}"
    assert not (root / "releases" / BROKEN).exists()
    assert node_row(cluster, "node-a")["version"] == __version__

    # A release that installs and starts but never joins goes back by itself after the run's timeout.
    out = run_ctl(cluster, "upgrade", str(releases["mute"]), "--nodes-only", "--timeout", "8s")
    assert out.returncode == 1 and f"node-a is not back on {MUTE} within 8s" in out.stderr, out.stdout + out.stderr

    async def back_on_the_old_one() -> bool:
        row = node_row(cluster, "node-a")
        return row["state"] == "online" and row["version"] == __version__

    await eventually(back_on_the_old_one, f"node-a back on {__version__} by itself", timeout=WAIT)
    assert os.readlink(root / "current") == f"releases/{__version__}"
    assert not (root / "upgrade-pending.json").exists()
    assert f"llmgw {MUTE} did not join a control plane by the upgrade's deadline" in agent.output()
    assert engine_pids(cluster) == pids

    out = run_ctl(cluster, "upgrade", str(releases["good"]), "--timeout", "3m")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"back on {GOOD}" in out.stdout and f"node-a: back on {GOOD}" in out.stdout, out.stdout
    status = cluster.ctl_json("status")
    assert status["version"] == GOOD and [p["version"] for p in status["control_planes"]] == [GOOD]
    assert "supervisor: exited with 75" in server.output()  # the control plane restarted on it too
    assert os.readlink(root / "current") == f"releases/{GOOD}"
    assert os.readlink(root / "previous") == f"releases/{__version__}"
    assert node_row(cluster, "node-a")["version"] == GOOD
    assert engine_pids(cluster) == pids  # the engines kept running and were adopted
    assert "supervisor: exited with 75" in agent.output()

    again = cluster.ctl_json("upgrade", str(releases["good"]))  # resumes: nothing left to do
    assert [r["result"] for r in again["control_planes"]] == ["skipped"]
    assert again["nodes"] == [{"node": "node-a", "result": "skipped", "version": GOOD}]

    rolled = cluster.ctl_json("upgrade", "--rollback", "node-a")
    assert rolled == {"node": "node-a", "release": __version__, "previous": GOOD}

    await eventually(back_on_the_old_one, f"node-a back on {__version__}", timeout=WAIT)
    assert os.readlink(root / "current") == f"releases/{__version__}"
    await ready_replicas(cluster, "m1", 2)
    assert engine_pids(cluster) == pids


@pytest.mark.postgres
async def test_control_planes_are_upgraded_standbys_first(tmp_path: Path, releases: dict[str, Path],
                                                          pg_dsn: str) -> None:
    """Two control planes on PostgreSQL, each from its own machine's release root: the
    standby gets the release through the leader and restarts on it, then the leader itself."""
    root_a = releases["root"]
    root_b = release_root(tmp_path / "machine-b")
    assert os.readlink(root_a / "current") == f"releases/{__version__}"  # the first test rolled back to it
    cluster = Cluster(tmp_path, store_url=pg_dsn, extra={"leader_lease": "3s"})
    procs: list[Proc] = []
    try:
        await cluster.init()
        first, cluster.rpc = await supervised_server(root_a, cluster.server_yaml, tmp_path / "cp-1.log")
        procs.append(first)
        second, rpc_b = await supervised_server(root_b, ControlPlaneProc(cluster, "cp-2").yaml, tmp_path / "cp-2.log")
        procs.append(second)
        servers = f"{cluster.rpc},{rpc_b}"

        def planes() -> dict[str, tuple[str, str]]:
            status = json.loads(run_ctl(cluster, "status", "--json", servers=servers).stdout)
            return {p["name"]: (p["role"], p["version"]) for p in status["control_planes"]}

        await eventually(lambda: planes().get("cp-2", ("", ""))[0] == "standby", "cp-2 attached", timeout=WAIT)
        out = run_ctl(cluster, "upgrade", str(releases["good"]), "--timeout", "3m", servers=servers)
        assert out.returncode == 0, out.stdout + out.stderr
        lines = out.stdout.splitlines()
        standby_back = lines.index(f"control plane cp-2: back on {GOOD}")
        leader_line = next(i for i, line in enumerate(lines) if "(leading)" in line)
        assert standby_back < leader_line  # the standby first, then the leader

        async def all_upgraded() -> bool:
            got = planes()
            return len(got) == 2 and all(version == GOOD for _, version in got.values())

        await eventually(all_upgraded, f"both control planes on {GOOD}", timeout=WAIT)
        assert os.readlink(root_b / "current") == f"releases/{GOOD}"
        assert "supervisor: exited with 75" in second.output() and "supervisor: exited with 75" in first.output()
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        cluster.stop()
