"""What an agent sends with every heartbeat: its GPUs and their readings, the host, its engines.

:class:`NodeSampler` asks the cards (NVML, else ``nvidia-smi``, one inventory and one set
of readings from the same answer) at most every :data:`~llmgw.telemetry.SAMPLE_INTERVAL_S`,
the host through :class:`~llmgw.node.telemetry.host.HostSampler` as often, NVLink counters
and the kernel log's XID lines every minute, and keeps the latest of each. A heartbeat in
between gets the same inventory and sample again, with their ages grown. Readings older
than :data:`~llmgw.telemetry.READING_MAX_AGE_S` are never sent.

It is synchronous (the agent calls it in a thread, one call at a time) and never raises:
a reader that fails leaves its part out and says why in the telemetry's ``note``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from llmgw.node.gpus.discover import import_pynvml, read_gpu_inventory
from llmgw.node.gpus.inventory import GpuInventory, gpu_class, placement_index
from llmgw.node.gpus.nvlink import NVLINK_INTERVAL_S, NvLinkErrors, read_nvlink_errors
from llmgw.node.gpus.nvsmi import NVIDIA_SMI, Runner, run_nvidia_smi
from llmgw.node.gpus.telemetry import GpuReading, fresh, parse_smi_readings, read_nvml_readings
from llmgw.node.gpus.xid import XID_INTERVAL_S, XidWatcher
from llmgw.node.telemetry.host import HostSampler, HostTelemetry
from llmgw.telemetry import (
    READING_MAX_AGE_S, SAMPLE_INTERVAL_S, ForeignGpuProcess, GpuTelemetry, NodeTelemetry, ShardUsage, XidCount,
)

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024


class NodeSampler:
    """The agent's sampler of its cards, host and engines (see the module docstring).

    ``import_nvml`` and ``run_smi`` reach NVML and nvidia-smi (tests pass stand-ins);
    ``poll_xids`` reads the kernel log (None: XIDs are not watched); ``clock`` is a
    monotonic clock in seconds. Thread-safe: calls take turns.
    """

    def __init__(
        self,
        *,
        import_nvml: Callable[[], Any] = import_pynvml,
        run_smi: Runner = run_nvidia_smi,
        host: HostSampler | None = None,
        poll_xids: Callable[[], tuple[list[Any], str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._import_nvml = import_nvml
        self._run_smi = run_smi
        self._host = host if host is not None else HostSampler()
        self._poll_xids = poll_xids if poll_xids is not None else XidWatcher().poll
        self._clock = clock
        self._inventory: GpuInventory | None = None
        self._inventory_at = 0.0
        self._readings: list[GpuReading] = []
        self._nvlink: dict[str, NvLinkErrors | None] = {}
        self._nvlink_at: float | None = None
        self._xids: dict[tuple[str, int], XidCount] = {}
        self._xids_at: float | None = None
        self._notes: dict[str, str] = {}
        self._lock = threading.Lock()
        self._host_at: float | None = None
        #: Counts the samples that read something anew (cards, host, kernel log): a heartbeat
        #: sends telemetry only when this moved since the last one it sent.
        self.generation = 0

    def inventory(self) -> GpuInventory:
        """Returns the cards as last asked, asking again if that was SAMPLE_INTERVAL_S ago or more."""
        with self._lock:
            return self._current_inventory()

    def _current_inventory(self) -> GpuInventory:
        now = self._clock()
        if self._inventory is None or not 0 <= now - self._inventory_at < SAMPLE_INTERVAL_S:
            self._read_cards(now)
            self.generation += 1
        assert self._inventory is not None
        return self._inventory

    def sample(self, engine_groups: Mapping[str, int]) -> NodeTelemetry:
        """Returns the latest telemetry, sampling what is due. ``engine_groups`` maps each
        running shard's id to its engine's process group id (its pid: engines lead their group)."""
        with self._lock:
            return self._sample(engine_groups)

    def _sample(self, engine_groups: Mapping[str, int]) -> NodeTelemetry:
        inventory = self._current_inventory()
        now = self._clock()
        host = self._host.sample(now, engine_groups)
        if host.taken_at != self._host_at:
            self._host_at = host.taken_at
            self.generation += 1
        if self._poll_kernel_log(now):
            self.generation += 1
        return NodeTelemetry(
            age_s=max(0.0, now - host.taken_at),
            host=_host_readings(host),
            gpus=self._gpu_telemetry(inventory, now),
            shards=tuple(ShardUsage(shard_id, usage.cores, usage.rss_bytes)
                         for shard_id, usage in sorted(host.per_shard.items())),
            foreign_processes=_foreign(inventory, set(engine_groups.values())),
            xids=tuple(self._xids[key] for key in sorted(self._xids)),
            note="; ".join(note for _what, note in sorted(self._notes.items()) if note),
        )

    # -- cards -------------------------------------------------------------------------

    def _read_cards(self, now: float) -> None:
        """Reads the inventory and the readings from one source (NVML, else nvidia-smi)."""
        answers: dict[tuple[str, ...], str] = {}

        def recording(argv: Any, timeout: float) -> str:
            answers[tuple(argv)] = out = self._run_smi(argv, timeout)
            return out

        inventory = read_gpu_inventory(self._import_nvml, recording)
        readings: list[GpuReading] = []
        note = ""
        if inventory.source == "nvml":
            readings, note = self._nvml_readings(now)
        elif inventory.source == "nvidia-smi":
            try:
                readings = parse_smi_readings(answers[(NVIDIA_SMI, "-q", "-x")], now)
            except (KeyError, ValueError) as exc:
                note = f"GPU readings: nvidia-smi -q -x could not be read ({exc})"
        self._inventory, self._inventory_at = inventory, now
        if readings or not inventory.cards:
            self._readings = readings
        self._notes["gpus"] = note

    def _nvml_readings(self, now: float) -> tuple[list[GpuReading], str]:
        """Returns (readings, note) from NVML, with the NVLink counters when they are due."""
        try:
            nvml = self._import_nvml()
            nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVML went away since the inventory: no readings
            return [], f"GPU readings: NVML did not start ({exc})"
        try:
            readings = read_nvml_readings(nvml, now)
            if self._nvlink_at is None or not 0 <= now - self._nvlink_at < NVLINK_INTERVAL_S:
                self._nvlink_at = now
                try:
                    self._nvlink = read_nvlink_errors(nvml, now)
                except Exception as exc:  # noqa: BLE001 - the counters are extra; readings stay
                    logger.warning("NVLink counters could not be read: %s", exc)
                    self._nvlink = {}
            return readings, ""
        except Exception as exc:  # noqa: BLE001 - a card fell off the bus mid-read
            return [], f"GPU readings: NVML failed ({exc})"
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - nothing to undo
                pass

    def _gpu_telemetry(self, inventory: GpuInventory, now: float) -> tuple[GpuTelemetry, ...]:
        """Returns each card's readings not older than READING_MAX_AGE_S, with its class."""
        cards = {card.uuid: card for card in inventory.cards}
        result = []
        for reading in fresh(self._readings, now):
            age = now - reading.taken_at
            card = cards.get(reading.uuid)
            values = _gpu_readings(reading)
            nvlink = self._nvlink.get(reading.uuid)
            if nvlink is not None and 0 <= now - nvlink.taken_at <= READING_MAX_AGE_S + NVLINK_INTERVAL_S:
                values.update(_nvlink_readings(nvlink))
            result.append(GpuTelemetry(
                index=card.index if card else reading.index, uuid=reading.uuid,
                gpu_class=gpu_class(card.name, card.memory_total_mb) if card else "",
                readings=values, throttle_reasons=reading.throttle_reasons, age_s=age,
            ))
        return tuple(result)

    # -- kernel log --------------------------------------------------------------------

    def _poll_kernel_log(self, now: float) -> bool:
        """Counts the kernel log's new XID lines, once every XID_INTERVAL_S, on nodes with cards;
        returns whether it read the log."""
        if self._inventory is None or not self._inventory.cards:
            return False
        if self._xids_at is not None and 0 <= now - self._xids_at < XID_INTERVAL_S:
            return False
        self._xids_at = now
        try:
            events, note = self._poll_xids()
        except Exception as exc:  # noqa: BLE001 - the kernel log is extra; nothing else depends on it
            events, note = [], f"kernel log: {exc}"
        self._notes["xid"] = note
        for event in events:
            key = (event.pci_address, event.xid)
            before = self._xids.get(key)
            self._xids[key] = XidCount(event.pci_address, event.xid, (before.count if before else 0) + 1, event.line)
        return True


def _host_readings(host: HostTelemetry) -> dict[str, float]:
    """Returns the host sample's readings that were read, by their telemetry names."""
    values = {
        "cpu_utilization_percent": host.cpu_utilization_percent,
        "load1": host.load1, "load5": host.load5, "load15": host.load15,
        "memory_used_bytes": host.memory_used_bytes, "memory_available_bytes": host.memory_available_bytes,
        "cpu_package_celsius": host.cpu_package_celsius, "board_inlet_celsius": host.board_inlet_celsius,
        "cpu_package_watts": host.cpu_package_watts,
    }
    return _present(values)


def _gpu_readings(reading: GpuReading) -> dict[str, float]:
    """Returns one card's readings that were read, in base units, by their telemetry names."""
    values = {
        "utilization_percent": reading.utilization_percent,
        "memory_used_bytes": None if reading.memory_used_mb is None else reading.memory_used_mb * _MIB,
        "memory_utilization_percent": reading.memory_utilization_percent,
        "sm_clock_hertz": None if reading.sm_clock_mhz is None else reading.sm_clock_mhz * 1_000_000,
        "ecc_uncorrected_errors": reading.ecc_uncorrected,
        "temperature_celsius": reading.temperature_c,
        "memory_temperature_celsius": reading.memory_temperature_c,
        "power_draw_watts": reading.power_draw_w,
        "power_limit_watts": reading.power_limit_w,
    }
    return _present(values)


def _nvlink_readings(errors: NvLinkErrors) -> dict[str, float]:
    values = {"nvlink_crc_flit_errors": errors.crc_flit, "nvlink_crc_data_errors": errors.crc_data,
              "nvlink_replay_errors": errors.replay, "nvlink_recovery_errors": errors.recovery}
    return _present(values)


def _present(values: Mapping[str, float | None]) -> dict[str, float]:
    """Returns the readings that were read (a sensor not read is absent, never 0), as floats."""
    return {name: float(value) for name, value in values.items() if value is not None}


def _foreign(inventory: GpuInventory, engine_groups: set[int]) -> tuple[ForeignGpuProcess, ...]:
    """Returns the processes holding GPU memory that belong to none of llmgw's engines (by
    process group: every process an engine starts stays in its group)."""
    foreign = []
    for process in inventory.processes:
        try:
            group = os.getpgid(process.pid)
        except OSError:
            group = None  # another PID namespace (a container), or gone: not one of ours
        if group is not None and group in engine_groups:
            continue
        gpu = process.card if process.mig is None else placement_index(process.card, process.mig)
        foreign.append(ForeignGpuProcess(process.pid, process.name or "", gpu, process.used_memory_mb))
    return tuple(foreign)

