"""A node's telemetry from sampler to ``/metrics`` (issue 16): the agent's NodeSampler on recorded
nvidia-smi output and this machine's /proc, the wire, the registry's ageing, the fleet's series."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from llmgw.control.fleet_metrics import FleetMetrics, render_fleet
from llmgw.control.registry import Registry
from llmgw.node.gpus.xid import parse_xid_lines
from llmgw.node.telemetry.sampler import NodeSampler
from llmgw.rpc import convert, schema
from llmgw.spec import GpuInfo, Hardware, ShardSpec, ShardState, ShardStatus
from llmgw.telemetry import (
    READING_MAX_AGE_S, SAMPLE_INTERVAL_S, ForeignGpuProcess, GpuTelemetry, NodeTelemetry, ShardUsage, XidCount,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
T4_QUERY = FIXTURES / "gpu-telemetry" / "telegraf-tesla-t4.xml"
MIG_QUERY = FIXTURES / "nvidia-smi" / "telegraf-a100-sxm4-80gb-mig.xml"
MIG_LISTING = FIXTURES / "nvidia-smi" / "telegraf-issue-5812-a100-sxm4-80gb-mig-L.txt"
XID_LOG = FIXTURES / "gpu-telemetry" / "xid-chia-gigahorse-301-dmesg.log"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def no_nvml() -> Any:
    raise ImportError("no NVML on this test's node")


class StandInSmi:
    """nvidia-smi printing recorded output; counts its runs."""

    def __init__(self, query: Path, listing: Path | None = None) -> None:
        self.query, self.listing = query.read_text(), listing.read_text() if listing else ""
        self.runs: list[tuple[str, ...]] = []

    def __call__(self, argv: Any, timeout: float) -> str:
        self.runs.append(tuple(argv[1:]))
        if tuple(argv[1:]) == ("-q", "-x"):
            return self.query
        if tuple(argv[1:]) == ("-L",):
            return self.listing
        raise AssertionError(f"unexpected nvidia-smi {argv}")


def sampler(smi: StandInSmi, clock: Clock, xids: list[Any] | None = None) -> NodeSampler:
    return NodeSampler(import_nvml=no_nvml, run_smi=smi, clock=clock,
                       poll_xids=lambda: (list(xids or ()), ""))


def test_one_nvidia_smi_answer_gives_inventory_and_readings_at_most_every_interval() -> None:
    smi, clock = StandInSmi(T4_QUERY), Clock()
    node = sampler(smi, clock)
    sample = node.sample({})
    assert smi.runs == [("-q", "-x"), ("-L",)]  # one query serves the inventory and the readings
    (card,) = sample.gpus
    assert card.gpu_class == "t4-16g" and card.uuid.startswith("GPU-") and card.age_s == 0
    # The recorded T4: 0 % busy, 0 MiB used... every sensor it printed, in base units, none it lacked.
    assert card.readings["temperature_celsius"] > 0
    assert card.readings["power_limit_watts"] == 70.0
    assert card.readings["sm_clock_hertz"] % 1_000_000 == 0
    assert "memory_temperature_celsius" not in card.readings  # a T4 has no HBM sensor: absent, never 0
    assert card.throttle_reasons is not None
    # This machine's /proc is real: the host readings are there (a rate needs a second sample).
    assert sample.host["memory_available_bytes"] > 0 and "load1" in sample.host
    assert "cpu_utilization_percent" not in sample.host

    first = node.generation
    clock.now += SAMPLE_INTERVAL_S / 2
    again = node.sample({})
    assert len(smi.runs) == 2 and again.gpus[0].age_s == SAMPLE_INTERVAL_S / 2  # not asked again, older
    assert node.generation == first  # nothing new: the heartbeat sends no telemetry
    clock.now += SAMPLE_INTERVAL_S
    later = node.sample({})
    assert len(smi.runs) == 4 and later.gpus[0].age_s == 0 and later.age_s == 0
    assert node.generation > first


def test_readings_older_than_a_minute_are_never_sent() -> None:
    smi, clock = StandInSmi(T4_QUERY), Clock()
    node = sampler(smi, clock)
    assert node.sample({}).gpus
    smi.query = "nvidia-smi: the driver stopped answering"  # every later read fails
    clock.now += READING_MAX_AGE_S + 1
    sample = node.sample({})
    assert sample.gpus == () and "nvidia-smi -q -x failed" in node.inventory().note


def test_mig_card_processes_and_xids() -> None:
    smi, clock = StandInSmi(MIG_QUERY, MIG_LISTING), Clock()
    events = parse_xid_lines(XID_LOG.read_text())
    assert events
    node = sampler(smi, clock, xids=events)
    sample = node.sample({})
    assert {g.gpu_class for g in sample.gpus} == {"a100-80g"}  # readings are per card
    assert any(c.mig_mode for c in node.inventory().cards)
    counted = {(x.pci_address, x.xid): x.count for x in sample.xids}
    assert sum(counted.values()) == len(events)
    clock.now += 1
    assert node.sample({}).xids == sample.xids  # the kernel log is read once a minute


def test_engine_groups_are_not_foreign(monkeypatch: pytest.MonkeyPatch) -> None:
    smi, clock = StandInSmi(T4_QUERY), Clock()
    node = sampler(smi, clock)
    pids = [p.pid for p in node.inventory().processes]
    assert len(pids) >= 2
    # The recorded pids belong to the recording machine: here each is taken to lead its own group.
    monkeypatch.setattr("llmgw.node.telemetry.sampler.os.getpgid", lambda pid: 4242 if pid == pids[0] else pid)
    foreign = {p.pid for p in node.sample({"m-1": 4242}).foreign_processes}
    assert pids[0] not in foreign and set(pids[1:]) <= foreign


FULL = NodeTelemetry(
    age_s=2.5,
    host={"cpu_utilization_percent": 12.5, "load1": 0.5, "memory_available_bytes": 1e9},
    gpus=(GpuTelemetry(0, "GPU-a", "h100-80g", {"temperature_celsius": 41.0}, ("sw_power_cap",), 1.25),
          GpuTelemetry(1, "GPU-b", "h100-80g", {}, None, 0.0)),
    shards=(ShardUsage("m-1", 3.5, 1 << 30), ShardUsage("m-2", None, 4096)),
    foreign_processes=(ForeignGpuProcess(77, "python3", 1, 1024), ForeignGpuProcess(78, "", 1001, None)),
    xids=(XidCount("0000:3b:00", 79, 2, "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."),),
    note="kernel log: no kernel log",
)


def test_telemetry_crosses_the_wire_unchanged() -> None:
    s = schema.load()
    message = s.Telemetry.new_message(**convert.telemetry_dict(FULL))
    with s.Telemetry.from_bytes(message.to_bytes()) as reader:
        assert convert.telemetry_from(reader) == FULL
    assert math.isnan(convert.telemetry_dict(FULL)["shards"][1]["cores"])
    with s.Telemetry.from_bytes(s.Telemetry.new_message().to_bytes()) as empty:
        assert convert.telemetry_from(empty) == NodeTelemetry()  # an agent from before issue 16


def test_fresh_drops_what_is_older_than_a_minute() -> None:
    assert FULL.fresh(10).host == FULL.host and len(FULL.fresh(10).gpus) == 2
    assert FULL.fresh(10).gpus[0].age_s == 11.25
    later = FULL.fresh(READING_MAX_AGE_S - 1)  # host 2.5 s old + 59: gone; card 1 (0 s + 59) stays
    assert later.host == {} and later.shards == () and later.foreign_processes == ()
    assert [g.index for g in later.gpus] == [1]
    assert later.xids == FULL.xids


def series(reg: Registry, clock: Clock) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The fleet's series as a scrape shows them, parsed by prometheus_client's own parser."""
    text = render_fleet(reg.snapshot(), clock()).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_fleet_series_come_from_the_registry_and_age_out() -> None:
    clock = Clock()
    reg = Registry(lost_after=1e6, clock=clock)
    hw = Hardware(16, 64000, 32000, (GpuInfo(0, "GPU-a", "H100", 81559, 80000, "h100-80g"),
                                     GpuInfo(1001, "MIG-x", "A100 MIG 1g.10gb", 9728, 9728, "a100-40g-mig-1g.10gb")))
    epoch = reg.node_joined("n1", "10.0.0.1", hw, ())
    reg.shard_started("n1", ShardSpec("m-1", "m", "sim", "/w", (), {}, 512, 1.0, ()))
    reg.shard_status("n1", ShardStatus("m-1", ShardState.READY, "http://10.0.0.1:1"), epoch=epoch)
    reg.heartbeat("n1", hw, telemetry=FULL, epoch=epoch)

    got = series(reg, clock)
    assert got[("llmgw_node_cpus", (("node", "n1"),))] == 16
    assert got[("llmgw_node_gpus", (("class", "h100-80g"), ("node", "n1")))] == 1
    assert got[("llmgw_node_cpu_utilization_percent", (("node", "n1"),))] == 12.5
    assert got[("llmgw_node_load", (("node", "n1"), ("period", "1m")))] == 0.5
    assert ("llmgw_node_load", (("node", "n1"), ("period", "5m"))) not in got  # not read: absent, never 0
    card = (("class", "h100-80g"), ("gpu", "0"), ("node", "n1"), ("uuid", "GPU-a"))
    assert got[("llmgw_gpu_temperature_celsius", card)] == 41
    assert got[("llmgw_gpu_throttled", (*card[:3], ("reason", "sw_power_cap"), card[3]))] == 1
    assert got[("llmgw_shard_cpu_cores", (("model", "m"), ("node", "n1"), ("shard", "m-1")))] == 3.5
    assert ("llmgw_shard_cpu_cores", (("model", ""), ("node", "n1"), ("shard", "m-2"))) not in got
    assert got[("llmgw_gpu_foreign_processes", (("gpu", "1"), ("node", "n1")))] == 1
    assert got[("llmgw_gpu_foreign_memory_bytes", (("gpu", "1"), ("node", "n1")))] == 1024 * 1024 * 1024
    assert got[("llmgw_gpu_foreign_processes", (("gpu", "0/mig1"), ("node", "n1")))] == 1
    assert got[("llmgw_gpu_xid_errors_total", (("node", "n1"), ("pci", "0000:3b:00"), ("xid", "79")))] == 2

    clock.now += READING_MAX_AGE_S  # no heartbeat for a minute: the readings go, the node stays
    got = series(reg, clock)
    assert ("llmgw_node_cpu_utilization_percent", (("node", "n1"),)) not in got
    assert not any(name.startswith("llmgw_gpu_temperature") for name, _ in got)
    assert got[("llmgw_node_cpus", (("node", "n1"),))] == 16

    reg.heartbeat("n1", hw, telemetry=FULL, epoch=epoch)  # the next heartbeat brings them back
    assert ("llmgw_node_cpu_utilization_percent", (("node", "n1"),)) in series(reg, clock)


def test_label_values_are_escaped() -> None:
    clock = Clock()
    reg = Registry(clock=clock)
    odd = 'n"1\\x\ny'
    epoch = reg.node_joined(odd, "10.0.0.1", Hardware(4, 1000, 500), ())
    reg.heartbeat(odd, Hardware(4, 1000, 500), telemetry=FULL, epoch=epoch)
    assert series(reg, clock)[("llmgw_node_cpus", (("node", odd),))] == 4


async def test_the_fleet_is_written_in_a_thread_and_nothing_while_not_leading() -> None:
    reg = Registry()
    epoch = reg.node_joined("n1", "10.0.0.1", Hardware(4, 1000, 500), ())
    reg.heartbeat("n1", Hardware(4, 1000, 500), telemetry=FULL, epoch=epoch)
    text = (await FleetMetrics(reg.snapshot, trio.current_time).render()).decode()
    assert 'llmgw_node_cpu_utilization_percent{node="n1"} 12.5' in text
    assert await FleetMetrics(lambda: None, trio.current_time).render() == b""


def test_running_training_jobs_are_series_too() -> None:
    from llmgw.training import TrainingJob

    reg = Registry()
    job = TrainingJob("job-1", "tiny-qa", "tiny", "/w", state="running", assigned_node="n1", step=3, steps=10,
                      loss=2.5, first_loss=3.0, peak_memory_bytes=1 << 20)
    fresh = TrainingJob("job-2", "other", "tiny", "/w", state="running", assigned_node="n1")
    text = render_fleet(reg.snapshot(), 0.0, (job, fresh)).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}
    labels = (("adapter", "tiny-qa"), ("job", "job-1"), ("model", "tiny"), ("node", "n1"))
    assert got[("llmgw_training_job_step", labels)] == 3 and got[("llmgw_training_job_steps", labels)] == 10
    assert got[("llmgw_training_job_loss", labels)] == 2.5
    assert not any(name == "llmgw_training_job_loss" and ("job", "job-2") in lab for name, lab in got)  # none yet
