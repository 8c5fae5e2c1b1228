"""The fleet on the control plane's ``/metrics``: every node's host, engines and cards (issue 16).

Agents send their telemetry with their heartbeats (llmgw/telemetry.py); the leader's
registry keeps each node's last sample, and :class:`FleetMetrics` writes them out when
``/metrics`` is scraped, so operators add no scrape target per node and an ingest costs
nothing but storing the sample. A thousand 8-GPU nodes are about 150,000 series: they are
written as text straight from an immutable registry snapshot in a worker thread
(:func:`render_fleet`), never through ``prometheus_client``'s objects on the trio thread,
where a scrape would stall heartbeats and requests for a second. Series (gauges unless said):

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
- ``llmgw_gpu_xid_errors`` (counter since the agent started) by ``node``, ``pci``, ``xid``;
- for each training job running now (issue 17): ``llmgw_training_job_step``,
  ``llmgw_training_job_steps``, ``llmgw_training_job_loss``, ``llmgw_training_job_peak_memory_bytes``;
  labels ``job``, ``adapter``, ``model``, ``node``.

A sensor the node could not read has no series; readings older than
``READING_MAX_AGE_S`` are left out, so a node that stops sending loses its series within a
minute. Only the leader holds the registry: a standby's ``/metrics`` has no fleet series.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import trio

from llmgw.control.registry import Fleet, NodeState, NodeView
from llmgw.spec import gpu_display
from llmgw.telemetry import GPU_READINGS
from llmgw.training import TrainingJob

_MIB = 1024 * 1024

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


class FleetMetrics:
    """The fleet's part of a scrape: :meth:`render` takes ``fleet()`` (the leader's registry
    snapshot, or None while this control plane does not lead) at ``clock()`` (the registry's
    time) on the trio thread and writes it in a worker thread."""

    def __init__(self, fleet: Callable[[], Fleet | None], clock: Callable[[], float],
                 jobs: Callable[[], Sequence[TrainingJob]] = tuple) -> None:
        self._fleet = fleet
        self._clock = clock
        self._jobs = jobs

    async def render(self) -> bytes:
        """Returns the fleet's series in the Prometheus text format (b"" while not leading).
        ``jobs()`` gives the training jobs running now. Cancellation abandons the worker
        thread's result."""
        fleet = self._fleet()
        if fleet is None:
            return b""
        jobs = tuple(self._jobs())
        return await trio.to_thread.run_sync(render_fleet, fleet, self._clock(), jobs, abandon_on_cancel=True)


def render_fleet(fleet: Fleet, now: float, jobs: Sequence[TrainingJob] = ()) -> bytes:
    """Returns every ONLINE or DISCONNECTED node's series of ``fleet`` as they stand at ``now``
    (the registry's clock), and those of the training ``jobs``, in the Prometheus text format.
    Pure: safe in any thread."""
    out = _Families()
    for node in sorted(fleet.nodes.values(), key=lambda n: n.id):
        if node.state is not NodeState.LOST:
            _add_node(out, node, now)
    for job in jobs:
        labels = _labels((("job", job.id), ("adapter", job.adapter), ("model", job.model),
                          ("node", job.assigned_node)))
        out.job_step.append(f"llmgw_training_job_step{labels} {job.step}\n")
        out.job_steps.append(f"llmgw_training_job_steps{labels} {job.steps}\n")
        if not math.isnan(job.loss):
            out.job_loss.append(f"llmgw_training_job_loss{labels} {_number(job.loss)}\n")
        out.job_memory.append(f"llmgw_training_job_peak_memory_bytes{labels} {job.peak_memory_bytes}\n")
    return out.text().encode()


class _Families:
    """One scrape's families: (name, type, help) and their sample lines, in a fixed order."""

    def __init__(self) -> None:
        self.order: list[tuple[str, str, str]] = []
        self.lines: dict[str, list[str]] = {}
        self.cpus = self._family("llmgw_node_cpus", "Logical CPUs of the node.")
        self.gpus = self._family("llmgw_node_gpus", "GPUs placement may use on the node (whole cards and MIG "
                                 "instances), by class.")
        self.host = {name: self._family(f"llmgw_node_{name}", text) for name, text in _HOST_FAMILIES}
        self.load = self._family("llmgw_node_load", "Load average over the period.")
        self.age = self._family("llmgw_node_telemetry_age_seconds", "Age of the node's last host sample.")
        self.shard_cores = self._family("llmgw_shard_cpu_cores", "CPU cores the shard's engine processes use.")
        self.shard_memory = self._family("llmgw_shard_memory_bytes", "Resident memory of the shard's engine "
                                         "processes.")
        self.gpu = {name: self._family(f"llmgw_gpu_{name}", f"The card's {name.replace('_', ' ')}.")
                    for name in GPU_READINGS}
        self.throttled = self._family("llmgw_gpu_throttled", "1 for each clock-event (throttle) reason active on "
                                      "the card.")
        self.foreign = self._family("llmgw_gpu_foreign_processes", "Processes that are not llmgw's engines holding "
                                    "memory on the GPU.")
        self.foreign_memory = self._family("llmgw_gpu_foreign_memory_bytes", "GPU memory those processes hold "
                                           "(where the driver says).")
        self.xids = self._family("llmgw_gpu_xid_errors", "XID lines in the kernel log since the agent started, by "
                                 "card PCI address and code.", "counter")
        self.job_step = self._family("llmgw_training_job_step", "The optimiser step a running training job reached.")
        self.job_steps = self._family("llmgw_training_job_steps", "The steps a running training job takes in all.")
        self.job_loss = self._family("llmgw_training_job_loss", "A running training job's last reported loss.")
        self.job_memory = self._family("llmgw_training_job_peak_memory_bytes", "Peak memory of a running training "
                                       "job's trainer (card memory on a GPU, resident memory on the CPU).")

    def _family(self, name: str, text: str, kind: str = "gauge") -> list[str]:
        self.order.append((name, kind, text))
        return self.lines.setdefault(name, [])

    def text(self) -> str:
        parts = []
        for name, kind, text in self.order:
            parts.append(f"# HELP {name} {text}\n# TYPE {name} {kind}\n")
            parts.extend(self.lines[name])
        return "".join(parts)


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    """Returns ``{k="v",...}`` with each value escaped as the text format asks."""
    escaped = (f'{key}="{_escape(value)}"' for key, value in pairs)
    return "{" + ",".join(escaped) + "}"


def _escape(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def _number(value: float) -> str:
    """Returns ``value`` as the text format writes it (integers without a fraction)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value == int(value) and abs(value) < 1e15 else repr(float(value))


def _add_node(out: _Families, node: NodeView, now: float) -> None:
    """Adds one node's series as they stand at ``now``."""
    nid = node.id
    node_labels = _labels((("node", nid),))
    out.cpus.append(f"llmgw_node_cpus{node_labels} {node.hardware.cpu_count}\n")
    classes: dict[str, int] = {}
    for gpu in node.hardware.gpus:
        classes[gpu.gpu_class] = classes.get(gpu.gpu_class, 0) + 1
    for gpu_class, count in sorted(classes.items()):
        out.gpus.append(f"llmgw_node_gpus{_labels((('node', nid), ('class', gpu_class)))} {count}\n")
    telemetry = node.live_telemetry(now)
    if telemetry is None:
        return
    host = telemetry.host
    if host:
        out.age.append(f"llmgw_node_telemetry_age_seconds{node_labels} {_number(telemetry.age_s)}\n")
    for name, lines in out.host.items():
        if name in host:
            lines.append(f"llmgw_node_{name}{node_labels} {_number(host[name])}\n")
    for name, period in _LOADS:
        if name in host:
            out.load.append(f"llmgw_node_load{_labels((('node', nid), ('period', period)))} {_number(host[name])}\n")
    for usage in telemetry.shards:
        shard = node.shards.get(usage.shard_id)
        labels = _labels((("node", nid), ("shard", usage.shard_id), ("model", shard.spec.model if shard else "")))
        if usage.cores is not None:
            out.shard_cores.append(f"llmgw_shard_cpu_cores{labels} {_number(usage.cores)}\n")
        out.shard_memory.append(f"llmgw_shard_memory_bytes{labels} {usage.memory_bytes}\n")
    for card in telemetry.gpus:
        pairs = (("node", nid), ("gpu", gpu_display(card.index)), ("uuid", card.uuid), ("class", card.gpu_class))
        labels = _labels(pairs)
        for name, value in card.readings.items():
            lines = out.gpu.get(name)
            if lines is not None:
                lines.append(f"llmgw_gpu_{name}{labels} {_number(value)}\n")
        for reason in card.throttle_reasons or ():
            out.throttled.append(f"llmgw_gpu_throttled{_labels((*pairs, ('reason', reason)))} 1\n")
    foreign: dict[int, tuple[int, int]] = {}
    for process in telemetry.foreign_processes:
        count, memory = foreign.get(process.gpu, (0, 0))
        foreign[process.gpu] = (count + 1, memory + (process.used_memory_mb or 0) * _MIB)
    for gpu, (count, memory) in sorted(foreign.items()):
        labels = _labels((("node", nid), ("gpu", gpu_display(gpu))))
        out.foreign.append(f"llmgw_gpu_foreign_processes{labels} {count}\n")
        out.foreign_memory.append(f"llmgw_gpu_foreign_memory_bytes{labels} {memory}\n")
    for xid in telemetry.xids:
        labels = _labels((("node", nid), ("pci", xid.pci_address), ("xid", str(xid.xid))))
        out.xids.append(f"llmgw_gpu_xid_errors_total{labels} {xid.count}\n")
