"""The node agent under operators' faults, with real processes: a second agent on one state
directory, and the agent's state disk running full (a small tmpfs this test mounts).

"No orphan engine" is counted by the engines' marker (llmgw.node.markers), the way an
agent finds them, and by every engine process whose working directory is the cluster's.
"""

from __future__ import annotations

import errno
import re
import os
import signal
import subprocess
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest

from llmgw.node import markers
from tests.system.harness import LLMGW, Cluster, Proc, engines_under, eventually, iter_replicas, ready_replicas

pytestmark = pytest.mark.system

#: Big enough for the agent's certificates, lock and a shard's state and log; small
#: enough to fill in a moment.
TMPFS_SIZE = "4m"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path, lost_after="3s", replace_grace="2s") as c:
        yield c


async def test_second_agent_on_one_state_dir_exits_naming_the_first(cluster: Cluster) -> None:
    first = await cluster.start_agent("node-a")
    second = Proc([*LLMGW, "agent", "-c", str(cluster.root / "node-a" / "agent.yaml")],
                  cluster.root / "agent-node-a-second.log")
    try:
        code = await second.wait_exit()
    finally:
        second.kill()
    output = second.output()
    assert code == 1, output
    assert f"in use by process {first.pid}" in output and "Traceback" not in output
    assert first.popen.poll() is None
    assert [(n["id"], n["state"]) for n in cluster.ctl_json("nodes")] == [("node-a", "online")]


def _fill(directory: Path) -> Path:
    """Writes a file in ``directory`` until its file system is full; returns the file."""
    filler = directory / "filler"
    chunk = b"\0" * 65536
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


@pytest.fixture
def small_state_dir(tmp_path: Path) -> Iterator[Path]:
    """node-a's agent state directory on a TMPFS_SIZE tmpfs; skipped where mounting is not permitted."""
    state = tmp_path / "node-a" / "state"
    state.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700", "tmpfs", str(state)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the full-disk drill (needs root and CAP_SYS_ADMIN): "
                    f"{mounted.stderr.strip() or mounted.returncode}")
    try:
        yield state
    finally:
        for proc in engines_under(tmp_path):  # nothing may keep the mount busy
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        subprocess.run(["umount", "-l", str(state)], capture_output=True)


async def test_full_state_disk_leaves_no_orphan_engine(cluster: Cluster, small_state_dir: Path) -> None:
    """The engine crashes while the state disk is full: each new engine whose pid cannot be
    recorded is stopped and says so in one line; once space is back, exactly one engine
    serves, the one the agent recorded, and no marked engine is left over."""
    await cluster.start_agent("node-a")
    assert cluster.ctl("models", "add", "m1", "--engine", "sim").returncode == 0
    [before] = await ready_replicas(cluster, "m1", 1)

    filler = _fill(small_state_dir)
    os.kill(before["pid"], signal.SIGKILL)

    async def unrecorded() -> dict | None:
        rows = [r for r in iter_replicas(cluster, "m1") if "could not be recorded" in r["message"]]
        return rows[0] if rows else None

    row = await eventually(unrecorded, "a restart refused for want of space")
    assert "\n" not in row["message"] and "stopped it rather than leave it unmanaged" in row["message"]

    filler.unlink()
    [after] = await ready_replicas(cluster, "m1", 1)
    shards = small_state_dir / "shards"
    assert [m.identity.pid for m in markers.find_marked(shards)] == [after["pid"]]
    assert [p.pid for p in engines_under(cluster.root)] == [after["pid"]]


async def test_start_the_node_could_not_record_is_cleared_at_once_and_placed_anew(
    cluster: Cluster, small_state_dir: Path
) -> None:
    """A start refused for want of space leaves a failed row for a shard the node never
    had: its stop is answered "unknown shard", so the row goes on that one call (never
    retried) and the model is placed anew once there is space."""
    await cluster.start_agent("node-a")
    filler = _fill(small_state_dir)
    assert cluster.ctl("models", "add", "m1", "--engine", "sim").returncode == 0
    assert cluster.server is not None
    await cluster.server.wait_for_line(r"node-a: unknown shard '\S+': .*; counting it as stopped")
    filler.unlink()

    async def one_ready() -> list[dict] | None:
        rows = list(iter_replicas(cluster, "m1"))
        return rows if [r["state"] for r in rows] == ["ready"] else None

    await eventually(one_ready, "one ready replica of m1 once there is space")
    log = cluster.server.output()
    assert "will retry" not in log
    cleared = log.count("counting it as stopped")
    refused = len(re.findall(r"start of \S+ on node node-a failed", log))
    assert cleared == refused >= 1  # every refused start's row cleared by exactly one stop call
