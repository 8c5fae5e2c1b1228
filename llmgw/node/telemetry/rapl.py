"""CPU package power from RAPL energy counters (/sys/class/powercap/intel-rapl:N).

Each CPU package is a powercap zone ``intel-rapl:N`` (N in hex, as the kernel names
them: the eleventh package is ``intel-rapl:a``) whose ``name`` is "package-K" and whose
``energy_uj`` counts microjoules since some moment, wrapping to 0 after
``max_energy_range_uj``. The same driver serves AMD Zen CPUs.

What is left out, and why:

- Sub-zones (``intel-rapl:N:M``: "core", "uncore", "dram") are parts of their package or
  beside it; they are not read, so nothing is counted twice and DRAM is not CPU power.
- Top-level zones not named "package-K" ("psys", the whole platform on laptops) are not
  CPU packages.
- ``intel-rapl-mmio:N`` zones measure the same packages again through another
  interface; only ``intel-rapl:N`` is read.

Since Linux 5.10 (the Platypus side channel) ``energy_uj`` is readable by root only; an
agent running as another user gets no reading, and power is ``None``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

import attrs

logger = logging.getLogger(__name__)

ROOT = Path("/")

_MICRO = 1_000_000.0

# A top-level zone: "intel-rapl:" and the kernel's hex id, no second ":" (a sub-zone).
_ZONE_RE = re.compile(r"^intel-rapl:[0-9a-f]+$")
_PACKAGE_PREFIX = "package-"


@attrs.frozen
class EnergyCounter:
    """One zone's energy counter: microjoules now, and where it wraps back to 0."""

    energy_uj: int
    max_energy_range_uj: int


def read_rapl(root: Path = ROOT) -> dict[str, EnergyCounter]:
    """Returns the energy counter of every CPU package, by zone name ("package-0", ...).

    All or nothing: an empty dict when there is no RAPL, and also when any package's
    counter cannot be read (permissions, a zone going away), so that a sum over the
    result is never a silent undercount. Never raises.
    """
    base = root / "sys" / "class" / "powercap"
    try:
        zones = sorted(entry for entry in base.iterdir() if _ZONE_RE.match(entry.name))
    except OSError:
        return {}
    counters: dict[str, EnergyCounter] = {}
    for zone in zones:
        name = _read_text(zone / "name")
        if name is None or not name.startswith(_PACKAGE_PREFIX):
            continue
        energy = _read_int(zone / "energy_uj")
        if energy is None:
            logger.debug("rapl: %s/energy_uj cannot be read; no package power", zone)
            return {}
        max_range = _read_int(zone / "max_energy_range_uj")
        counters[name] = EnergyCounter(energy_uj=energy, max_energy_range_uj=max_range or 0)
    return counters


def package_watts(
    before: Mapping[str, EnergyCounter], after: Mapping[str, EnergyCounter], seconds: float
) -> float | None:
    """Returns the power of all CPU packages together, in watts, between two readings.

    A counter lower than before has wrapped once at ``max_energy_range_uj`` (a range of
    hundreds of kilojoules: minutes at full power, far longer than a sample interval).
    Returns None when there is no reading (either side empty), when the two readings do
    not cover the same packages, when ``seconds`` is not positive, or when a counter went
    back without a known range to wrap at. Never raises.
    """
    if not before or not after or set(before) != set(after) or seconds <= 0:
        return None
    joules_uj = 0
    for name, end in after.items():
        start = before[name]
        delta = end.energy_uj - start.energy_uj
        if delta < 0:
            if end.max_energy_range_uj <= 0:
                return None
            delta += end.max_energy_range_uj
            if delta < 0:
                return None
        joules_uj += delta
    return joules_uj / _MICRO / seconds


def _read_text(path: Path) -> str | None:
    """Returns the stripped contents of a sysfs file, or None if it cannot be read."""
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path) -> int | None:
    """Returns the integer in a sysfs file, or None if it cannot be read or parsed."""
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None
