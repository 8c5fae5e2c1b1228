"""``llmgw ctl upgrade``: an agent upgraded over its session from the current tree to a wheel
built here with a higher version, engines kept; a broken release refused at the first node;
``--rollback`` puts the previous release back.

The agent runs from a release root laid out as docs/operations.md says (``ROOT/releases/V``
a copy of this test run's environment, ``ROOT/current`` pointing at it), under a small
supervisor that stands in for systemd: it starts ``ROOT/current/bin/python -m llmgw agent``
again whenever the agent exits with 75 (the unit's ``RestartForceExitStatus=75``).
"""

from __future__ import annotations

import contextlib
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
from tests.system.harness import LLMGW, WAIT, Cluster, Proc, eventually, iter_replicas, ready_replicas

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
    "    print(f'supervisor: agent exited with {rc}', flush=True)\n"
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


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("releases")
    root = work / "opt-llmgw"
    shutil.copytree(sys.prefix, root / "releases" / __version__, symlinks=True)
    os.symlink(f"releases/{__version__}", root / "current")
    return {"root": root, "good": build_wheel(GOOD, work / "wheels", work),
            "broken": build_wheel(BROKEN, work / "broken", work, broken=True),
            "mute": build_wheel(MUTE, work / "mute", work, mute=True)}


def node_row(cluster: Cluster, node: str) -> dict[str, Any]:
    return next(n for n in cluster.ctl_json("nodes") if n["id"] == node)


def engine_pids(cluster: Cluster) -> dict[str, int]:
    return {r["id"]: r["pid"] for r in iter_replicas(cluster) if r["state"] == "ready"}


async def test_an_agent_is_upgraded_over_its_session_and_rolled_back(tmp_path: Path, releases: dict[str, Path]) -> None:
    root = releases["root"]
    async with Cluster(tmp_path) as cluster:
        config = cluster.node_config("node-a")
        agent = Proc([sys.executable, "-c", SUPERVISOR, str(root / "current" / "bin" / "python"), "-m", "llmgw",
                      "agent", "-c", str(config)], cluster.root / "agent-node-a.log")
        cluster.agents["node-a"] = agent
        try:
            await upgrade_and_roll_back(cluster, agent, root, releases)
        finally:  # the supervisor and the agent it runs (its child, in its process group)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)


async def upgrade_and_roll_back(cluster: Cluster, agent: Proc, root: Path, releases: dict[str, Path]) -> None:
    await agent.wait_for_line(r"agent: joined \S+ as node 'node-a'")
    out = cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "2")
    assert out.returncode == 0, out.stderr
    await ready_replicas(cluster, "m1", 2)
    pids = engine_pids(cluster)
    assert node_row(cluster, "node-a")["version"] == __version__

    # A release that does not import is refused by the node before anything is switched.
    out = cluster.ctl("upgrade", str(releases["broken"]), "--timeout", "2m")
    assert out.returncode == 1
    assert "deliberately broken" in out.stderr and "stopped before the next node" in out.stderr, out.stderr
    assert os.readlink(root / "current") == f"releases/{__version__}"
    assert not (root / "releases" / BROKEN).exists()
    assert node_row(cluster, "node-a")["version"] == __version__

    # A release that installs and starts but never joins goes back by itself after the run's timeout.
    out = cluster.ctl("upgrade", str(releases["mute"]), "--timeout", "8s")
    assert out.returncode == 1 and f"node-a is not back on {MUTE} within 8s" in out.stderr, out.stdout + out.stderr

    async def back_on_the_old_one() -> bool:
        row = node_row(cluster, "node-a")
        return row["state"] == "online" and row["version"] == __version__

    await eventually(back_on_the_old_one, f"node-a back on {__version__} by itself", timeout=WAIT)
    assert os.readlink(root / "current") == f"releases/{__version__}"
    assert not (root / "upgrade-pending.json").exists()
    assert f"llmgw {MUTE} did not join a control plane by the upgrade's deadline" in agent.output()
    assert engine_pids(cluster) == pids

    out = subprocess.run([*LLMGW, "ctl", "--server", cluster.rpc, "--tls-dir", str(cluster.admin_dir),
                          "upgrade", str(releases["good"]), "--timeout", "3m"],
                         capture_output=True, text=True, timeout=UPGRADE_WAIT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"node-a: back on {GOOD}" in out.stdout and f"every node runs llmgw {GOOD}" in out.stdout
    assert os.readlink(root / "current") == f"releases/{GOOD}"
    assert os.readlink(root / "previous") == f"releases/{__version__}"
    assert node_row(cluster, "node-a")["version"] == GOOD
    assert engine_pids(cluster) == pids  # the engines kept running and were adopted
    assert "supervisor: agent exited with 75" in agent.output()

    again = cluster.ctl_json("upgrade", str(releases["good"]))  # resumes: nothing left to do
    assert again["nodes"] == [{"node": "node-a", "result": "skipped", "version": GOOD}]

    rolled = cluster.ctl_json("upgrade", "--rollback", "node-a")
    assert rolled == {"node": "node-a", "release": __version__, "previous": GOOD}

    await eventually(back_on_the_old_one, f"node-a back on {__version__}", timeout=WAIT)
    assert os.readlink(root / "current") == f"releases/{__version__}"
    await ready_replicas(cluster, "m1", 2)
    assert engine_pids(cluster) == pids
