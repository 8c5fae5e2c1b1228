"""``llmgw doctor``'s judgements (llmgw/node/doctor/checks.py) on recorded real output, and its
gathering on this machine's own /proc (llmgw/node/doctor/gather.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs
import trio

from llmgw.config import load_agent_config
from llmgw.node.doctor.checks import (
    ControlPlaneProbe, EngineProbe, EngineUserFacts, NodeFacts, diagnose, serious,
)
from llmgw.node.doctor.gather import gather
from llmgw.node.doctor.report import Severity
from llmgw.node.gpus.inventory import GpuProcess
from llmgw.node.gpus.nvsmi import combine, parse_list, parse_query_xml
from llmgw.node.gpus.telemetry import parse_smi_readings
from llmgw.node.gpus.xid import parse_xid_lines

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SMI = FIXTURES / "nvidia-smi"
TELEMETRY = FIXTURES / "gpu-telemetry"
#: A healthy CPU node: every check that can say OK does.
HEALTHY = NodeFacts(os="Debian GNU/Linux 12", arch="x86_64", cpu_model="EPYC", cpus=8,
                    cpu_flags=frozenset({"avx", "avx2", "fma"}), memory_total_mb=32768, memory_available_mb=30000,
                    weights_dir="/var/lib/llmgw-agent/weights", disk_free_mb=500_000, disk_total_mb=1_000_000,
                    memlock="infinity", memlock_source="systemd", clock_synchronized=True,
                    engines=(EngineProbe("sim", True, "0.1.0", runs=True, check_output="sim 0.1.0"),),
                    control_planes=(ControlPlaneProbe("10.0.0.1:7070", True),),
                    engine_user=EngineUserFacts("llmgw-engine", 998))


def mig_node() -> NodeFacts:
    """The recorded A100 80GB machine: card 0 in MIG mode with four 1g.20gb instances, three whole cards."""
    inventory = combine(parse_query_xml((SMI / "telegraf-a100-sxm4-80gb-mig.xml").read_text()),
                        parse_list((SMI / "telegraf-issue-5812-a100-sxm4-80gb-mig-L.txt").read_text()))
    readings = parse_smi_readings((TELEMETRY / "telegraf-a100-sxm4-v12.xml").read_text(), 0.0)
    return attrs.evolve(HEALTHY, gpus=inventory, readings=tuple(readings),
                        engine_user=EngineUserFacts("llmgw-engine", 998, gpu_access=True, gpu_detail="open"))


def topics(report, severity: Severity) -> list[str]:  # type: ignore[no-untyped-def]
    return [f.topic for f in report.findings if f.severity is severity]


def test_a_healthy_cpu_node_passes_and_says_what_it_checked() -> None:
    report = diagnose(HEALTHY)
    assert not report.failed and not serious(report.findings)
    assert topics(report, Severity.OK) == ["cpu", "memory", "disk", "memlock", "engine-user", "engine",
                                           "control-plane", "clock"]
    assert report.findings[0].topic == "gpu" and report.findings[0].severity is Severity.INFO  # no GPUs: a fact
    data = json.loads(json.dumps(report.to_json()))  # plain JSON, facts included
    assert data["ok"] and data["facts"]["cpu_flags"] == ["avx", "avx2", "fma"]


def test_the_recorded_mig_machine_lists_its_instances_by_class() -> None:
    report = diagnose(mig_node())
    [gpu] = [f for f in report.findings if f.topic == "gpu" and f.severity is Severity.OK]
    assert gpu.message.startswith("4 NVIDIA GPU(s) through nvidia-smi, driver 535.54.03, CUDA 12.2, 4 MIG instance(s): "
                                  "0/mig0 a100-80g-mig-1g.20gb, ")
    assert "3 a100-80g" in gpu.message and not report.failed
    assert [u["display"] for u in report.to_json()["facts"]["gpu_units"]][:2] == ["0/mig0", "0/mig1"]


def test_a_card_in_mig_mode_with_nothing_carved_fails_with_the_commands_to_fix_it() -> None:
    inventory = parse_query_xml((SMI / "telegraf-a100-sxm4-80gb-mig.xml").read_text())  # no -L: no instances known
    facts = attrs.evolve(mig_node(), gpus=attrs.evolve(inventory, migs=()))
    report = diagnose(facts)
    first = report.findings[0]
    assert report.failed and first.severity is Severity.FAIL and first.topic == "gpu"
    assert "GPU 0 (NVIDIA A100-SXM4-80GB) is in MIG mode with no instance carved" in first.message
    assert "nvidia-smi mig -i 0 -cgi" in first.fix and "-mig 0" in first.fix


def test_uncorrected_ecc_and_heat_throttling_are_reported_most_serious_first() -> None:
    node = mig_node()
    sick = attrs.evolve(node.readings[0], ecc_uncorrected=3, throttle_reasons=("gpu_idle", "hw_thermal_slowdown"))
    report = diagnose(attrs.evolve(node, readings=(sick,)))
    assert [(f.severity, f.topic) for f in report.findings[:2]] == [(Severity.FAIL, "gpu"), (Severity.WARN, "gpu")]
    assert "GPU 0 has 3 uncorrected ECC error(s)" in report.findings[0].message
    assert report.findings[1].message == "GPU 0 is throttled (hw_thermal_slowdown) at 27 C"


def test_recorded_xid_lines_fail_for_serious_codes_and_warn_for_the_rest() -> None:
    lines = (TELEMETRY / "xid-chia-gigahorse-301-dmesg.log").read_text()
    events = parse_xid_lines(lines)
    report = diagnose(attrs.evolve(mig_node(), xids=tuple(events)))
    xids = [f for f in report.findings if f.topic == "xid"]
    codes = sorted({e.xid for e in events})
    assert len(xids) == len(codes) and all(f"XID {c} x" in " ".join(f.message for f in xids) for c in codes)
    for finding in xids:
        code = int(finding.message.split()[1])
        assert finding.severity is (Severity.FAIL if code in (48, 63, 64, 74, 79, 92, 94, 95, 119, 120) else Severity.WARN)
    assert diagnose(mig_node()).findings[-1].topic != "xid"  # none: OK, listed with the other OKs
    assert [f.severity for f in diagnose(mig_node()).findings if f.topic == "xid"] == [Severity.OK]


def test_a_process_not_of_llmgw_on_a_card_is_named_and_an_engines_own_is_not() -> None:
    node = mig_node()
    gpus = attrs.evolve(node.gpus, processes=(GpuProcess(4242, 1024, 0, 2, "python3"), GpuProcess(77, 2048, 1)))
    report = diagnose(attrs.evolve(node, gpus=gpus, own_gpu_pids=frozenset({77})))
    [foreign] = [f for f in report.findings if "not one of llmgw's engines" in f.message]
    assert foreign.severity is Severity.WARN
    assert foreign.message == "pid 4242 (python3), not one of llmgw's engines, holds 1024 MiB on GPU 0/mig2"


def test_no_avx2_warns_with_the_fix_for_a_virtual_machine() -> None:
    report = diagnose(attrs.evolve(HEALTHY, cpu_flags=frozenset({"sse4_2", "avx"})))
    [cpu] = [f for f in report.findings if f.topic == "cpu"]
    assert cpu.severity is Severity.WARN and "no AVX2" in cpu.message and "host-passthrough" in cpu.fix
    arm = diagnose(attrs.evolve(HEALTHY, arch="aarch64", cpu_flags=frozenset({"asimd", "sve"})))
    assert [f.severity for f in arm.findings if f.topic == "cpu"] == [Severity.OK]


def test_disk_memlock_clock_control_planes_engines_and_the_engines_user() -> None:
    bad = attrs.evolve(
        HEALTHY, disk_free_mb=1024, memlock="65536", clock_synchronized=False,
        control_planes=(ControlPlaneProbe("10.0.0.1:7070", False, "Connection refused"),
                        ControlPlaneProbe("10.0.0.2:7070", True)),
        engines=(EngineProbe("vllm", True, "0.32.0", runs=False, check_output="ImportError: libcuda.so.1"),),
        engine_user=EngineUserFacts("llmgw-engine", problem="the engines' user 'llmgw-engine' does not exist"))
    report = diagnose(bad)
    assert [(f.severity.value, f.topic) for f in serious(report.findings)] == [
        ("fail", "disk"), ("fail", "engine-user"), ("fail", "engine"),
        ("warn", "memlock"), ("warn", "control-plane"), ("warn", "clock")]
    assert "vllm 0.32.0 is installed but does not run: ImportError: libcuda.so.1" in report.findings[2].message
    down = diagnose(attrs.evolve(HEALTHY, control_planes=(ControlPlaneProbe("10.0.0.1:7070", False, "timed out"),)))
    assert down.failed and down.findings[0].message == "no control plane answers: 10.0.0.1:7070: timed out"
    blocked = diagnose(attrs.evolve(mig_node(), engine_user=EngineUserFacts(
        "llmgw-engine", 998, gpu_access=False, gpu_detail="/dev/nvidia0 (0o660, group video)")))
    assert "the engines' user cannot open the GPUs: /dev/nvidia0 (0o660, group video)" in blocked.findings[0].message
    no_python = diagnose(attrs.evolve(HEALTHY, engine_user=EngineUserFacts(
        "llmgw-engine", 998, python_problem="/root/venv/bin/python3 is not readable or executable by it")))
    [finding] = serious(no_python.findings)
    assert finding.message == ("the engines' user cannot run llmgw's Python: /root/venv/bin/python3 is not readable "
                               "or executable by it") and "--release-root" in finding.fix


def test_gather_reads_this_machine(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(f"state_dir: {tmp_path / 'state'}\nengine_user: ''\ncontrol_planes: ['127.0.0.1:1']\n")
    facts = trio.run(lambda: gather(load_agent_config(path), check_engines=False))
    assert facts.cpus == os.cpu_count() and facts.memory_total_mb > 0 and facts.cpu_model
    assert facts.disk_total_mb and facts.disk_free_mb is not None  # the nearest existing directory's disk
    assert facts.engine_user == EngineUserFacts("", os.geteuid())
    [plane] = facts.control_planes
    assert not plane.reachable and "TLS files cannot be used" in plane.detail
    assert any(e.name == "sim" and e.installed for e in facts.engines)
