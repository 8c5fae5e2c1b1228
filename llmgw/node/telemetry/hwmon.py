"""Temperatures from hwmon (/sys/class/hwmon): the CPU package and the board's inlet air.

Each ``hwmonN`` directory is one chip: ``name`` says which driver, ``tempK_input`` is a
reading in millidegrees Celsius, ``tempK_label`` (optional) says what it measures. Some
old drivers keep these files in ``hwmonN/device/`` instead; both places are read.

Which reading is "the CPU package":

- ``coretemp`` (Intel): the "Package id N" sensors ("Physical id N" on kernels before
  3.x), the hottest socket. A coretemp chip without one (Core 2 era) gives its hottest
  "Core N".
- ``k10temp`` and ``zenpower`` (AMD): "Tdie" where present, else "Tctl" (on some Ryzen
  parts Tctl carries a fan-control offset over the die's real temperature, so Tdie is
  preferred); a chip without labels (older k10temp) gives temp1, which is Tctl. The
  hottest chip (one per socket or die).
- Fallback, when none of those drivers is loaded: chips whose name contains "cpu"
  (``cpu_thermal`` and the like on ARM SoCs), their hottest reading. ACPI thermal zones
  (``acpitz``) are not used: what they cover is up to the firmware, and on servers it is
  often not the CPU.

The board inlet is any reading whose label names "inlet" or "ambient" (dell-smm-hwmon's
"Ambient", BMC-fed drivers' "Inlet Temp"); when several do, the hottest. Most servers
report inlet air only through their BMC (IPMI), which hwmon does not show: there it is
``None``. ``acpitz`` and motherboard sensors such as nct6775's "SYSTIN" measure the board,
not the air coming in, and are not used.

Nothing here raises for a broken sensor: an unreadable or malformed file is skipped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path

import attrs

logger = logging.getLogger(__name__)

ROOT = Path("/")

_MILLI = 1000.0

_INPUT_RE = re.compile(r"^temp(\d+)_input$")

_CORETEMP = "coretemp"
_AMD_CHIPS = ("k10temp", "zenpower")
_CORETEMP_PACKAGE_RE = re.compile(r"^(Package|Physical) id \d+$")
_CORETEMP_CORE_RE = re.compile(r"^Core \d+$")
_INLET_WORDS = ("inlet", "ambient")
_FALLBACK_CPU_WORD = "cpu"
_ACPI_ZONE = "acpitz"


@attrs.frozen
class TempReading:
    """One temperature sensor: its chip's name, its label ("" if none) and degrees Celsius."""

    chip: str
    label: str
    celsius: float
    hwmon: str  # the hwmonN directory it came from


@attrs.frozen
class HostTemperatures:
    """The host's temperatures in degrees Celsius; ``None`` where no sensor reports it.

    ``readings`` holds every temperature found, for logs and for telling why a value was
    chosen.
    """

    cpu_package_c: float | None
    board_inlet_c: float | None
    readings: tuple[TempReading, ...] = ()


def read_temperatures(root: Path = ROOT) -> HostTemperatures:
    """Returns the CPU package and board inlet temperatures under ``root``/sys/class/hwmon.

    See the module's docstring for which sensors count. Never raises: no hwmon directory
    gives both ``None``, and an unreadable file is skipped.
    """
    readings = read_all(root)
    return HostTemperatures(
        cpu_package_c=cpu_package_celsius(readings),
        board_inlet_c=board_inlet_celsius(readings),
        readings=readings,
    )


def read_all(root: Path = ROOT) -> tuple[TempReading, ...]:
    """Returns every readable temperature under ``root``/sys/class/hwmon, chip by chip.

    Never raises; what cannot be read is left out.
    """
    base = root / "sys" / "class" / "hwmon"
    try:
        chips = sorted(base.iterdir(), key=_hwmon_order)
    except OSError:
        return ()
    readings: list[TempReading] = []
    for chip_dir in chips:
        if not chip_dir.name.startswith("hwmon"):
            continue
        for attr_dir in (chip_dir, chip_dir / "device"):
            found = _read_chip(chip_dir.name, attr_dir)
            if found is not None:
                readings.extend(found)
                break
    return tuple(readings)


def cpu_package_celsius(readings: tuple[TempReading, ...]) -> float | None:
    """Returns the CPU package temperature chosen from ``readings``, or None (see the module)."""
    by_chip: dict[tuple[str, str], list[TempReading]] = {}
    for reading in readings:
        by_chip.setdefault((reading.hwmon, reading.chip), []).append(reading)

    values: list[float] = []
    for (_hwmon, chip), chip_readings in by_chip.items():
        value: float | None = None
        if chip == _CORETEMP:
            value = _hottest(r for r in chip_readings if _CORETEMP_PACKAGE_RE.match(r.label))
            if value is None:
                value = _hottest(r for r in chip_readings if _CORETEMP_CORE_RE.match(r.label))
        elif chip in _AMD_CHIPS:
            value = _amd_package(chip_readings)
        if value is not None:
            values.append(value)
    if values:
        return max(values)
    return _hottest(r for r in readings if _FALLBACK_CPU_WORD in r.chip.lower() and r.chip != _ACPI_ZONE)


def board_inlet_celsius(readings: tuple[TempReading, ...]) -> float | None:
    """Returns the board inlet temperature chosen from ``readings``, or None (see the module)."""
    return _hottest(
        r for r in readings if r.chip != _ACPI_ZONE and any(w in r.label.lower() for w in _INLET_WORDS)
    )


def _amd_package(chip_readings: list[TempReading]) -> float | None:
    """Returns Tdie, else Tctl, else an unlabelled temp1 of one k10temp/zenpower chip."""
    by_label = {r.label: r.celsius for r in chip_readings}
    for label in ("Tdie", "Tctl"):
        if label in by_label:
            return by_label[label]
    unlabelled = [r for r in chip_readings if not r.label]
    return unlabelled[0].celsius if unlabelled else None


def _hottest(readings: Iterable[TempReading]) -> float | None:
    """Returns the highest celsius among ``readings`` (an iterable), None if there are none."""
    values = [r.celsius for r in readings]
    return max(values) if values else None


def _read_chip(hwmon: str, attr_dir: Path) -> list[TempReading] | None:
    """Returns the temperatures in one chip's attribute directory; None if it has no name
    and no temperature files there (so the caller tries ``device/``)."""
    name = _read_text(attr_dir / "name")
    try:
        entries = sorted(attr_dir.iterdir())
    except OSError:
        return None
    inputs = [(m, e) for e in entries if (m := _INPUT_RE.match(e.name))]
    if name is None and not inputs:
        return None
    out: list[TempReading] = []
    for match, path in sorted(inputs, key=lambda pair: int(pair[0].group(1))):
        raw = _read_text(path)
        if raw is None:
            continue
        try:
            celsius = int(raw) / _MILLI
        except ValueError:
            logger.debug("hwmon: %s holds %r, not a number; skipped", path, raw)
            continue
        label = _read_text(attr_dir / f"temp{match.group(1)}_label") or ""
        out.append(TempReading(chip=name or "", label=label, celsius=celsius, hwmon=hwmon))
    return out


def _read_text(path: Path) -> str | None:
    """Returns the stripped contents of a sysfs file, or None if it cannot be read.

    Sensors fail reads with EIO, ENODATA or EAGAIN while not ready; that is not an error
    here, only a reading that is absent.
    """
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _hwmon_order(path: Path) -> tuple[int, str]:
    """Sorts hwmon2 before hwmon10."""
    digits = path.name[len("hwmon") :]
    return (int(digits) if digits.isdigit() else -1, path.name)
