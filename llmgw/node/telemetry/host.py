"""The host sample the agent sends with its heartbeat, and the sampler that makes it.

:class:`HostSampler` keeps the previous counters (CPU times, RAPL energy, each engine
group's CPU time) so that rates (CPU %, cores, watts) come out of two samples; the first
sample has them ``None``. It is synchronous and takes milliseconds (a walk of /proc and
a few dozen sysfs files); the agent calls it in a thread. It never raises: a reader that
fails leaves its fields ``None``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple, TypeVar

import attrs

from llmgw.node.telemetry import hwmon, procfs, rapl
from llmgw.telemetry import READING_MAX_AGE_S, SAMPLE_INTERVAL_S

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Sample at most this often (the node's one telemetry interval): a call sooner than this
# after the last real sample returns that sample again. Rates over shorter windows are also
# noisier (CPU time counts in 10 ms ticks), and each real sample walks all of /proc.
MIN_SAMPLE_INTERVAL_S = SAMPLE_INTERVAL_S

# Readings older than this are left out: a rate is only computed against counters taken
# at most this long ago (a longer window would report an old average as current), and
# :meth:`HostSampler.latest` gives no sample older than this.
MAX_READING_AGE_S = READING_MAX_AGE_S


class ShardUsage(NamedTuple):
    """What one engine's process group uses: cores (None on the first sample) and resident bytes."""

    cores: float | None
    rss_bytes: int


@attrs.frozen
class HostTelemetry:
    """One sample of the host. Every field is ``None`` where it could not be read, never 0.

    Rates (``cpu_utilization_percent``, ``cpu_package_watts``, a shard's ``cores``) cover
    the time since the previous sample and are ``None`` on the first one. ``per_shard``
    holds the shards whose process group had live processes; ``taken_at`` is the ``now``
    given to :meth:`HostSampler.sample`.
    """

    taken_at: float
    cpu_utilization_percent: float | None
    load1: float | None
    load5: float | None
    load15: float | None
    memory_used_bytes: int | None
    memory_available_bytes: int | None
    cpu_package_celsius: float | None
    board_inlet_celsius: float | None
    cpu_package_watts: float | None
    per_shard: Mapping[str, ShardUsage] = attrs.field(factory=dict)


class HostSampler:
    """Samples the host, keeping what the next sample needs for its rates.

    ``root`` is where /proc and /sys are (tests give a recorded tree); ``clock_ticks`` and
    ``page_size`` default to this host's. Not thread-safe: one caller at a time.
    """

    def __init__(
        self,
        root: Path = procfs.ROOT,
        *,
        clock_ticks: int | None = None,
        page_size: int | None = None,
    ) -> None:
        live_ticks, live_page = procfs.live_units()
        self._root = root
        self._clock_ticks = clock_ticks or live_ticks
        self._page_size = page_size or live_page
        self._last: HostTelemetry | None = None
        self._counters_at: float | None = None
        self._cpu: procfs.CpuTimes | None = None
        self._energy: dict[str, rapl.EnergyCounter] = {}
        self._groups: dict[str, tuple[int, procfs.GroupSample]] = {}

    def latest(self, now: float) -> HostTelemetry | None:
        """Returns the last sample if it was taken at most MAX_READING_AGE_S before ``now``, else None."""
        last = self._last
        if last is None or not 0 <= now - last.taken_at <= MAX_READING_AGE_S:
            return None
        return last

    def sample(self, now: float, engine_groups: Mapping[str, int]) -> HostTelemetry:
        """Returns the host's telemetry at ``now`` (seconds on a monotonic clock).

        ``engine_groups`` maps each shard id to its engine's process group id. Called
        less than MIN_SAMPLE_INTERVAL_S after the last real sample, returns that sample
        unchanged (a shard added since shows up at the next real one). Never raises.
        """
        last = self._last
        if last is not None and 0 <= now - last.taken_at < MIN_SAMPLE_INTERVAL_S:
            return last

        elapsed: float | None = None
        if self._counters_at is not None and 0 < now - self._counters_at <= MAX_READING_AGE_S:
            elapsed = now - self._counters_at

        cpu = _attempt("CPU times", procfs.read_cpu_times, self._root)
        cpu_percent = None
        if elapsed is not None and cpu is not None and self._cpu is not None:
            cpu_percent = procfs.cpu_utilization_percent(self._cpu, cpu)

        load = _attempt("load averages", procfs.read_loadavg, self._root)
        memory = _attempt("memory", procfs.read_memory, self._root)
        temperatures = hwmon.read_temperatures(self._root)

        energy = rapl.read_rapl(self._root)
        watts = None
        if elapsed is not None:
            watts = rapl.package_watts(self._energy, energy, elapsed)

        groups, per_shard = self._sample_groups(engine_groups, elapsed)

        self._cpu = cpu
        self._energy = energy
        self._groups = groups
        self._counters_at = now
        self._last = HostTelemetry(
            taken_at=now,
            cpu_utilization_percent=cpu_percent,
            load1=load[0] if load else None,
            load5=load[1] if load else None,
            load15=load[2] if load else None,
            memory_used_bytes=memory.used if memory else None,
            memory_available_bytes=memory.available if memory else None,
            cpu_package_celsius=temperatures.cpu_package_c,
            board_inlet_celsius=temperatures.board_inlet_c,
            cpu_package_watts=watts,
            per_shard=per_shard,
        )
        return self._last

    def _sample_groups(
        self, engine_groups: Mapping[str, int], elapsed: float | None
    ) -> tuple[dict[str, tuple[int, procfs.GroupSample]], dict[str, ShardUsage]]:
        """Returns (the groups' new counters by shard, each live shard's usage)."""
        if not engine_groups:
            return {}, {}
        samples = _attempt(
            "engine process groups",
            lambda root: procfs.read_process_groups(
                root, engine_groups.values(), clock_ticks=self._clock_ticks, page_size=self._page_size
            ),
            self._root,
        )
        if samples is None:
            return {}, {}
        groups: dict[str, tuple[int, procfs.GroupSample]] = {}
        per_shard: dict[str, ShardUsage] = {}
        for shard_id, pgid in engine_groups.items():
            current = samples[pgid]
            if not current.pids:
                continue  # the engine is not running: no entry rather than zeros
            groups[shard_id] = (pgid, current)
            cores = None
            previous = self._groups.get(shard_id)
            if elapsed is not None and previous is not None and previous[0] == pgid:
                cores = procfs.group_cores(previous[1], current, elapsed)
            per_shard[shard_id] = ShardUsage(cores=cores, rss_bytes=current.rss_bytes)
        return groups, per_shard


def _attempt(what: str, read: Callable[[Path], T], root: Path) -> T | None:
    """Returns ``read(root)``, or None (logged at debug level) if it raises OSError or ValueError."""
    try:
        return read(root)
    except (OSError, ValueError) as exc:
        logger.debug("host telemetry: cannot read %s: %s", what, exc)
        return None
