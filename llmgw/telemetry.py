"""A node's live telemetry as it travels from agent to control plane (issue 16).

The agent samples its host and cards at most every :data:`SAMPLE_INTERVAL_S` and sends
the latest :class:`NodeTelemetry` with every heartbeat; the control plane keeps each
node's last one and exports it on ``/metrics`` (llmgw/control/fleet_metrics.py) and in
``ctl nodes NODE``. Readings are named numbers in mappings: a sensor that is not there
(or was not read) is absent from the mapping, never 0. Each part carries its own age so
a reading older than :data:`READING_MAX_AGE_S` is left out wherever it is shown.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

#: The agent samples at most this often: NVML answers in milliseconds, but nvidia-smi
#: takes up to a second per card and a walk of /proc grows with the processes; the
#: control plane and Prometheus (15 s scrapes by default) need no finer grain.
SAMPLE_INTERVAL_S = 10.0

#: A reading older than this is shown nowhere: a card whose reads hang, or a node whose
#: sampler stalled, is better shown as "no reading" than as its last good numbers.
READING_MAX_AGE_S = 60.0

#: The host readings, each with the unit its name says (Prometheus's conventions):
#: the order ``ctl nodes NODE`` lists them in.
HOST_READINGS = (
    "cpu_utilization_percent", "load1", "load5", "load15", "memory_used_bytes", "memory_available_bytes",
    "cpu_package_celsius", "board_inlet_celsius", "cpu_package_watts",
)

#: A card's readings (NVML or ``nvidia-smi -q -x``), in the order they are shown.
#: ``memory_utilization_percent`` is memory bandwidth in use (the share of time memory was
#: read or written), not allocation; ``ecc_uncorrected_errors`` counts since the driver
#: loaded; the ``nvlink_*`` counters are summed over the card's active links.
GPU_READINGS = (
    "utilization_percent", "memory_used_bytes", "memory_utilization_percent", "sm_clock_hertz",
    "ecc_uncorrected_errors", "temperature_celsius", "memory_temperature_celsius", "power_draw_watts",
    "power_limit_watts", "nvlink_crc_flit_errors", "nvlink_crc_data_errors", "nvlink_replay_errors",
    "nvlink_recovery_errors",
)


@attrs.frozen
class GpuTelemetry:
    """One card's readings. ``index`` is the card's index (the order NVML and nvidia-smi list
    cards in); ``throttle_reasons`` names the active clock-event reasons, () none active,
    None not read; ``age_s`` is how old the readings were when sent (or, on the control
    plane, when received)."""

    index: int
    uuid: str
    gpu_class: str
    readings: Mapping[str, float] = attrs.field(factory=dict)
    throttle_reasons: tuple[str, ...] | None = None
    age_s: float = 0.0


@attrs.frozen
class ShardUsage:
    """What one shard's engine process group uses: CPU cores (None on the agent's first
    sample: a rate needs two) and resident memory."""

    shard_id: str
    cores: float | None
    memory_bytes: int


@attrs.frozen
class ForeignGpuProcess:
    """A process that is none of llmgw's engines holding memory on a card or MIG instance.
    ``gpu`` is the placement index (1000 + 100 x card + n for an instance); ``used_memory_mb``
    None where the driver does not say."""

    pid: int
    name: str
    gpu: int
    used_memory_mb: int | None


@attrs.frozen
class XidCount:
    """XID events of one code on one card (by PCI address, as the kernel prints it) since
    the agent started, and the last one's line."""

    pci_address: str
    xid: int
    count: int
    last_message: str


@attrs.frozen
class NodeTelemetry:
    """A node's latest sample. ``host`` holds :data:`HOST_READINGS` that could be read;
    ``age_s`` is the host sample's age at sending (at receipt on the control plane); each
    card has its own. ``note`` says what could not be read ("" when all was)."""

    age_s: float = 0.0
    host: Mapping[str, float] = attrs.field(factory=dict)
    gpus: tuple[GpuTelemetry, ...] = ()
    shards: tuple[ShardUsage, ...] = ()
    foreign_processes: tuple[ForeignGpuProcess, ...] = ()
    xids: tuple[XidCount, ...] = ()
    note: str = ""

    def fresh(self, age_s: float, max_age_s: float = READING_MAX_AGE_S) -> "NodeTelemetry":
        """Returns this sample as it stands ``age_s`` seconds after its ages were taken, without
        what is then older than ``max_age_s``: the host readings, shard usage and foreign
        processes (one sample) go together, each card by its own age; XID counts stay."""
        host_fresh = self.age_s + age_s <= max_age_s
        return attrs.evolve(
            self,
            age_s=self.age_s + age_s,
            host=self.host if host_fresh else {},
            shards=self.shards if host_fresh else (),
            foreign_processes=self.foreign_processes if host_fresh else (),
            gpus=tuple(attrs.evolve(g, age_s=g.age_s + age_s) for g in self.gpus if g.age_s + age_s <= max_age_s),
        )
