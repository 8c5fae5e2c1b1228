"""Training jobs through the real CLI: checked before anything is stored, queued with the reason
they wait, cancelled, kept in the store across a control plane restart (issue 17).

The training itself (a real trainer on the vLLM environment's torch) is in
tests/engines/test_training_e2e.py; here the job asks for card memory on a node without
GPUs, so the scheduler must say why it does not send it.
"""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import pytest

from tests.system.harness import Cluster, eventually

pytestmark = pytest.mark.system

PAIRS = "".join(f'{{"prompt": "capital of country {i}?", "completion": "city {i}"}}\n' for i in range(12))


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path) as c:
        yield c


async def test_jobs_are_checked_queued_with_their_reason_and_cancelled(cluster: Cluster, tmp_path: Path) -> None:
    await cluster.start_agent("node-a")
    assert cluster.ctl("models", "add", "m1", "--engine", "sim").returncode == 0
    good = tmp_path / "pairs.jsonl"
    good.write_text(PAIRS)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(PAIRS + '{"prompt": "x"}\nnot json\n')

    refused = cluster.ctl("jobs", "train", "--model", "m1", "--data", str(bad))
    assert refused.returncode != 0
    assert "line 13:" in refused.stderr and "line 14: not JSON" in refused.stderr, refused.stderr
    unknown = cluster.ctl("jobs", "train", "--model", "nope", "--data", str(good))
    assert unknown.returncode != 0 and "no model 'nope' in the catalog" in unknown.stderr
    taken = cluster.ctl("jobs", "train", "--model", "m1", "--data", str(good), "--name", "m1")
    assert taken.returncode != 0 and "--name 'm1'" in taken.stderr and "share the model namespace" in taken.stderr
    assert cluster.ctl_json("jobs", "list") == []

    job = cluster.ctl_json("jobs", "train", "--model", "m1", "--data", str(good), "--name", "m1-qa", "--steps", "5",
                           "--gpu-mib", "4096")
    assert (job["state"], job["pairs"], job["params"]["steps"]) == ("queued", 12, 5)

    async def waiting() -> str | None:
        [listed] = cluster.ctl_json("jobs", "list")
        return listed["message"] if listed["message"].startswith("waiting: node-a") else None

    reason = await eventually(waiting, "the job waiting with its reason")
    assert "node-a" in reason, reason

    cancelled = cluster.ctl_json("jobs", "cancel", job["id"])
    assert cancelled["state"] == "cancelled" and "cancelled by" in cancelled["message"]
    again = cluster.ctl("jobs", "cancel", job["id"])
    assert again.returncode != 0 and "ended already" in again.stderr
    shown = cluster.ctl("jobs", "show", job["id"])
    assert shown.returncode == 0 and "m1-qa for m1" in shown.stdout and "12 pairs" in shown.stdout
    nothing = cluster.ctl("jobs", "download", job["id"], "-o", str(tmp_path / "out.tar"))
    assert nothing.returncode != 0 and "has no result" in nothing.stderr

    # A control plane restart: the job and its log (kept in the store) are still there.
    assert cluster.server is not None
    cluster.server.kill()
    await cluster.start_server()
    [listed] = cluster.ctl_json("jobs", "list")
    assert (listed["id"], listed["state"]) == (job["id"], "cancelled")
    logged = cluster.ctl("jobs", "logs", job["id"])
    # The stored line, not the stand-in a job without a log gets ("cancelled: cancelled by ...").
    assert logged.returncode == 0 and logged.stdout.splitlines() == [listed["message"]], logged.stdout + logged.stderr
