"""The fleet on the control plane's ``/metrics``: every node's host, engines and cards (issue 16).

Agents send their telemetry with their heartbeats (llmgw/telemetry.py); the leader's
registry keeps each node's last sample, and :class:`FleetCollector` turns it into
Prometheus series when ``/metrics`` is scraped, so operators add no scrape target per node
and an ingest costs nothing but storing the sample. Series (gauges unless said):

- ``llmgw_node_cpus``, ``llmgw_node_gpus{class}`` (what placement counts), and the host's
  readings: ``llmgw_node_cpu_utilization_percent``, ``llmgw_node_load{period}``,
  ``llmgw_node_memory_used_bytes``, ``llmgw_node_memory_available_bytes``,
  ``llmgw_node_cpu_package_celsius``, ``llmgw_node_board_inlet_celsius``,
  ``llmgw_node_cpu_package_watts``, ``llmgw_node_telemetry_age_seconds``; label ``node``;
- ``llmgw_shard_cpu_cores`` and ``llmgw_shard_memory_bytes``; labels ``node``, ``shard``, ``model``;
- ``llmgw_gpu_<reading>`` for every card reading (llmgw/telemetry.py ``GPU_READINGS``),
  ``llmgw_gpu_throttled{reason}`` (1 per active reason), ``llmgw_gpu_foreign_processes``
  and ``llmgw_gpu_foreign_memory_bytes`` (processes not llmgw's, per placement unit);
  labels ``node``, ``gpu`` (as every view names it: "0", "0/mig2"), ``uuid``, ``class``;
- ``llmgw_gpu_xid_errors`` (counter since the agent started) by ``node``, ``pci``, ``xid``.

A sensor the node could not read has no series; readings older than
``READING_MAX_AGE_S`` are left out, so a node that stops sending loses its series within a
minute. Only the leader holds the registry: a standby's ``/metrics`` has no fleet series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw.control.registry import Fleet, NodeState
from llmgw.spec import gpu_display
from llmgw.telemetry import GPU_READINGS

#: The host readings exported one to one, with their help text (the loads are one family).
_HOST_FAMILIES = (
    ("cpu_utilization_percent", "CPU time in use across all cores, percent, over the last sample."),
    ("memory_used_bytes", "Memory in use (total less available)."),
    ("memory_available_bytes", "Memory available for new work without swapping (MemAvailable)."),
    ("cpu_package_celsius", "The hottest CPU package temperature (hwmon)."),
    ("board_inlet_celsius", "The board's inlet (ambient) temperature (hwmon)."),
    ("cpu_package_watts", "CPU package power from the RAPL energy counters, over the last sample."),
)
_LOADS = (("load1", "1m"), ("load5", "5m"), ("load15", "15m"))
_GPU_LABELS = ["node", "gpu", "uuid", "class"]


class FleetCollector(Collector):
    """Yields the fleet's series from ``fleet()`` (the leader's registry snapshot, or None
    while this control plane does not lead) at the time ``clock()`` gives (the registry's)."""

    def __init__(self, fleet: Callable[[], Fleet | None], clock: Callable[[], float]) -> None:
        self._fleet = fleet
        self._clock = clock

    def describe(self) -> list[Any]:
        return list(_Families().all())

    def collect(self) -> Iterator[Any]:
        families = _Families()
        fleet = self._fleet()
        if fleet is not None:
            now = self._clock()
            for node in sorted(fleet.nodes.values(), key=lambda n: n.id):
                if node.state is NodeState.LOST:
                    continue
                _add_node(families, node, now)
        yield from families.all()


class _Families:
    """One scrape's metric families."""

    def __init__(self) -> None:
        self.cpus = GaugeMetricFamily("llmgw_node_cpus", "Logical CPUs of the node.", labels=["node"])
        self.gpus = GaugeMetricFamily("llmgw_node_gpus", "GPUs placement may use on the node (whole cards and MIG "
                                      "instances), by class.", labels=["node", "class"])
        self.host = {name: GaugeMetricFamily(f"llmgw_node_{name}", text, labels=["node"])
                     for name, text in _HOST_FAMILIES}
        self.load = GaugeMetricFamily("llmgw_node_load", "Load average over the period.", labels=["node", "period"])
        self.age = GaugeMetricFamily("llmgw_node_telemetry_age_seconds", "Age of the node's last host sample.",
                                     labels=["node"])
        self.shard_cores = GaugeMetricFamily("llmgw_shard_cpu_cores", "CPU cores the shard's engine processes use.",
                                             labels=["node", "shard", "model"])
        self.shard_memory = GaugeMetricFamily("llmgw_shard_memory_bytes", "Resident memory of the shard's engine "
                                              "processes.", labels=["node", "shard", "model"])
        self.gpu = {name: GaugeMetricFamily(f"llmgw_gpu_{name}", f"The card's {name.replace('_', ' ')}.",
                                            labels=_GPU_LABELS) for name in GPU_READINGS}
        self.throttled = GaugeMetricFamily("llmgw_gpu_throttled", "1 for each clock-event (throttle) reason active "
                                           "on the card.", labels=[*_GPU_LABELS, "reason"])
        self.foreign = GaugeMetricFamily("llmgw_gpu_foreign_processes", "Processes that are not llmgw's engines "
                                         "holding memory on the GPU.", labels=["node", "gpu"])
        self.foreign_memory = GaugeMetricFamily("llmgw_gpu_foreign_memory_bytes", "GPU memory those processes hold "
                                                "(where the driver says).", labels=["node", "gpu"])
        self.xids = CounterMetricFamily("llmgw_gpu_xid_errors", "XID lines in the kernel log since the agent "
                                        "started, by card PCI address and code.", labels=["node", "pci", "xid"])

    def all(self) -> Iterator[Any]:
        yield self.cpus
        yield self.gpus
        yield from self.host.values()
        yield self.load
        yield self.age
        yield self.shard_cores
        yield self.shard_memory
        yield from self.gpu.values()
        yield self.throttled
        yield self.foreign
        yield self.foreign_memory
        yield self.xids


def _add_node(families: _Families, node: Any, now: float) -> None:
    """Adds one node's series (a NodeView) as they stand at ``now``."""
    nid = node.id
    families.cpus.add_metric([nid], node.hardware.cpu_count)
    classes: dict[str, int] = {}
    for gpu in node.hardware.gpus:
        classes[gpu.gpu_class] = classes.get(gpu.gpu_class, 0) + 1
    for gpu_class, count in sorted(classes.items()):
        families.gpus.add_metric([nid, gpu_class], count)
    telemetry = node.live_telemetry(now)
    if telemetry is None:
        return
    if telemetry.host:
        families.age.add_metric([nid], telemetry.age_s)
    for name, family in families.host.items():
        value = telemetry.host.get(name)
        if value is not None:
            family.add_metric([nid], value)
    for name, period in _LOADS:
        value = telemetry.host.get(name)
        if value is not None:
            families.load.add_metric([nid, period], value)
    for usage in telemetry.shards:
        shard = node.shards.get(usage.shard_id)
        labels = [nid, usage.shard_id, shard.spec.model if shard is not None else ""]
        if usage.cores is not None:
            families.shard_cores.add_metric(labels, usage.cores)
        families.shard_memory.add_metric(labels, usage.memory_bytes)
    for card in telemetry.gpus:
        labels = [nid, gpu_display(card.index), card.uuid, card.gpu_class]
        for name, value in card.readings.items():
            family = families.gpu.get(name)
            if family is not None:
                family.add_metric(labels, value)
        for reason in card.throttle_reasons or ():
            families.throttled.add_metric([*labels, reason], 1)
    foreign: dict[int, tuple[int, int]] = {}
    for process in telemetry.foreign_processes:
        count, memory = foreign.get(process.gpu, (0, 0))
        foreign[process.gpu] = (count + 1, memory + (process.used_memory_mb or 0) * 1024 * 1024)
    for gpu, (count, memory) in sorted(foreign.items()):
        families.foreign.add_metric([nid, gpu_display(gpu)], count)
        families.foreign_memory.add_metric([nid, gpu_display(gpu)], memory)
    for xid in telemetry.xids:
        families.xids.add_metric([nid, xid.pci_address, str(xid.xid)], xid.count)
