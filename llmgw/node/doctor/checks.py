"""The judgements of ``llmgw doctor``: pure functions from :class:`NodeFacts` to findings.

Each ``check_*`` returns the findings of one topic (a fact that is fine is an OK finding, so
the report says what was checked). :func:`diagnose` runs them all. Nothing here does I/O:
:mod:`llmgw.node.doctor.gather` reads the machine.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs

from llmgw.jsonable import to_jsonable
from llmgw.node.discovery import VECTOR_EXTENSIONS
from llmgw.node.doctor.report import Finding, Report, Severity
from llmgw.node.gpus.inventory import GpuInventory
from llmgw.node.gpus.telemetry import GpuReading
from llmgw.node.gpus.xid import XidEvent

#: XIDs after which the card cannot be trusted until it is reset or replaced (NVIDIA's XID
#: catalogue): 48 double-bit ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 92 high
#: single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP firmware. Others warn.
SERIOUS_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
#: Below this much free disk where weights go, downloads of a model fail (FAIL) ...
DISK_FAIL_MB = 2 * 1024
#: ... and below this, a large model will not fit (WARN).
DISK_WARN_MB = 20 * 1024
#: Less available memory than this leaves no room for a CPU replica (WARN).
MEMORY_WARN_MB = 2 * 1024
#: Throttle reasons that mean the card is held back by heat or power trouble, not by idling.
HARMFUL_THROTTLES = frozenset({"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"})
#: The fix for a virtual machine whose CPU model hides the host's vector extensions.
HOST_CPU_FIX = ("in a VM, give it the host's CPU model (libvirt: <cpu mode='host-passthrough'/>; QEMU: -cpu host; "
                "Proxmox: CPU type 'host'); otherwise run CPU replicas on a machine with AVX2")


@attrs.frozen
class EngineProbe:
    """An engine as the node has it: installed or not, and whether its check ran (None: not tried)."""

    name: str
    installed: bool
    version: str = ""
    detail: str = ""
    runs: bool | None = None
    check_output: str = ""


@attrs.frozen
class ControlPlaneProbe:
    """One control plane of agent.yaml: whether a TLS session with this node's certificate opened."""

    address: str
    reachable: bool
    detail: str = ""


@attrs.frozen
class EngineUserFacts:
    """The engines' user: its name ("" = the agent's own), uid (None: missing), why it cannot be
    used ("" = it can), whether it can open the NVIDIA device files (None: no GPUs), and why it
    cannot run llmgw's Python ("" = it can, or it is the agent's own user): the simulator,
    engine installs and checks run as ``python -m llmgw...`` as that user."""

    name: str
    uid: int | None = None
    problem: str = ""
    gpu_access: bool | None = None
    gpu_detail: str = ""
    python_problem: str = ""


@attrs.frozen
class NodeFacts:
    """Everything ``llmgw doctor`` read from the machine (see :mod:`llmgw.node.doctor.gather`)."""

    os: str = ""
    kernel: str = ""
    arch: str = ""
    cpu_model: str = ""
    cpu_flags: frozenset[str] = frozenset()
    cpus: int = 0
    memory_total_mb: int = 0
    memory_available_mb: int | None = None
    weights_dir: str = ""
    disk_free_mb: int | None = None
    disk_total_mb: int | None = None
    gpus: GpuInventory = GpuInventory()
    readings: tuple[GpuReading, ...] = ()
    xids: tuple[XidEvent, ...] = ()
    kernel_log_note: str = ""
    own_gpu_pids: frozenset[int] = frozenset()  # GPU processes in the process group of one of llmgw's engines
    memlock: str = ""  # "infinity", a byte count, or "" (unknown)
    memlock_source: str = ""
    engines: tuple[EngineProbe, ...] = ()
    control_planes: tuple[ControlPlaneProbe, ...] = ()
    clock_synchronized: bool | None = None
    clock_detail: str = ""
    engine_user: EngineUserFacts = EngineUserFacts("")
    config_problem: str = ""


def diagnose(facts: NodeFacts) -> Report:
    """Returns the report of every check on ``facts``, most serious first."""
    findings: list[Finding] = []
    for check in (check_config, check_gpus, check_gpu_health, check_xids, check_foreign_processes, check_cpu,
                  check_memory, check_disk, check_memlock, check_engine_user, check_engines, check_control_planes,
                  check_clock):
        findings.extend(check(facts))
    return Report.of(findings, facts_json(facts))


def check_config(facts: NodeFacts) -> list[Finding]:
    if facts.config_problem:
        return [Finding(Severity.FAIL, "config", facts.config_problem,
                        "fix agent.yaml (docs/config.md); the agent refuses to start on it")]
    return []


def check_gpus(facts: NodeFacts) -> list[Finding]:
    inv = facts.gpus
    if not inv.cards:
        return [Finding(Severity.INFO, "gpu", inv.note or "no NVIDIA GPUs: a CPU node")]
    found: list[Finding] = []
    carved = {m.card for m in inv.migs}
    for card in inv.cards:
        if card.mig_mode and card.index not in carved:
            found.append(Finding(Severity.FAIL, "gpu", f"GPU {card.index} ({card.name}) is in MIG mode with no instance "
                                 "carved: nothing can run on it",
                                 f"carve instances (`nvidia-smi mig -i {card.index} -cgi <profiles> -C`) or turn MIG off "
                                 f"(`nvidia-smi -i {card.index} -mig 0`, then reset the card)"))
        if card.mig_pending is not None and card.mig_pending != card.mig_mode:
            found.append(Finding(Severity.WARN, "gpu", f"GPU {card.index} has a MIG mode change pending "
                                 f"({'on' if card.mig_pending else 'off'} after a reset)",
                                 f"reset the card (`nvidia-smi -i {card.index} -r`, nothing may use it) or reboot"))
    units = inv.units()
    migs = [u for u in units if u.index >= 1000]
    versions = f"driver {inv.driver_version or '?'}, CUDA {inv.cuda_version or '?'}"
    summary = ", ".join(f"{u.display} {u.gpu_class}" for u in units) or "none usable"
    found.append(Finding(Severity.OK, "gpu", f"{len(inv.cards)} NVIDIA GPU(s) through {inv.source}, {versions}"
                         + (f", {len(migs)} MIG instance(s)" if migs else "") + f": {summary}"))
    if inv.driver_version is None:
        found.append(Finding(Severity.WARN, "gpu", "the NVIDIA driver version could not be read",
                             "check the driver (`nvidia-smi`); reinstall it if nvidia-smi fails"))
    return found


def check_gpu_health(facts: NodeFacts) -> list[Finding]:
    found: list[Finding] = []
    for r in facts.readings:
        if r.ecc_uncorrected:
            found.append(Finding(Severity.FAIL, "gpu", f"GPU {r.index} has {r.ecc_uncorrected} uncorrected ECC error(s) "
                                 "since the driver loaded: its memory cannot be trusted",
                                 f"drain the node (`llmgw ctl nodes remove` or stop its replicas), reset GPU {r.index} "
                                 "(`nvidia-smi -r`); if errors come back, replace the card"))
        harmful = sorted(HARMFUL_THROTTLES.intersection(r.throttle_reasons or ()))
        if harmful:
            heat = f" at {r.temperature_c} C" if r.temperature_c is not None else ""
            found.append(Finding(Severity.WARN, "gpu", f"GPU {r.index} is throttled ({', '.join(harmful)}){heat}",
                                 "check its cooling and power (fans, airflow, inlet temperature, PSU)"))
    return found


def check_xids(facts: NodeFacts) -> list[Finding]:
    if facts.kernel_log_note and not facts.xids:
        return [Finding(Severity.INFO, "xid", f"the kernel log could not be read for GPU XID errors: {facts.kernel_log_note}",
                        "run doctor as root (the kernel log may be root's)")]
    if not facts.xids:
        return [Finding(Severity.OK, "xid", "no GPU XID errors in the kernel log")] if facts.gpus.cards else []
    found = []
    by_code: dict[int, list[XidEvent]] = {}
    for event in facts.xids:
        by_code.setdefault(event.xid, []).append(event)
    for code, events in sorted(by_code.items()):
        serious = code in SERIOUS_XIDS
        where = ", ".join(sorted({e.pci_address for e in events}))
        found.append(Finding(Severity.FAIL if serious else Severity.WARN, "xid",
                             f"XID {code} x{len(events)} on {where}: {events[-1].message}",
                             "reset the GPU or reboot, and if it comes back, have the card checked (NVIDIA's XID "
                             "catalogue says what each code means)" if serious else
                             "usually an application fault; watch whether it repeats"))
    return found


def check_foreign_processes(facts: NodeFacts) -> list[Finding]:
    found = []
    for proc in facts.gpus.processes:
        if proc.pid in facts.own_gpu_pids:
            continue
        memory = f"{proc.used_memory_mb} MiB" if proc.used_memory_mb is not None else "memory"
        found.append(Finding(Severity.WARN, "gpu", f"pid {proc.pid} ({proc.name or 'unknown'}), not one of llmgw's "
                             f"engines, holds {memory} on GPU {proc.where}",
                             "placement counts that memory as used; stop the process to give it back"))
    return found


def check_cpu(facts: NodeFacts) -> list[Finding]:
    x86 = facts.arch in ("x86_64", "amd64", "i686")
    extensions = sorted(facts.cpu_flags & VECTOR_EXTENSIONS)
    base = f"{facts.cpus} CPUs, {facts.cpu_model or facts.arch}; vector extensions: {', '.join(extensions) or 'none'}"
    if x86 and "avx2" not in facts.cpu_flags:
        return [Finding(Severity.WARN, "cpu", f"{base}: no AVX2, so CPU engines (llama.cpp, vLLM's CPU build) run "
                        "several times slower or not at all", HOST_CPU_FIX)]
    return [Finding(Severity.OK, "cpu", base)]


def check_memory(facts: NodeFacts) -> list[Finding]:
    available = facts.memory_available_mb
    text = f"{facts.memory_total_mb / 1024:.1f} GiB memory" + (
        f", {available / 1024:.1f} GiB available" if available is not None else "")
    if available is not None and available < MEMORY_WARN_MB:
        return [Finding(Severity.WARN, "memory", f"{text}: too little for a CPU replica",
                        "stop what else uses the memory, or give the machine more")]
    return [Finding(Severity.OK, "memory", text)]


def check_disk(facts: NodeFacts) -> list[Finding]:
    free = facts.disk_free_mb
    if free is None:
        return [Finding(Severity.WARN, "disk", f"the weights directory {facts.weights_dir} cannot be read",
                        "create it, or set weights_dir in agent.yaml to a directory on a large disk")]
    text = f"{free / 1024:.1f} GiB free of {(facts.disk_total_mb or 0) / 1024:.1f} GiB where weights go ({facts.weights_dir})"
    fix = "free space there, or set weights_dir in agent.yaml to a larger disk"
    if free < DISK_FAIL_MB:
        return [Finding(Severity.FAIL, "disk", f"{text}: model downloads will fail", fix)]
    if free < DISK_WARN_MB:
        return [Finding(Severity.WARN, "disk", f"{text}: a large model will not fit", fix)]
    return [Finding(Severity.OK, "disk", text)]


def check_memlock(facts: NodeFacts) -> list[Finding]:
    fix = ("install the agent's unit with `llmgw agent join` (or `llmgw service install agent`): it says "
           "LimitMEMLOCK=infinity")
    if not facts.memlock:
        return [Finding(Severity.INFO, "memlock", f"the agent's memlock limit is unknown ({facts.memlock_source})")]
    if facts.memlock != "infinity":
        return [Finding(Severity.WARN, "memlock", f"the agent's memlock limit is {facts.memlock} bytes "
                        f"({facts.memlock_source}): engines cannot pin KV cache and weights", fix)]
    return [Finding(Severity.OK, "memlock", f"the agent's memlock limit is unlimited ({facts.memlock_source})")]


def check_engine_user(facts: NodeFacts) -> list[Finding]:
    user = facts.engine_user
    if user.problem:
        return [Finding(Severity.FAIL, "engine-user", user.problem)]
    who = f"{user.name} (uid {user.uid})" if user.name else "the agent's own user"
    found = [Finding(Severity.OK, "engine-user", f"engines run as {who}")]
    if user.python_problem:
        found.append(Finding(Severity.FAIL, "engine-user", f"the engines' user cannot run llmgw's Python: "
                             f"{user.python_problem}", "install llmgw where other users can read it (`llmgw agent "
                             "join --release-root /opt/llmgw` lays it out so), or set engine_user: \"\" in agent.yaml"))
    if user.gpu_access is False:
        found.append(Finding(Severity.FAIL, "engine-user", f"the engines' user cannot open the GPUs: {user.gpu_detail}",
                             f"add {user.name or 'it'} to the group of /dev/nvidia* (or have the driver make them "
                             "group-owned, e.g. NVreg_DeviceFileGID)"))
    elif user.gpu_access:
        found.append(Finding(Severity.OK, "engine-user", f"the engines' user can open the GPUs ({user.gpu_detail})"))
    return found


def check_engines(facts: NodeFacts) -> list[Finding]:
    found = []
    for engine in facts.engines:
        if not engine.installed:
            found.append(Finding(Severity.INFO, "engine", f"{engine.name}: not installed"
                                 + (f" ({engine.detail})" if engine.detail else "")))
        elif engine.runs is False:
            found.append(Finding(Severity.FAIL, "engine", f"{engine.name} {engine.version} is installed but does not "
                                 f"run: {engine.check_output}",
                                 f"see `llmgw ctl engine-check NODE {engine.name}`; reinstall it by removing its "
                                 "directory (the agent installs it again)"))
        else:
            ran = f": {engine.check_output}" if engine.runs else " (not run: --no-engine-checks)"
            found.append(Finding(Severity.OK, "engine", f"{engine.name} {engine.version}{ran}"))
    return found


def check_control_planes(facts: NodeFacts) -> list[Finding]:
    planes = facts.control_planes
    if not planes:
        return []
    down = [p for p in planes if not p.reachable]
    fix = "check the address in agent.yaml, the network and the control plane's firewall; `llmgw service status` there"
    if len(down) == len(planes):
        return [Finding(Severity.FAIL, "control-plane", "no control plane answers: "
                        + "; ".join(f"{p.address}: {p.detail}" for p in down), fix)]
    found = [Finding(Severity.WARN, "control-plane", f"{p.address} does not answer: {p.detail}", fix) for p in down]
    up = [p.address for p in planes if p.reachable]
    found.append(Finding(Severity.OK, "control-plane", f"reachable with this node's certificate: {', '.join(up)}"))
    return found


def check_clock(facts: NodeFacts) -> list[Finding]:
    if facts.clock_synchronized is None:
        return [Finding(Severity.INFO, "clock", f"whether the clock is synchronised is unknown ({facts.clock_detail})")]
    if not facts.clock_synchronized:
        return [Finding(Severity.WARN, "clock", "the clock is not synchronised (NTP): certificates, leases and "
                        "timestamps need the right time", "enable time sync (`timedatectl set-ntp true`, or chrony)")]
    return [Finding(Severity.OK, "clock", "the clock is synchronised (NTP)")]


def facts_json(facts: NodeFacts) -> dict[str, Any]:
    """Returns ``facts`` as plain JSON data (``llmgw doctor --json``), with the GPU units placement sees."""
    data: dict[str, Any] = to_jsonable(facts)
    data["gpu_units"] = [to_jsonable(u) | {"display": u.display} for u in facts.gpus.units()]
    return data


def serious(findings: Iterable[Finding]) -> list[Finding]:
    """Returns the findings that are FAIL or WARN, most serious first (what join prints)."""
    return [f for f in findings if f.severity in (Severity.FAIL, Severity.WARN)]
