"""Live GPU telemetry: one :class:`GpuReading` per card, from NVML or from ``nvidia-smi -q -x``.

Two readers give the same reading for the same card:

* :func:`read_nvml_readings` asks NVML through the ``pynvml`` module (nvidia-ml-py), which
  the caller passes in (tests pass a stand-in) and has initialised (``nvmlInit``);
* :func:`parse_smi_readings` parses the XML that ``nvidia-smi -q -x`` prints, for hosts
  where the Python bindings are missing.

A sensor the card does not have, or that the driver would not read this time, is None,
never zero: NVML's NotSupported and nvidia-smi's "N/A" both become None. Both readers are
synchronous and quick; callers on the trio loop may use ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import logging
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from typing import Any

import attrs

from llmgw.node.gpus.nvsmi import parse_log
from llmgw.telemetry import READING_MAX_AGE_S  # a reading older than this is shown nowhere

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024
_MILLI = 1000

# NVML's clock-event (formerly "clocks throttle") reason bits, each with the name nvidia-smi
# prints in its XML (clocks_event_reason_<name> / clocks_throttle_reason_<name>). The bits
# are nvmlClocksEventReason* (= nvmlClocksThrottleReason*) in nvidia-ml-py; the order here
# is the order of the bits, and both readers give the names in this order.
THROTTLE_REASON_BITS: tuple[tuple[int, str], ...] = (
    (0x0001, "gpu_idle"),
    (0x0002, "applications_clocks_setting"),
    (0x0004, "sw_power_cap"),
    (0x0008, "hw_slowdown"),
    (0x0010, "sync_boost"),
    (0x0020, "sw_thermal_slowdown"),
    (0x0040, "hw_thermal_slowdown"),
    (0x0080, "hw_power_brake_slowdown"),
    (0x0100, "display_clocks_setting"),
    # Newer drivers only (nvidia-ml-py 12.555+); nvidia-smi's XML has no tag for them yet.
    (0x0200, "board_limit"),
    (0x0400, "reliability"),
)
_THROTTLE_ORDER = {name: position for position, (_bit, name) in enumerate(THROTTLE_REASON_BITS)}


@attrs.frozen
class GpuReading:
    """One card's sensors at one moment. Every sensor may be None: not there, or not read.

    ``index`` is NVML's device index (the order nvidia-smi lists cards in), ``taken_at``
    the caller's clock (``now``) when the reading was taken. ``memory_used_mb`` is in MiB
    and excludes memory the driver reserves, as nvidia-smi shows it.
    ``memory_utilization_percent`` is the share of time the memory was being read or
    written (bandwidth in use), not the share of memory allocated. ``ecc_uncorrected`` is
    the volatile (since the driver loaded) count of uncorrected ECC errors.
    ``throttle_reasons`` names the active clock-event reasons (see THROTTLE_REASON_BITS);
    an empty tuple means none is active, None that they could not be read.
    """

    index: int
    uuid: str
    taken_at: float
    utilization_percent: int | None = None
    memory_used_mb: int | None = None
    memory_utilization_percent: int | None = None
    sm_clock_mhz: int | None = None
    ecc_uncorrected: int | None = None
    temperature_c: int | None = None
    memory_temperature_c: int | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    throttle_reasons: tuple[str, ...] | None = None


def decode_throttle_reasons(mask: int) -> tuple[str, ...]:
    """Returns the names of the reason bits set in NVML's clock-event ``mask``, in bit order.

    A bit this module does not know becomes "unknown_0x...." rather than being dropped.
    """
    names = [name for bit, name in THROTTLE_REASON_BITS if mask & bit]
    known = 0
    for bit, _name in THROTTLE_REASON_BITS:
        known |= bit
    rest = mask & ~known
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"unknown_{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return tuple(names)


def fresh(readings: Iterable[GpuReading], now: float, max_age_s: float = READING_MAX_AGE_S) -> list[GpuReading]:
    """Returns the readings taken no more than ``max_age_s`` before ``now`` (same clock)."""
    return [reading for reading in readings if now - reading.taken_at <= max_age_s]


# --- NVML ---------------------------------------------------------------------------------


def read_nvml_readings(nvml: Any, now: float) -> list[GpuReading]:
    """Returns one reading per card NVML lists, by index, each stamped ``now``.

    ``nvml`` is the ``pynvml`` module (or a stand-in with the same names), already
    initialised by the caller. Each NVML call that raises ``nvml.NVMLError`` (NotSupported,
    GPU lost, ...) leaves its field None. A card whose handle or UUID cannot be read is left
    out (and logged); the other cards are still read. Raises ``nvml.NVMLError`` only when
    the number of cards cannot be read (NVML not initialised, driver gone).
    """
    readings = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        except nvml.NVMLError as exc:
            logger.warning("GPU %d: no telemetry: NVML could not open it (%s)", index, exc)
            continue
        readings.append(_read_card(nvml, handle, index, uuid, now))
    return readings


def _read_card(nvml: Any, handle: Any, index: int, uuid: str, now: float) -> GpuReading:
    """Returns one card's reading; each field NVML will not give is None."""

    def ask(function: str, *args: Any) -> Any:
        try:
            return getattr(nvml, function)(handle, *args)
        except nvml.NVMLError as exc:
            logger.debug("GPU %d: %s: %s", index, function, exc)
            return None

    rates = ask("nvmlDeviceGetUtilizationRates")
    clock = ask("nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_SM)
    ecc = ask("nvmlDeviceGetTotalEccErrors", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
    temperature = ask("nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU)
    power_mw = ask("nvmlDeviceGetPowerUsage")
    limit_mw = ask("nvmlDeviceGetEnforcedPowerLimit")
    return GpuReading(
        index=index,
        uuid=uuid,
        taken_at=now,
        utilization_percent=None if rates is None else int(rates.gpu),
        memory_used_mb=_nvml_memory_used_mb(nvml, handle, index),
        memory_utilization_percent=None if rates is None else int(rates.memory),
        sm_clock_mhz=None if clock is None else int(clock),
        ecc_uncorrected=None if ecc is None else int(ecc),
        temperature_c=None if temperature is None else int(temperature),
        memory_temperature_c=_nvml_memory_temperature(nvml, handle, index),
        power_draw_w=None if power_mw is None else int(power_mw) / _MILLI,
        power_limit_w=None if limit_mw is None else int(limit_mw) / _MILLI,
        throttle_reasons=_nvml_throttle_reasons(nvml, handle, index),
    )


def _nvml_memory_used_mb(nvml: Any, handle: Any, index: int) -> int | None:
    """Returns memory in use in MiB, reserved memory excluded where the driver says it.

    The v2 call (drivers 510+) splits off what the driver reserves, as nvidia-smi's
    fb_memory_usage/used does; older drivers and bindings give v1, whose ``used`` includes
    it. None when neither answers.
    """
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            return int(nvml.nvmlDeviceGetMemoryInfo(handle, version=version).used) // _MIB
        except (nvml.NVMLError, TypeError) as exc:
            logger.debug("GPU %d: nvmlDeviceGetMemoryInfo v2: %s", index, exc)
    try:
        return int(nvml.nvmlDeviceGetMemoryInfo(handle).used) // _MIB
    except nvml.NVMLError as exc:
        logger.debug("GPU %d: nvmlDeviceGetMemoryInfo: %s", index, exc)
        return None


# NVML's union member for each nvmlValueType_t (NVML_VALUE_TYPE_DOUBLE = 0 ... UNSIGNED_SHORT = 6).
_FIELD_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _nvml_memory_temperature(nvml: Any, handle: Any, index: int) -> int | None:
    """Returns the HBM temperature (NVML_FI_DEV_MEMORY_TEMP) in °C, or None.

    Only cards with HBM report it; the field's own return code says NotSupported elsewhere.
    """
    field_id = getattr(nvml, "NVML_FI_DEV_MEMORY_TEMP", None)
    if field_id is None:
        return None
    try:
        values = nvml.nvmlDeviceGetFieldValues(handle, [field_id])
    except nvml.NVMLError as exc:
        logger.debug("GPU %d: nvmlDeviceGetFieldValues(MEMORY_TEMP): %s", index, exc)
        return None
    if not values or int(values[0].nvmlReturn) != getattr(nvml, "NVML_SUCCESS", 0):
        return None
    member = _FIELD_VALUE_MEMBER.get(int(values[0].valueType))
    if member is None:
        return None
    return int(getattr(values[0].value, member))


def _nvml_throttle_reasons(nvml: Any, handle: Any, index: int) -> tuple[str, ...] | None:
    """Returns the active clock-event reasons, or None when NVML gives neither mask.

    Tries nvmlDeviceGetCurrentClocksEventReasons (drivers 535+) first, then the older
    nvmlDeviceGetCurrentClocksThrottleReasons.
    """
    for function in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        call = getattr(nvml, function, None)
        if call is None:
            continue
        try:
            return decode_throttle_reasons(int(call(handle)))
        except nvml.NVMLError as exc:
            logger.debug("GPU %d: %s: %s", index, function, exc)
    return None


def _text(value: str | bytes) -> str:
    """Returns NVML's string as str (older bindings return bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


# --- nvidia-smi -q -x ---------------------------------------------------------------------

# Where each schema keeps the power readings: nvsmi_device_v12+ (drivers 535+) has
# gpu_power_readings, older ones power_readings. Newer drivers print average and instant
# draw instead of power_draw; NVML's power usage is the one-second average on those cards.
_POWER_SECTIONS = ("gpu_power_readings", "power_readings")
_POWER_DRAW_TAGS = ("power_draw", "average_power_draw", "instant_power_draw")
# v12+ calls the enforced limit "current_power_limit" (its "requested_power_limit" is the
# old "power_limit", the one an administrator set).
_POWER_LIMIT_TAGS = ("enforced_power_limit", "current_power_limit")
# Uncorrected volatile ECC counts: older schemas give double_bit/total; v11+ split SRAM and
# DRAM, and drivers 570+ split SRAM uncorrected into parity and SEC-DED.
_ECC_UNCORRECTED_PARTS = (
    "sram_uncorrectable",
    "sram_uncorrectable_parity",
    "sram_uncorrectable_secded",
    "dram_uncorrectable",
)
_THROTTLE_SECTIONS = (
    ("clocks_event_reasons", "clocks_event_reason_"),
    ("clocks_throttle_reasons", "clocks_throttle_reason_"),
)


def parse_smi_readings(xml_text: str | bytes, now: float) -> list[GpuReading]:
    """Returns one reading per <gpu> in ``nvidia-smi -q -x`` output, indexed in print order.

    Values nvidia-smi prints as "N/A" (or leaves out) are None. A card without a <uuid> is
    left out. Raises ValueError when the text is not XML or not nvidia-smi's log.
    """
    root = parse_log(xml_text)
    readings = []
    for index, gpu in enumerate(root.findall("gpu")):
        uuid = _smi_text(gpu, "uuid")
        if uuid is None:
            logger.warning("nvidia-smi listed GPU %d without a UUID; no telemetry for it", index)
            continue
        readings.append(
            GpuReading(
                index=index,
                uuid=uuid,
                taken_at=now,
                utilization_percent=_smi_int(gpu, "utilization/gpu_util"),
                memory_used_mb=_smi_int(gpu, "fb_memory_usage/used"),
                memory_utilization_percent=_smi_int(gpu, "utilization/memory_util"),
                sm_clock_mhz=_smi_int(gpu, "clocks/sm_clock"),
                ecc_uncorrected=_smi_ecc_uncorrected(gpu),
                temperature_c=_smi_int(gpu, "temperature/gpu_temp"),
                memory_temperature_c=_smi_int(gpu, "temperature/memory_temp"),
                power_draw_w=_smi_power(gpu, _POWER_DRAW_TAGS),
                power_limit_w=_smi_power(gpu, _POWER_LIMIT_TAGS),
                throttle_reasons=_smi_throttle_reasons(gpu),
            )
        )
    return readings


def _smi_text(element: ET.Element, path: str) -> str | None:
    """Returns the stripped text at ``path``, or None when absent, empty or "N/A"."""
    found = element.find(path)
    if found is None or found.text is None:
        return None
    text = found.text.strip()
    return None if not text or text == "N/A" else text


def _smi_number(element: ET.Element, path: str) -> float | None:
    """Returns the number at ``path`` without its unit ("67.03 W" -> 67.03), or None.

    Text that is not a number ("Requested functionality has been deprecated") is None.
    """
    text = _smi_text(element, path)
    if text is None:
        return None
    try:
        return float(text.split()[0])
    except ValueError:
        return None


def _smi_int(element: ET.Element, path: str) -> int | None:
    """Returns the whole number at ``path`` ("1275 MHz" -> 1275), or None."""
    number = _smi_number(element, path)
    return None if number is None else int(number)


def _smi_power(gpu: ET.Element, tags: tuple[str, ...]) -> float | None:
    """Returns the first of ``tags`` with a value in the card's power section, in watts."""
    for section in _POWER_SECTIONS:
        if gpu.find(section) is None:
            continue
        for tag in tags:
            value = _smi_number(gpu, f"{section}/{tag}")
            if value is not None:
                return value
    return None


def _smi_ecc_uncorrected(gpu: ET.Element) -> int | None:
    """Returns the volatile uncorrected ECC count, or None when ECC is off or not reported."""
    volatile = gpu.find("ecc_errors/volatile")
    if volatile is None:
        return None
    if volatile.find("double_bit") is not None:
        return _smi_int(volatile, "double_bit/total")
    parts = [_smi_int(volatile, tag) for tag in _ECC_UNCORRECTED_PARTS]
    counted = [part for part in parts if part is not None]
    return sum(counted) if counted else None


def _smi_throttle_reasons(gpu: ET.Element) -> tuple[str, ...] | None:
    """Returns the reasons nvidia-smi marks "Active", in bit order; None without the section."""
    for section, prefix in _THROTTLE_SECTIONS:
        element = gpu.find(section)
        if element is None:
            continue
        active = [
            child.tag.removeprefix(prefix)
            for child in element
            if child.text is not None and child.text.strip() == "Active"
        ]
        return tuple(sorted(active, key=lambda name: (_THROTTLE_ORDER.get(name, len(_THROTTLE_ORDER)), name)))
    return None
