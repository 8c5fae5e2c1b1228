"""GPU telemetry: nvidia-smi XML and NVML readers, NVLink counters, XID lines.

The XML and kernel-log fixtures are recorded output from real machines (see
tests/fixtures/gpu-telemetry/SOURCES.md); the expected values below were read off each
fixture by hand. NVML is a stand-in module serving the numbers two of those fixtures show.
"""

from __future__ import annotations

import subprocess
import types
from pathlib import Path
from typing import Any

import attrs
import pytest

from llmgw.node.gpus import nvlink, telemetry, xid
from llmgw.node.gpus.telemetry import GpuReading

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpu-telemetry"
NOW = 1_700_000_000.0
MIB = 1024 * 1024

# Per fixture, per card: (uuid, utilization %, memory used MiB, memory utilization %,
# SM clock MHz, uncorrected volatile ECC, temperature C, HBM temperature C, power draw W,
# enforced power limit W, active throttle reasons).
EXPECTED: dict[str, list[tuple[Any, ...]]] = {
    # v12 schema, MIG enabled (no utilisation), HBM temperature, gpu_power_readings.
    "telegraf-a100-sxm4-v12.xml": [
        ("GPU-513536b6-7d19-9063-b049-1e69664bb298", None, 50, None, 1275, 0, 27, 44, 67.03, 500.0, ()),
    ],
    # v11 schema, MIG enabled: volatile ECC N/A at the card, HBM temperature, power_readings.
    "netdata-a100-sxm4-mig.xml": [
        ("GPU-27b94a00-ed54-5c24-b1fd-1054085de32a", None, 38, None, 1410, None, 36, 44, 66.92, 400.0, ()),
    ],
    # v11 schema with single_bit/double_bit ECC counts; idle.
    "netdata-tesla-p100.xml": [
        ("GPU-d3da8716-eaab-75db-efc1-60e88e1cd55e", 0, 0, 0, 405, 0, 38, None, 26.16, 250.0, ("gpu_idle",)),
    ],
    # v11 schema, SRAM/DRAM ECC counts, clocks_throttle_reasons.
    "telegraf-tesla-t4.xml": [
        ("GPU-d37e67a5-91dd-3774-a5cb-99096249601a", 0, 1032, 0, 585, 0, 40, None, 26.78, 70.0, ()),
    ],
    # v13 schema (driver 595): average/instant power draw, parity/SEC-DED ECC split, busy.
    "telegraf-rtx-3080-v13.xml": [
        ("GPU-19d6d965-2acc-f646-00f8-4c76979aabb4", 65, 9184, 9, 1950, None, 27, None, 139.62, 320.0, ()),
    ],
    # v12 schema from driver 570: average power draw already, no power_draw.
    "telegraf-rtx-3060-v12.xml": [
        ("GPU-d6889ff6-2523-9142-ca3c-1ca3f396a625", 0, 116, 0, 210, None, 42, None, 11.6, 170.0, ("gpu_idle",)),
    ],
    # v10 schema, a short log: no ECC, no memory temperature, no limit, no throttle section.
    "telegraf-gtx-1070-ti.xml": [
        ("GPU-f9ba66fc-a7f5-94c5-da19-019ef2f9c665", 0, 42, 0, 135, None, 39, None, None, None, None),
    ],
    # v13 schema, two cards, ECC disabled.
    "telegraf-dual_a5000-v13.xml": [
        ("GPU-12345678-aaaa-bbbb-cccc-0123456789ab", 0, 22437, 0, 210, None, 13, None, 6.41, 230.0, ("gpu_idle",)),
        ("GPU-12345678-aaaa-bbbb-cccc-0123456789cd", 0, 17253, 0, 210, None, 15, None, 13.6, 230.0, ("gpu_idle",)),
    ],
}

_FIELDS = (
    "uuid",
    "utilization_percent",
    "memory_used_mb",
    "memory_utilization_percent",
    "sm_clock_mhz",
    "ecc_uncorrected",
    "temperature_c",
    "memory_temperature_c",
    "power_draw_w",
    "power_limit_w",
    "throttle_reasons",
)


def expected_reading(index: int, row: tuple[Any, ...]) -> GpuReading:
    return GpuReading(index=index, taken_at=NOW, **dict(zip(_FIELDS, row, strict=True)))


def smi_fixture(name: str) -> list[GpuReading]:
    return telemetry.parse_smi_readings((FIXTURES / name).read_bytes(), NOW)


# --- nvidia-smi -q -x ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parse_smi_readings_on_recorded_output(name: str) -> None:
    expected = [expected_reading(index, row) for index, row in enumerate(EXPECTED[name])]
    assert smi_fixture(name) == expected


def test_every_xml_fixture_has_expectations() -> None:
    assert sorted(path.name for path in FIXTURES.glob("*.xml")) == sorted(EXPECTED)


def test_parse_smi_readings_na_is_none_not_zero() -> None:
    (a100,) = smi_fixture("netdata-a100-sxm4-mig.xml")
    # The card prints <volatile><sram_uncorrectable>N/A ... while its aggregate counts are 0.
    assert a100.ecc_uncorrected is None
    assert a100.utilization_percent is None and a100.memory_utilization_percent is None


def test_parse_smi_readings_refuses_what_is_not_nvidia_smi_xml() -> None:
    with pytest.raises(ValueError, match="unreadable XML"):
        telemetry.parse_smi_readings("NVIDIA-SMI has failed because it couldn't communicate", NOW)
    with pytest.raises(ValueError, match="gave <html>, not <nvidia_smi_log>"):
        telemetry.parse_smi_readings("<html></html>", NOW)


def test_parse_smi_readings_skips_a_card_without_uuid() -> None:
    text = "<nvidia_smi_log><gpu id='x'><product_name>?</product_name></gpu></nvidia_smi_log>"
    assert telemetry.parse_smi_readings(text, NOW) == []


# --- throttle reasons ---------------------------------------------------------------------


def test_decode_throttle_reasons() -> None:
    assert telemetry.decode_throttle_reasons(0) == ()
    assert telemetry.decode_throttle_reasons(0x1) == ("gpu_idle",)
    assert telemetry.decode_throttle_reasons(0x4 | 0x40 | 0x1) == ("gpu_idle", "sw_power_cap", "hw_thermal_slowdown")
    assert telemetry.decode_throttle_reasons(0x8 | 0x80) == ("hw_slowdown", "hw_power_brake_slowdown")
    assert telemetry.decode_throttle_reasons(0x10 | 0x20 | 0x100) == (
        "sync_boost",
        "sw_thermal_slowdown",
        "display_clocks_setting",
    )
    assert telemetry.decode_throttle_reasons(0x2 | 0x1000) == ("applications_clocks_setting", "unknown_0x1000")


def test_throttle_bits_match_nvidia_ml_py() -> None:
    pynvml = pytest.importorskip("pynvml")
    names = {
        "gpu_idle": "GpuIdle",
        "applications_clocks_setting": "ApplicationsClocksSetting",
        "sw_power_cap": "SwPowerCap",
        "hw_slowdown": "HwSlowdown",
        "sync_boost": "SyncBoost",
        "sw_thermal_slowdown": "SwThermalSlowdown",
        "hw_thermal_slowdown": "HwThermalSlowdown",
        "hw_power_brake_slowdown": "HwPowerBrakeSlowdown",
        "display_clocks_setting": "DisplayClockSetting",
    }
    for bit, name in telemetry.THROTTLE_REASON_BITS:
        if name in names:
            assert getattr(pynvml, "nvmlClocksThrottleReason" + names[name]) == bit, name
            if hasattr(pynvml, "nvmlClocksEventReasonGpuIdle"):
                assert getattr(pynvml, "nvmlClocksEventReason" + names[name]) == bit, name
    assert pynvml.NVML_FI_DEV_MEMORY_TEMP == 82


# --- NVML stand-in ------------------------------------------------------------------------

NOT_SUPPORTED = object()
GPU_LOST = object()


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__({2: "Invalid Argument", 3: "Not Supported", 15: "GPU is lost"}.get(value, "Unknown Error"))
        self.value = value


@attrs.define
class Card:
    """What NVML would answer for one card, in NVML's own units (bytes, mW, a bitmask)."""

    uuid: Any
    utilization: Any = NOT_SUPPORTED  # (gpu %, memory %)
    memory_used_bytes: Any = NOT_SUPPORTED
    sm_clock: Any = NOT_SUPPORTED
    ecc_uncorrected: Any = NOT_SUPPORTED
    temperature: Any = NOT_SUPPORTED
    memory_temperature: Any = NOT_SUPPORTED
    power_mw: Any = NOT_SUPPORTED
    limit_mw: Any = NOT_SUPPORTED
    reasons: Any = NOT_SUPPORTED
    handle: Any = None  # GPU_LOST: the handle cannot be had
    # None: no NVLink. Else one (state, {counter: count or NOT_SUPPORTED}) per link.
    links: list[tuple[int, dict[int, Any]]] | None = None


def fake_pynvml(cards: list[Card], *, event_reasons: bool = True, memory_v2: bool = True) -> types.ModuleType:
    """Returns a module shaped like nvidia-ml-py's pynvml, serving ``cards``."""
    mod = types.ModuleType("pynvml")
    mod.calls = []  # type: ignore[attr-defined]
    constants = dict(
        NVMLError=FakeNVMLError,
        NVML_SUCCESS=0,
        NVML_ERROR_INVALID_ARGUMENT=2,
        NVML_ERROR_NOT_SUPPORTED=3,
        NVML_FEATURE_DISABLED=0,
        NVML_FEATURE_ENABLED=1,
        NVML_CLOCK_SM=1,
        NVML_TEMPERATURE_GPU=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        NVML_FI_DEV_MEMORY_TEMP=82,
        NVML_VALUE_TYPE_UNSIGNED_INT=1,
        NVML_NVLINK_MAX_LINKS=18,
        NVML_NVLINK_ERROR_DL_REPLAY=0,
        NVML_NVLINK_ERROR_DL_RECOVERY=1,
        NVML_NVLINK_ERROR_DL_CRC_FLIT=2,
        NVML_NVLINK_ERROR_DL_CRC_DATA=3,
    )
    for name, value in constants.items():
        setattr(mod, name, value)
    if memory_v2:
        mod.nvmlMemory_v2 = 0x02000028  # type: ignore[attr-defined]

    def answer(value: Any) -> Any:
        if value is NOT_SUPPORTED:
            raise FakeNVMLError(3)
        return value

    def card(handle: int) -> Card:
        return cards[handle]

    def get_handle(index: int) -> int:
        if cards[index].handle is GPU_LOST:
            raise FakeNVMLError(15)
        return index

    def utilization(handle: int) -> Any:
        gpu, memory = answer(card(handle).utilization)
        return types.SimpleNamespace(gpu=gpu, memory=memory)

    def memory_info(handle: int, version: int | None = None) -> Any:
        mod.calls.append(("memory", version))
        if version is not None and not memory_v2:
            raise TypeError("nvmlDeviceGetMemoryInfo() got an unexpected keyword argument 'version'")
        return types.SimpleNamespace(used=answer(card(handle).memory_used_bytes))

    def clock(handle: int, kind: int) -> int:
        assert kind == mod.NVML_CLOCK_SM
        return answer(card(handle).sm_clock)

    def ecc(handle: int, error_type: int, counter_type: int) -> int:
        assert (error_type, counter_type) == (mod.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, mod.NVML_VOLATILE_ECC)
        return answer(card(handle).ecc_uncorrected)

    def temperature(handle: int, sensor: int) -> int:
        assert sensor == mod.NVML_TEMPERATURE_GPU
        return answer(card(handle).temperature)

    def field_values(handle: int, field_ids: list[int]) -> list[Any]:
        assert field_ids == [82]
        value = card(handle).memory_temperature
        if value is NOT_SUPPORTED:  # NVML answers per field, the call itself succeeds
            return [types.SimpleNamespace(fieldId=82, nvmlReturn=3, valueType=0, value=types.SimpleNamespace(dVal=0.0))]
        return [types.SimpleNamespace(fieldId=82, nvmlReturn=0, valueType=1, value=types.SimpleNamespace(uiVal=value))]

    def reasons(handle: int) -> int:
        return answer(card(handle).reasons)

    def link_state(handle: int, link: int) -> int:
        links = card(handle).links
        if links is None:
            raise FakeNVMLError(3)
        if link >= len(links):
            raise FakeNVMLError(2)
        return links[link][0]

    def link_counter(handle: int, link: int, counter: int) -> int:
        links = card(handle).links
        assert links is not None and link < len(links)
        return answer(links[link][1].get(counter, NOT_SUPPORTED))

    functions = dict(
        nvmlDeviceGetCount=lambda: len(cards),
        nvmlDeviceGetHandleByIndex=get_handle,
        nvmlDeviceGetUUID=lambda handle: card(handle).uuid,
        nvmlDeviceGetUtilizationRates=utilization,
        nvmlDeviceGetMemoryInfo=memory_info,
        nvmlDeviceGetClockInfo=clock,
        nvmlDeviceGetTotalEccErrors=ecc,
        nvmlDeviceGetTemperature=temperature,
        nvmlDeviceGetFieldValues=field_values,
        nvmlDeviceGetPowerUsage=lambda handle: answer(card(handle).power_mw),
        nvmlDeviceGetEnforcedPowerLimit=lambda handle: answer(card(handle).limit_mw),
        nvmlDeviceGetCurrentClocksThrottleReasons=reasons,
        nvmlDeviceGetNvLinkState=link_state,
        nvmlDeviceGetNvLinkErrorCounter=link_counter,
    )
    if event_reasons:
        functions["nvmlDeviceGetCurrentClocksEventReasons"] = reasons
    for name, function in functions.items():
        setattr(mod, name, function)
    return mod


# The cards of telegraf-a100-sxm4-v12.xml and netdata-tesla-p100.xml, as NVML would give
# them: MIG hides the A100's utilisation, the P100 has no HBM sensor, power in milliwatts.
A100_CARD = Card(
    uuid=b"GPU-513536b6-7d19-9063-b049-1e69664bb298",
    memory_used_bytes=50 * MIB,
    sm_clock=1275,
    ecc_uncorrected=0,
    temperature=27,
    memory_temperature=44,
    power_mw=67030,
    limit_mw=500000,
    reasons=0,
)
P100_CARD = Card(
    uuid="GPU-d3da8716-eaab-75db-efc1-60e88e1cd55e",
    utilization=(0, 0),
    memory_used_bytes=0,
    sm_clock=405,
    ecc_uncorrected=0,
    temperature=38,
    power_mw=26160,
    limit_mw=250000,
    reasons=0x1,
)


def test_nvml_and_nvidia_smi_agree_on_the_same_cards() -> None:
    from_nvml = telemetry.read_nvml_readings(fake_pynvml([A100_CARD, P100_CARD]), NOW)
    (a100,) = smi_fixture("telegraf-a100-sxm4-v12.xml")
    (p100,) = smi_fixture("netdata-tesla-p100.xml")
    assert from_nvml == [a100, attrs.evolve(p100, index=1)]


def test_nvml_not_supported_is_none_not_zero() -> None:
    (reading,) = telemetry.read_nvml_readings(fake_pynvml([Card(uuid="GPU-x")]), NOW)
    assert reading == GpuReading(index=0, uuid="GPU-x", taken_at=NOW)
    assert all(getattr(reading, name) is None for name in _FIELDS[1:])


def test_nvml_one_lost_card_does_not_drop_the_others() -> None:
    lost = Card(uuid="GPU-lost", handle=GPU_LOST)
    readings = telemetry.read_nvml_readings(fake_pynvml([lost, A100_CARD]), NOW)
    assert [(r.index, r.uuid) for r in readings] == [(1, "GPU-513536b6-7d19-9063-b049-1e69664bb298")]
    assert readings[0].power_draw_w == 67.03


def test_nvml_old_bindings_fall_back_to_throttle_reasons_and_memory_v1() -> None:
    nvml = fake_pynvml([attrs.evolve(P100_CARD, reasons=0x4 | 0x40)], event_reasons=False, memory_v2=False)
    (reading,) = telemetry.read_nvml_readings(nvml, NOW)
    assert reading.throttle_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert reading.memory_used_mb == 0
    assert nvml.calls == [("memory", None)]


def test_nvml_memory_v2_preferred() -> None:
    nvml = fake_pynvml([attrs.evolve(A100_CARD, memory_used_bytes=50 * MIB + MIB - 1)])
    (reading,) = telemetry.read_nvml_readings(nvml, NOW)
    assert reading.memory_used_mb == 50
    assert nvml.calls == [("memory", 0x02000028)]


def test_nvml_count_failure_raises() -> None:
    nvml = fake_pynvml([])

    def broken() -> int:
        raise FakeNVMLError(1)

    nvml.nvmlDeviceGetCount = broken  # type: ignore[attr-defined]
    with pytest.raises(FakeNVMLError):
        telemetry.read_nvml_readings(nvml, NOW)


def test_fresh_leaves_out_readings_older_than_a_minute() -> None:
    old = GpuReading(index=0, uuid="GPU-a", taken_at=NOW - telemetry.READING_MAX_AGE_S - 1)
    edge = GpuReading(index=1, uuid="GPU-b", taken_at=NOW - telemetry.READING_MAX_AGE_S)
    new = GpuReading(index=2, uuid="GPU-c", taken_at=NOW - 5)
    assert telemetry.fresh([old, edge, new], NOW) == [edge, new]


# --- NVLink -------------------------------------------------------------------------------

CRC_FLIT, CRC_DATA, REPLAY, RECOVERY = 2, 3, 0, 1


def test_nvlink_sums_active_links_only() -> None:
    links = [
        (1, {CRC_FLIT: 3, CRC_DATA: 1, REPLAY: 10, RECOVERY: 0}),
        (0, {CRC_FLIT: 1000, CRC_DATA: 1000, REPLAY: 1000, RECOVERY: 1000}),  # down: not counted
        (1, {CRC_FLIT: 4, CRC_DATA: 0, REPLAY: 5, RECOVERY: 2}),
    ]
    nvml = fake_pynvml([Card(uuid="GPU-h100", links=links)])
    result = nvlink.read_nvlink_errors(nvml, NOW)
    assert result == {
        "GPU-h100": nvlink.NvLinkErrors(
            index=0, uuid="GPU-h100", taken_at=NOW, active_links=2, crc_flit=7, crc_data=1, replay=15, recovery=2
        )
    }


def test_nvlink_absent_is_none() -> None:
    quiet_link = (1, {CRC_FLIT: 0, CRC_DATA: 0, REPLAY: 0, RECOVERY: 0})
    nvml = fake_pynvml([Card(uuid="GPU-pcie"), Card(uuid="GPU-sxm", links=[quiet_link])])
    result = nvlink.read_nvlink_errors(nvml, NOW)
    assert result["GPU-pcie"] is None
    sxm = result["GPU-sxm"]
    assert sxm is not None and (sxm.active_links, sxm.crc_flit, sxm.replay) == (1, 0, 0)


def test_nvlink_unsupported_counter_is_none_not_zero() -> None:
    links = [(1, {CRC_FLIT: 2, REPLAY: 1, RECOVERY: 0}), (1, {CRC_FLIT: 1, REPLAY: 0, RECOVERY: 0})]
    result = nvlink.read_nvlink_errors(fake_pynvml([Card(uuid="GPU-a", links=links)]), NOW)
    errors = result["GPU-a"]
    assert errors is not None
    assert (errors.crc_flit, errors.crc_data, errors.replay, errors.recovery) == (3, None, 1, 0)


def test_nvlink_all_links_down_counts_nothing() -> None:
    result = nvlink.read_nvlink_errors(fake_pynvml([Card(uuid="GPU-a", links=[(0, {}), (0, {})])]), NOW)
    assert result["GPU-a"] == nvlink.NvLinkErrors(index=0, uuid="GPU-a", taken_at=NOW, active_links=0)


# --- XID ----------------------------------------------------------------------------------


def xid_fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_parse_xid_dmesg_with_process_and_unknown_process() -> None:
    events = xid.parse_xid_lines(xid_fixture("xid-chia-gigahorse-301-dmesg.log"))
    assert [(e.pci_address, e.xid, e.pid, e.process, e.monotonic_s) for e in events] == [
        ("0000:0a:00", 31, 13332, "cuda_plot_k32_v", 14328.198504),
        ("0000:0a:00", 62, None, None, 14370.687545),
        ("0000:0a:00", 45, None, None, 14370.688139),
        ("0000:0a:00", 45, None, None, 14372.202098),
        ("0000:0a:00", 45, None, None, 14376.322743),
    ]
    assert events[0].message.startswith("Ch 00000010, intr 00000000. MMU Fault: ENGINE CE2 HUBCLIENT_CE0")
    assert events[0].message.endswith("FAULT_PRIV_VIOLATION ACCESS_TYPE_VIRT_READ")
    assert events[1].message == "2023b230 20238a3a 2023e8b6 2023eac4 2023ec3c 2023ea86 00000000 00000000"
    assert events[2].timestamp == "14370.688139"


def test_parse_xid_dmesg_ctime_dates() -> None:
    events = xid.parse_xid_lines(xid_fixture("xid-gpud-pr46-dmesg-ctime.log"))
    assert [(e.xid, e.timestamp, e.monotonic_s) for e in events] == [
        (13, "Fri Aug 30 11:43:09 2024", None),
        (13, "Fri Aug 30 11:43:09 2024", None),
        (13, "Fri Aug 30 11:43:09 2024", None),
        (109, "Fri Aug 30 11:43:14 2024", None),
    ]
    assert events[0].message == "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter"
    assert (events[3].pid, events[3].process) == (1797828, "pt_main_thread")
    assert events[3].message == "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005"


def test_parse_xid_dmesg_T_skips_other_nvrm_lines() -> None:
    events = xid.parse_xid_lines(xid_fixture("xid-akash-support-244-dmesg-T.log"))
    assert [(e.pci_address, e.xid, e.pid, e.process) for e in events] == [
        ("0000:00:05", 43, 1045242, "pt_main_thread"),
        ("0000:00:05", 43, 1084984, "pt_main_thread"),
        ("0000:00:07", 31, 2512125, "python3.10"),
        ("0000:00:08", 94, None, None),
    ]
    assert events[3].message == "Contained: SM (0x1). RST: No, D-RST: No"
    assert events[0].timestamp == "Wed Jul 31 23:14:18 2024"


def test_parse_xid_journal_without_stamp() -> None:
    events = xid.parse_xid_lines(xid_fixture("xid-open-gpu-kernel-modules-1150-journal.log"))
    assert len(events) == 7
    assert {e.pci_address for e in events} == {"0000:dc:00", "0000:ed:00", "0000:ba:00", "0000:97:00"}
    assert all(e.xid == 45 and e.process == "python3" and e.timestamp is None for e in events)
    assert events[0].pid == 1818990
    assert events[0].message == "Ch 00000001 caused by previous Xid 149"


def test_parse_xid_old_drivers_without_process_or_pci_prefix() -> None:
    old = xid.parse_xid_lines(xid_fixture("xid-bumblebee-677-dmesg.log"))
    assert [(e.xid, e.pid, e.message) for e in old] == [
        (32, None, "Channel ID 00000000 intr 00004000"),
        (32, None, "Channel ID 00000000 intr 00004000"),
        (31, None, "Ch 00000003, engmask 00000101, intr 10000000"),
    ]
    syslog = xid.parse_xid_lines(xid_fixture("xid-pastebin-gn6mYmM4-syslog.log"))
    assert [(e.pci_address, e.xid, e.monotonic_s) for e in syslog] == [
        ("0000:01:00", 13, 4909.92297),
        ("0000:01:00", 13, 5044.30229),
        ("0000:01:00", 13, 5061.871534),
    ]
    (one,) = xid.parse_xid_lines(xid_fixture("xid-pastebin-HDtNJn5t-syslog.log"))
    assert (one.pci_address, one.xid, one.timestamp) == ("0000:01:00", 31, "18296.507578")


def test_xid_watcher_reports_each_line_once() -> None:
    watcher = xid.XidWatcher()
    text = xid_fixture("xid-bumblebee-677-dmesg.log")
    first = watcher.new_events(text)
    # The two Xid 32 lines print the same words at different kernel times: two events.
    assert [e.xid for e in first] == [32, 32, 31]
    assert watcher.new_events(text) == []
    later = "[24130.000001] NVRM: Xid (PCI:0000:01:00): 79, pid=1122, GPU has fallen off the bus."
    (new,) = watcher.new_events(text + "\n" + later)
    assert (new.xid, new.pid, new.process, new.message) == (79, 1122, None, "GPU has fallen off the bus.")
    assert watcher.new_events(later) == []


def test_xid_watcher_same_stamp_through_another_source_is_one_event() -> None:
    watcher = xid.XidWatcher()
    report = "NVRM: Xid (PCI:0000:0a:00): 45, pid='<unknown>', name=<unknown>, Ch 00000008"
    assert len(watcher.new_events("[14370.688139] " + report)) == 1
    assert watcher.new_events("Apr  7 10:00:00 host kernel: [14370.688139] " + report) == []


def test_xid_watcher_forgets_beyond_its_memory() -> None:
    watcher = xid.XidWatcher(memory=2)
    lines = [f"[{n}.0] NVRM: Xid (PCI:0000:01:00): 13, Graphics Exception" for n in range(3)]
    assert len(watcher.new_events(lines)) == 3
    assert len(watcher.new_events(lines[0])) == 1  # forgotten, so reported again
    assert watcher.new_events(lines[2]) == []


# --- reading the kernel log ---------------------------------------------------------------


class FakeRun:
    """Stands in for subprocess.run: answers per program, records the calls."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.calls: list[tuple[list[str], dict[str, Any]]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append((argv, kwargs))
        answer = self.answers[argv[0]]
        if isinstance(answer, BaseException):
            raise answer
        returncode, stdout, stderr = answer
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)


def test_read_kernel_log_prefers_journalctl() -> None:
    text = xid_fixture("xid-chia-gigahorse-301-dmesg.log")
    run = FakeRun({"journalctl": (0, text, ""), "dmesg": AssertionError("dmesg must not run")})
    lines, note = xid.read_kernel_log(run=run)
    assert (lines, note) == (text.splitlines(), "")
    ((argv, kwargs),) = run.calls
    assert argv[:4] == ["journalctl", "-k", "-o", "short-monotonic"]
    assert f"--since=-{int(xid.KERNEL_LOG_WINDOW_S)}s" in argv
    assert kwargs["timeout"] == xid.KERNEL_LOG_TIMEOUT_S and kwargs["check"] is False


def test_read_kernel_log_falls_back_to_dmesg() -> None:
    text = xid_fixture("xid-bumblebee-677-dmesg.log")
    run = FakeRun({"journalctl": FileNotFoundError(2, "No such file"), "dmesg": (0, text, "")})
    assert xid.read_kernel_log(run=run) == (text.splitlines(), "")
    assert [argv[0] for argv, _ in run.calls] == ["journalctl", "dmesg"]


def test_read_kernel_log_neither_readable_never_raises() -> None:
    run = FakeRun(
        {
            "journalctl": subprocess.TimeoutExpired(["journalctl"], xid.KERNEL_LOG_TIMEOUT_S),
            "dmesg": (1, "", "dmesg: read kernel buffer failed: Operation not permitted\n"),
        }
    )
    lines, note = xid.read_kernel_log(run=run)
    assert lines == []
    assert note.startswith("no kernel log: ")
    assert "journalctl: no answer in 10 s" in note
    assert "dmesg: exit status 1 (dmesg: read kernel buffer failed: Operation not permitted)" in note


def test_xid_watcher_poll() -> None:
    run = FakeRun({"journalctl": (0, xid_fixture("xid-gpud-pr46-dmesg-ctime.log"), "")})
    watcher = xid.XidWatcher()
    events, note = watcher.poll(run=run)
    assert (len(events), note) == (4, "")
    assert watcher.poll(run=run) == ([], "")
