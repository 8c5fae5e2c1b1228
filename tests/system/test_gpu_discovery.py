"""MIG instances, from discovery to an engine's environment (issue 16), on recorded real output.

A node's agent finds its GPUs through ``nvidia-smi`` (this machine has no NVML): here a
stand-in on its PATH prints what a real A100 80GB machine printed (card 0 in MIG mode with
four 1g.20gb instances, three whole cards; tests/fixtures/nvidia-smi/SOURCES.md). The node
registers the instances as ``0/migN`` with their class; a model asking for two of them is
refused with the reason; one asking for one is placed there and its engine gets the MIG
UUID in CUDA_VISIBLE_DEVICES; one asking for two GPUs of no class gets two whole cards.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from llmgw.node.gpus.discover import import_pynvml
from llmgw.spec import gpu_display
from tests.system.harness import LLMGW, Cluster, Proc, eventually, metric_sum, ready_replicas

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
QUERY = FIXTURES / "telegraf-a100-sxm4-80gb-mig.xml"
LISTING = FIXTURES / "telegraf-issue-5812-a100-sxm4-80gb-mig-L.txt"
MIG_CLASS = "a100-80g-mig-1g.20gb"


def nvml_answers() -> bool:
    try:
        nvml = import_pynvml()
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no bindings, no library, no driver: nvidia-smi is asked
        return False
    nvml.nvmlShutdown()
    return True


pytestmark = pytest.mark.skipif(nvml_answers(), reason="NVML answers on this machine: the agent would read its "
                                                       "real GPUs, not the recorded nvidia-smi output")


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


async def test_mig_instances_are_registered_placed_one_replica_each_and_named_by_uuid(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ncase "$*" in\n  "-q -x") cat {QUERY} ;;\n  "-L") cat {LISTING} ;;\n'
                   '  *) echo "stand-in nvidia-smi: unexpected $*" >&2; exit 2 ;;\nesac\n')
    smi.chmod(0o755)
    async with Cluster(tmp_path) as cluster:
        config = cluster.node_config("gpu-a")
        agent = Proc([*LLMGW, "agent", "-c", str(config)], tmp_path / "agent-gpu-a.log",
                     env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
        cluster.agents["gpu-a"] = agent
        await agent.wait_for_line(r"agent: joined \S+ as node 'gpu-a'")

        [node] = cluster.ctl_json("nodes")
        hw = node["hardware"]
        gpus = {gpu_display(g["index"]): g for g in hw["gpus"]}
        assert sorted(gpus) == ["0/mig0", "0/mig1", "0/mig2", "0/mig3", "1", "2", "3"]
        assert {gpus[f"0/mig{n}"]["gpu_class"] for n in range(4)} == {MIG_CLASS} and gpus["1"]["gpu_class"] == "a100-80g"
        assert hw["driver_version"] == "535.54.03" and hw["cuda_version"] == "12.2"
        table = cluster.ctl("nodes").stdout
        assert f"4x {MIG_CLASS}, 3x a100-80g" in table, table

        refused = cluster.ctl("models", "add", "two-slices", "--engine", "sim", "--gpus", "2", "--gpu-class", MIG_CLASS)
        assert refused.returncode != 0 and "runs on exactly one instance: gpus must be 1, got 2" in refused.stderr

        assert cluster.ctl("models", "add", "slice", "--engine", "sim", "--gpus", "1",
                           "--gpu-class", MIG_CLASS).returncode == 0
        [slice_replica] = await ready_replicas(cluster, "slice", 1)
        env = environ(slice_replica["pid"])
        mig_uuids = {g["uuid"] for name, g in gpus.items() if "/mig" in name}
        assert env["CUDA_VISIBLE_DEVICES"] in mig_uuids and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"

        assert cluster.ctl("models", "add", "pair", "--engine", "sim", "--gpus", "2").returncode == 0
        [pair] = await ready_replicas(cluster, "pair", 1)
        devices = environ(pair["pid"])["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(devices) == 2 and set(devices) <= {"1", "2", "3"}  # whole cards, never slices

        # The control plane's /metrics carries the node, its cards and its engines (issue 16):
        # each card's readings from the same recorded nvidia-smi answer, the host's from this
        # machine's /proc, each engine's resident memory from its process group.
        async with httpx.AsyncClient(timeout=30) as http:
            async def scraped() -> str | None:
                text = (await http.get(cluster.gateway + "/metrics")).text
                return text if metric_sum(text, "llmgw_shard_memory_bytes", shard=slice_replica["id"]) else None

            text = await eventually(scraped, "the slice's engine memory on the control plane's /metrics")
        node = {"node": "gpu-a"}
        assert metric_sum(text, "llmgw_node_gpus", **node, **{"class": MIG_CLASS}) == 4
        assert metric_sum(text, "llmgw_node_cpus", **node) == os.cpu_count()
        assert metric_sum(text, "llmgw_node_memory_available_bytes", **node) > 0
        assert metric_sum(text, "llmgw_shard_memory_bytes", **node, model="pair") > 0
        # The recorded -q -x has card 0 (in MIG mode) alone; cards 1-3 come from -L, without readings.
        card0 = {**node, "gpu": "0", "class": "a100-80g"}
        assert metric_sum(text, "llmgw_gpu_power_limit_watts", **card0) == 500
        assert metric_sum(text, "llmgw_gpu_memory_temperature_celsius", **card0) == 44
        assert "llmgw_gpu_utilization_percent{" not in text  # N/A in MIG mode: absent, not 0

        shown = cluster.ctl("nodes", "gpu-a")
        assert shown.returncode == 0, shown.stderr
        assert "0/mig3" in shown.stdout and slice_replica["id"] in shown.stdout and "available of" in shown.stdout
        detail = cluster.ctl_json("nodes", "gpu-a")
        assert [g["index"] for g in detail["node"]["telemetry"]["gpus"]] == [0]
        assert {r["id"] for r in detail["replicas"]} == {slice_replica["id"], pair["id"]}
