"""Host telemetry readers, on recorded /proc and /sys trees (tests/fixtures/hosts, see SOURCES.md)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from llmgw.node.telemetry import hwmon, procfs, rapl
from llmgw.node.telemetry.host import MAX_READING_AGE_S, MIN_SAMPLE_INTERVAL_S, HostSampler, ShardUsage

HOSTS = Path(__file__).resolve().parent.parent / "fixtures" / "hosts"
PROCFS = HOSTS / "procfs-testdata"
NODE_EXPORTER = HOSTS / "node-exporter"
TELEGRAF = HOSTS / "telegraf-k10temp"
DEV_T0 = HOSTS / "llmgw-dev-t0"
DEV_T1 = HOSTS / "llmgw-dev-t1"

# What the dev machine reported when the llmgw-dev trees were recorded.
DEV_TICKS = 100
DEV_PAGE = 4096
DEV_GROUP = 11669
DEV_INTERVAL_S = 2.076893102  # 14:00:40.390219383 - 14:00:38.313326281
KIB = 1024


# ---------------------------------------------------------------- /proc/stat


def test_cpu_times_from_procfs_testdata() -> None:
    # "cpu  301854 612 111922 8979004 3552 2 3944 0 0 0"
    times = procfs.read_cpu_times(PROCFS)
    assert times == procfs.CpuTimes(301854, 612, 111922, 8979004, 3552, 2, 3944, 0, 0, 0)
    assert times.total == 301854 + 612 + 111922 + 8979004 + 3552 + 2 + 3944
    assert times.idle_all == 8979004 + 3552


def test_guest_time_is_not_counted_twice() -> None:
    # node_exporter's line: "cpu  301854 612 111922 8979004 3552 2 3944 0 44 36";
    # guest (44) and guest_nice (36) are already inside user and nice.
    times = procfs.read_cpu_times(NODE_EXPORTER)
    assert (times.guest, times.guest_nice) == (44, 36)
    assert times.total == procfs.read_cpu_times(PROCFS).total


def test_cpu_utilization_between_two_recorded_samples() -> None:
    # t0: cpu  46201 0 11583 605969 782 0 163 674 0 0
    # t1: cpu  46550 0 11649 605969 782 0 163 675 0 0 -> 416 ticks, none idle: both CPUs busy
    before, after = procfs.read_cpu_times(DEV_T0), procfs.read_cpu_times(DEV_T1)
    assert after.total - before.total == 349 + 66 + 1
    assert procfs.cpu_utilization_percent(before, after) == 100.0


def test_cpu_utilization_partial_and_none_when_no_time_passed() -> None:
    before = procfs.CpuTimes(user=100, nice=0, system=50, idle=800, iowait=50)
    after = procfs.CpuTimes(user=130, nice=0, system=60, idle=850, iowait=60)
    # 100 ticks passed, 60 of them idle or iowait
    assert procfs.cpu_utilization_percent(before, after) == pytest.approx(40.0)
    assert procfs.cpu_utilization_percent(before, before) is None
    assert procfs.cpu_utilization_percent(after, before) is None


def test_short_cpu_line_of_old_kernels_and_malformed_one(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "stat").write_text("cpu  10 20 30 40\ncpu0 10 20 30 40\n")
    assert procfs.read_cpu_times(tmp_path) == procfs.CpuTimes(10, 20, 30, 40)
    (tmp_path / "proc" / "stat").write_text("cpu0 10 20 30 40\n")
    with pytest.raises(ValueError):
        procfs.read_cpu_times(tmp_path)
    (tmp_path / "proc" / "stat").write_text("cpu  10 20\n")
    with pytest.raises(ValueError):
        procfs.read_cpu_times(tmp_path)


# ---------------------------------------------------------------- loadavg and meminfo


def test_loadavg() -> None:
    assert procfs.read_loadavg(PROCFS) == (0.02, 0.04, 0.05)
    assert procfs.read_loadavg(NODE_EXPORTER) == (0.21, 0.37, 0.39)
    assert procfs.read_loadavg(DEV_T0) == (2.63, 1.39, 0.59)


def test_memory_with_memavailable() -> None:
    # MemTotal: 24683784 kB, MemAvailable: 23168304 kB
    memory = procfs.read_memory(DEV_T0)
    assert memory.total == 24683784 * KIB
    assert memory.available == 23168304 * KIB
    assert memory.used == (24683784 - 23168304) * KIB


def test_memory_without_memavailable_is_absent_not_estimated() -> None:
    # Both public fixtures predate MemAvailable (Linux 3.14).
    memory = procfs.read_memory(PROCFS)
    assert memory.total == 15666184 * KIB
    assert memory.available is None and memory.used is None
    assert procfs.read_memory(NODE_EXPORTER).total == 3742148 * KIB


# ---------------------------------------------------------------- /proc/PID/stat


def test_comm_with_spaces_and_parentheses() -> None:
    # procfs: "1020 ((a b ) ( c d) ) R 28378 1020 ..."; dev: "11672 (eng) (x y) S 11669 11669 ..."
    comm, fields = procfs.parse_pid_stat((PROCFS / "proc" / "584" / "stat").read_text())
    assert comm == "(a b ) ( c d) "
    assert fields[:3] == ["R", "28378", "1020"]
    comm, fields = procfs.parse_pid_stat((DEV_T0 / "proc" / "11672" / "stat").read_text())
    assert comm == "eng) (x y"
    assert fields[:3] == ["S", "11669", "11669"]
    with pytest.raises(ValueError):
        procfs.parse_pid_stat("12 no parentheses here")


def test_process_group_on_recorded_group() -> None:
    group = procfs.read_process_group(DEV_T0, DEV_GROUP, clock_ticks=DEV_TICKS, page_size=DEV_PAGE)
    assert group.pids == (11669, 11671, 11672, 11673)  # not 7134, the recording shell
    # utime+stime: only 11671 ran (118 + 11 ticks); rss pages 769 + 448 + 393 + 393
    assert group.cpu_seconds == pytest.approx(1.29)
    assert group.rss_bytes == (769 + 448 + 393 + 393) * DEV_PAGE
    assert group.cpu_by_process[(11671, 334205)] == pytest.approx(1.29)


def test_process_group_parses_odd_comm_and_kernel_threads() -> None:
    # 584's stat says pid 1020, pgrp 1020, rss 155 pages; the directory name is the pid.
    group = procfs.read_process_group(PROCFS, 1020, clock_ticks=100, page_size=4096)
    assert group.pids == (584,)
    assert group.rss_bytes == 155 * 4096
    vim = procfs.read_process_group(PROCFS, 7446, clock_ticks=100, page_size=4096)
    assert vim.pids == (26231,)
    assert vim.cpu_seconds == pytest.approx((1677 + 44) / 100)
    assert vim.rss_bytes == 1981 * 4096
    # 26233 is listed but has no stat; it is skipped, not an error
    assert procfs.read_process_group(PROCFS, 424242, clock_ticks=100, page_size=4096).pids == ()


def test_group_cores_between_recorded_samples() -> None:
    before = procfs.read_process_group(DEV_T0, DEV_GROUP, clock_ticks=DEV_TICKS, page_size=DEV_PAGE)
    after = procfs.read_process_group(DEV_T1, DEV_GROUP, clock_ticks=DEV_TICKS, page_size=DEV_PAGE)
    # 11671: (232 + 26) - (118 + 11) = 129 ticks in 2.077 s
    assert procfs.group_cores(before, after, DEV_INTERVAL_S) == pytest.approx(1.29 / DEV_INTERVAL_S)
    assert procfs.group_cores(before, after, 0) == 0.0


def test_group_cores_never_negative_when_a_process_exits_or_a_pid_is_reused() -> None:
    before = procfs.GroupSample(9.0, 0, (1, 2), {(1, 100): 4.0, (2, 100): 5.0})
    # 2 exited (its 5 s are gone from the sum), 1 gained 1 s, pid 3 is new with 0.5 s
    after = procfs.GroupSample(5.5, 0, (1, 3), {(1, 100): 5.0, (3, 900): 0.5})
    assert after.cpu_seconds < before.cpu_seconds
    assert procfs.group_cores(before, after, 10.0) == pytest.approx(0.15)
    # pid 1 reused by a new process (other start time): all its time is new
    reused = procfs.GroupSample(0.2, 0, (1,), {(1, 500): 0.2})
    assert procfs.group_cores(before, reused, 1.0) == pytest.approx(0.2)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def test_process_that_vanishes_mid_walk_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _copy(DEV_T0, tmp_path / "host")
    real_scandir = os.scandir

    def scandir_then_exit(path):  # type: ignore[no-untyped-def]
        entries = list(real_scandir(path))
        # 11671 exits after /proc was listed, before its stat is read
        os.remove(root / "proc" / "11671" / "stat")
        os.rmdir(root / "proc" / "11671")
        return iter(entries)

    monkeypatch.setattr(procfs.os, "scandir", scandir_then_exit)
    group = procfs.read_process_group(root, DEV_GROUP, clock_ticks=DEV_TICKS, page_size=DEV_PAGE)
    assert group.pids == (11669, 11672, 11673)
    assert group.rss_bytes == (769 + 393 + 393) * DEV_PAGE
    assert group.cpu_seconds == 0.0


def test_process_being_reaped_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = open

    def open_esrch(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).endswith("/11672/stat"):
            raise ProcessLookupError(3, "No such process")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(procfs, "open", open_esrch, raising=False)
    group = procfs.read_process_group(DEV_T0, DEV_GROUP, clock_ticks=DEV_TICKS, page_size=DEV_PAGE)
    assert group.pids == (11669, 11671, 11673)


def test_several_groups_in_one_walk() -> None:
    groups = procfs.read_process_groups(DEV_T0, [DEV_GROUP, 7134, 1], clock_ticks=DEV_TICKS, page_size=DEV_PAGE)
    assert groups[DEV_GROUP].pids == (11669, 11671, 11672, 11673)
    assert groups[7134].pids == (7134,)
    assert groups[7134].rss_bytes == 987 * DEV_PAGE
    assert groups[1].pids == ()


# ---------------------------------------------------------------- hwmon


def test_coretemp_two_sockets_old_physical_id_labels() -> None:
    temps = hwmon.read_temperatures(NODE_EXPORTER)
    assert temps.cpu_package_c == 55.0  # "Physical id 0" = 55000 on both sockets
    assert temps.board_inlet_c is None  # nothing there is an inlet sensor
    by_place = {(r.hwmon, r.label): r for r in temps.readings}
    assert by_place[("hwmon0", "Core 3")].celsius == 50.0
    assert by_place[("hwmon1", "Core 0")].chip == "coretemp"
    assert by_place[("hwmon10", "")].chip == "mt7996_phy0_2"
    assert by_place[("hwmon10", "")].celsius == 57.0
    assert by_place[("hwmon4", "foosensor")].chip == ""  # that chip has no name file


def test_coretemp_package_is_the_hottest_socket(tmp_path: Path) -> None:
    root = _copy(NODE_EXPORTER, tmp_path / "host")
    (root / "sys/class/hwmon/hwmon1/temp1_input").write_text("61000\n")
    (root / "sys/class/hwmon/hwmon0/temp1_label").write_text("Package id 0\n")
    (root / "sys/class/hwmon/hwmon1/temp1_label").write_text("Package id 1\n")
    assert hwmon.read_temperatures(root).cpu_package_c == 61.0


def test_coretemp_without_package_sensor_uses_hottest_core(tmp_path: Path) -> None:
    root = _copy(NODE_EXPORTER, tmp_path / "host")
    for chip in ("hwmon0", "hwmon1"):
        (root / "sys/class/hwmon" / chip / "temp1_input").unlink()
        (root / "sys/class/hwmon" / chip / "temp1_label").unlink()
    assert hwmon.read_temperatures(root).cpu_package_c == 54.0  # "Core 0" = 54000


def test_k10temp_tctl() -> None:
    temps = hwmon.read_temperatures(TELEGRAF)
    assert temps.cpu_package_c == 33.25  # Tctl = 33250; the nvme's 38.85 does not count
    assert temps.board_inlet_c is None


def _chip(root: Path, hwmon_dir: str, name: str | None, temps: dict[int, tuple[str | None, str]]) -> Path:
    """Writes one hwmon chip: {index: (label or None, raw temp*_input text)}."""
    chip = root / "sys" / "class" / "hwmon" / hwmon_dir
    chip.mkdir(parents=True)
    if name is not None:
        (chip / "name").write_text(name + "\n")
    for index, (label, raw) in temps.items():
        (chip / f"temp{index}_input").write_text(raw + "\n")
        if label is not None:
            (chip / f"temp{index}_label").write_text(label + "\n")
    return chip


def test_amd_prefers_tdie_and_takes_hottest_die(tmp_path: Path) -> None:
    _chip(tmp_path, "hwmon2", "k10temp", {1: ("Tctl", "58900"), 2: ("Tdie", "31900")})
    _chip(tmp_path, "hwmon3", "k10temp", {1: ("Tctl", "59400"), 2: ("Tdie", "32400"), 3: ("Tccd1", "52200")})
    _chip(tmp_path, "hwmon4", "zenpower", {1: ("Tdie", "30000"), 2: ("Tctl", "40000")})
    assert hwmon.read_temperatures(tmp_path).cpu_package_c == 32.4


def test_unlabelled_old_k10temp_is_tctl(tmp_path: Path) -> None:
    _chip(tmp_path, "hwmon0", "k10temp", {1: (None, "37375")})
    assert hwmon.read_temperatures(tmp_path).cpu_package_c == 37.375


def test_board_inlet_from_ambient_or_inlet_labels(tmp_path: Path) -> None:
    # dell-smm-hwmon labels: CPU, GPU, SODIMM, Other, Ambient
    _chip(tmp_path, "hwmon1", "dell_smm", {1: ("CPU", "42000"), 2: ("SODIMM", "44000"), 3: ("Ambient", "27000")})
    _chip(tmp_path, "hwmon2", "acpitz", {1: (None, "27800")})
    temps = hwmon.read_temperatures(tmp_path)
    assert temps.board_inlet_c == 27.0
    assert temps.cpu_package_c is None  # no CPU driver; dell_smm's "CPU" and acpitz are not used
    _chip(tmp_path, "hwmon3", "some_bmc", {1: ("Inlet Temp", "23000"), 2: ("Exhaust Temp", "35000")})
    assert hwmon.read_temperatures(tmp_path).board_inlet_c == 27.0  # the hottest inlet-like reading


def test_cpu_fallback_for_arm_soc_but_not_acpitz(tmp_path: Path) -> None:
    _chip(tmp_path, "hwmon0", "acpitz", {1: (None, "40000")})
    assert hwmon.read_temperatures(tmp_path).cpu_package_c is None
    _chip(tmp_path, "hwmon1", "cpu_thermal", {1: (None, "48312")})
    assert hwmon.read_temperatures(tmp_path).cpu_package_c == 48.312


def test_unreadable_and_malformed_sensors_are_skipped(tmp_path: Path) -> None:
    chip = _chip(tmp_path, "hwmon0", "coretemp", {1: ("Package id 0", "61000"), 2: ("Core 0", "58000")})
    (chip / "temp1_input").unlink()
    (chip / "temp1_input").mkdir()  # reading it fails (as a sensor failing with EIO would)
    (chip / "temp2_input").write_text("garbage\n")
    temps = hwmon.read_temperatures(tmp_path)
    assert temps.readings == ()
    assert temps.cpu_package_c is None


def test_old_driver_attributes_under_device(tmp_path: Path) -> None:
    device = tmp_path / "sys/class/hwmon/hwmon0/device"
    device.mkdir(parents=True)
    (device / "name").write_text("coretemp\n")
    (device / "temp1_input").write_text("47000\n")
    (device / "temp1_label").write_text("Physical id 0\n")
    assert hwmon.read_temperatures(tmp_path).cpu_package_c == 47.0


def test_no_hwmon_is_none_never_zero() -> None:
    temps = hwmon.read_temperatures(DEV_T0)  # the dev machine has no /sys/class/hwmon
    assert temps.cpu_package_c is None and temps.board_inlet_c is None
    assert temps.readings == ()


# ---------------------------------------------------------------- RAPL


def test_rapl_packages_only() -> None:
    counters = rapl.read_rapl(PROCFS)
    # intel-rapl:0 "package-0" and intel-rapl:a "package-10"; intel-rapl:0:0 ("core") is a sub-zone
    assert counters == {
        "package-0": rapl.EnergyCounter(240422366267, 262143328850),
        "package-10": rapl.EnergyCounter(240422366267, 262143328850),
    }


def test_rapl_ignores_mmio_duplicates_and_psys(tmp_path: Path) -> None:
    root = _copy(PROCFS, tmp_path / "host")
    powercap = root / "sys/class/powercap"
    for zone, name in (("intel-rapl-mmio:0", "package-0"), ("intel-rapl:1", "psys")):
        (powercap / zone).mkdir()
        (powercap / zone / "name").write_text(name + "\n")
        (powercap / zone / "energy_uj").write_text("5\n")
        (powercap / zone / "max_energy_range_uj").write_text("262143328850\n")
    assert rapl.read_rapl(root) == rapl.read_rapl(PROCFS)


def test_package_watts_over_recorded_counters(tmp_path: Path) -> None:
    before = rapl.read_rapl(PROCFS)
    root = _copy(PROCFS, tmp_path / "host")
    for zone in ("intel-rapl:0", "intel-rapl:a"):
        (root / "sys/class/powercap" / zone / "energy_uj").write_text(f"{240422366267 + 1_500_000_000}\n")
    after = rapl.read_rapl(root)
    # 1500 J per package, two packages, in 10 s
    assert rapl.package_watts(before, after, 10.0) == pytest.approx(300.0)


def test_package_watts_across_the_counter_wrap() -> None:
    before = {"package-0": rapl.EnergyCounter(240422366267, 262143328850)}
    after = {"package-0": rapl.EnergyCounter(1_000_000, 262143328850)}
    joules = (262143328850 - 240422366267 + 1_000_000) / 1e6
    assert rapl.package_watts(before, after, 100.0) == pytest.approx(joules / 100.0)
    unknown_range = {"package-0": rapl.EnergyCounter(1_000_000, 0)}
    assert rapl.package_watts(before, unknown_range, 100.0) is None


def test_package_watts_none_without_a_matching_pair() -> None:
    counters = rapl.read_rapl(PROCFS)
    assert rapl.package_watts({}, counters, 10.0) is None
    assert rapl.package_watts(counters, {}, 10.0) is None
    assert rapl.package_watts(counters, {"package-0": counters["package-0"]}, 10.0) is None
    assert rapl.package_watts(counters, counters, 0.0) is None
    assert rapl.package_watts(counters, counters, 10.0) == 0.0


def test_unreadable_energy_means_no_rapl(tmp_path: Path) -> None:
    root = _copy(PROCFS, tmp_path / "host")
    energy = root / "sys/class/powercap/intel-rapl:a/energy_uj"
    energy.unlink()
    energy.mkdir()  # unreadable, as energy_uj is to non-root users since Linux 5.10
    assert rapl.read_rapl(root) == {}
    assert rapl.read_rapl(DEV_T0) == {}  # no powercap at all


# ---------------------------------------------------------------- HostSampler


def _host(tmp_path: Path, proc_from: Path) -> Path:
    """Returns a root with ``proc_from``'s /proc, node_exporter's hwmon and procfs's RAPL."""
    root = tmp_path / "host"
    if root.exists():
        shutil.rmtree(root / "proc")
    else:
        shutil.copytree(NODE_EXPORTER / "sys", root / "sys")
        shutil.copytree(PROCFS / "sys/class/powercap", root / "sys/class/powercap")
    shutil.copytree(proc_from / "proc", root / "proc")
    return root


def _add_energy(root: Path, microjoules: int) -> None:
    for zone in ("intel-rapl:0", "intel-rapl:a"):
        path = root / "sys/class/powercap" / zone / "energy_uj"
        path.write_text(f"{int(path.read_text()) + microjoules}\n")


def test_first_sample_has_levels_but_no_rates(tmp_path: Path) -> None:
    sampler = HostSampler(_host(tmp_path, DEV_T0), clock_ticks=DEV_TICKS, page_size=DEV_PAGE)
    sample = sampler.sample(1000.0, {"shard-a": DEV_GROUP, "shard-gone": 424242})
    assert sample.taken_at == 1000.0
    assert sample.cpu_utilization_percent is None
    assert sample.cpu_package_watts is None
    assert sample.per_shard == {"shard-a": ShardUsage(cores=None, rss_bytes=2003 * DEV_PAGE)}
    assert (sample.load1, sample.load5, sample.load15) == (2.63, 1.39, 0.59)
    assert sample.memory_available_bytes == 23168304 * KIB
    assert sample.memory_used_bytes == (24683784 - 23168304) * KIB
    assert sample.cpu_package_celsius == 55.0
    assert sample.board_inlet_celsius is None


def test_second_sample_has_rates(tmp_path: Path) -> None:
    sampler = HostSampler(_host(tmp_path, DEV_T0), clock_ticks=DEV_TICKS, page_size=DEV_PAGE)
    sampler.sample(1000.0, {"shard-a": DEV_GROUP})
    root = _host(tmp_path, DEV_T1)
    _add_energy(root, 2_000_000_000)  # 2000 J per package
    sample = sampler.sample(1000.0 + 20.0, {"shard-a": DEV_GROUP})
    assert sample.cpu_utilization_percent == 100.0
    assert sample.cpu_package_watts == pytest.approx(2 * 2000.0 / 20.0)
    assert sample.per_shard["shard-a"].cores == pytest.approx(1.29 / 20.0)
    assert sample.memory_available_bytes == 23401600 * KIB


def test_sampling_at_most_every_interval(tmp_path: Path) -> None:
    sampler = HostSampler(_host(tmp_path, DEV_T0), clock_ticks=DEV_TICKS, page_size=DEV_PAGE)
    first = sampler.sample(1000.0, {"shard-a": DEV_GROUP})
    _host(tmp_path, DEV_T1)
    again = sampler.sample(1000.0 + MIN_SAMPLE_INTERVAL_S - 0.5, {"shard-a": DEV_GROUP})
    assert again is first
    fresh = sampler.sample(1000.0 + MIN_SAMPLE_INTERVAL_S, {"shard-a": DEV_GROUP})
    assert fresh is not first
    assert fresh.taken_at == 1000.0 + MIN_SAMPLE_INTERVAL_S
    assert fresh.cpu_utilization_percent == 100.0


def test_readings_older_than_max_age_are_left_out(tmp_path: Path) -> None:
    sampler = HostSampler(_host(tmp_path, DEV_T0), clock_ticks=DEV_TICKS, page_size=DEV_PAGE)
    sampler.sample(1000.0, {"shard-a": DEV_GROUP})
    assert sampler.latest(1000.0 + MAX_READING_AGE_S) is not None
    assert sampler.latest(1000.0 + MAX_READING_AGE_S + 1) is None
    _host(tmp_path, DEV_T1)
    late = sampler.sample(1000.0 + MAX_READING_AGE_S + 1, {"shard-a": DEV_GROUP})
    # counters a minute old give no rates; levels are there
    assert late.cpu_utilization_percent is None
    assert late.cpu_package_watts is None
    assert late.per_shard["shard-a"] == ShardUsage(cores=None, rss_bytes=2003 * DEV_PAGE)
    assert late.load1 == 2.63
    assert sampler.latest(late.taken_at) is late


def test_shard_whose_group_changed_has_no_rate_yet(tmp_path: Path) -> None:
    sampler = HostSampler(_host(tmp_path, DEV_T0), clock_ticks=DEV_TICKS, page_size=DEV_PAGE)
    sampler.sample(1000.0, {"shard-a": 7134})
    _host(tmp_path, DEV_T1)
    sample = sampler.sample(1015.0, {"shard-a": DEV_GROUP})
    assert sample.per_shard["shard-a"].cores is None


def test_host_without_sensors_gives_none_never_zero() -> None:
    sampler = HostSampler(DEV_T0, clock_ticks=DEV_TICKS, page_size=DEV_PAGE)
    sampler.sample(0.0, {})
    sample = sampler.sample(30.0, {})
    assert sample.cpu_package_celsius is None
    assert sample.board_inlet_celsius is None
    assert sample.cpu_package_watts is None
    assert sample.per_shard == {}
    assert sample.cpu_utilization_percent is None  # same recorded /proc/stat twice: no time passed


def test_missing_proc_gives_none_and_does_not_raise(tmp_path: Path) -> None:
    sample = HostSampler(tmp_path, clock_ticks=100, page_size=4096).sample(0.0, {"shard-a": 1})
    assert sample.load1 is None
    assert sample.memory_used_bytes is None
    assert sample.per_shard == {}


# ---------------------------------------------------------------- this machine


def test_this_machine_proc() -> None:
    memory = procfs.read_memory()
    assert memory.total > 0
    assert memory.available is not None and 0 <= memory.available <= memory.total
    assert memory.used == memory.total - memory.available
    times = procfs.read_cpu_times()
    assert times.total > 0 and times.idle_all <= times.total
    load = procfs.read_loadavg()
    assert all(value >= 0 for value in load)
    ticks, page = procfs.live_units()
    mine = procfs.read_process_group(procfs.ROOT, os.getpgrp(), clock_ticks=ticks, page_size=page)
    assert os.getpid() in mine.pids
    assert mine.rss_bytes > 0
