"""What ``llmgw doctor`` reads from the machine: :func:`gather` returns :class:`NodeFacts`.

Every reader here is bounded (commands and connections have deadlines) and never raises for
what it finds missing: an unreadable fact is recorded as unknown, and the checks say so. It
changes nothing on the machine. Cancellation stops it at the next checkpoint.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import trio

from llmgw.config import AgentConfig
from llmgw.node import engine_user, markers
from llmgw.node.discovery import cpu_flags, os_name
from llmgw.node.engines import llmgw_pythonpath
from llmgw.node.doctor.checks import ControlPlaneProbe, EngineProbe, EngineUserFacts, NodeFacts
from llmgw.node.gpus.discover import import_pynvml, read_gpu_inventory
from llmgw.node.gpus.inventory import GpuInventory
from llmgw.node.gpus.nvsmi import NVIDIA_SMI_TIMEOUT_S, run_nvidia_smi
from llmgw.node.gpus.telemetry import GpuReading, parse_smi_readings, read_nvml_readings
from llmgw.node.gpus.xid import parse_xid_lines, read_kernel_log
from llmgw.node.telemetry.procfs import read_memory
from llmgw.node.weights import disk_usage

#: Seconds a control plane gets to complete a TLS handshake with this node's certificate.
CONNECT_TIMEOUT_S = 5.0
#: Seconds one engine's check (its import and device probe) may take: vLLM imports torch.
ENGINE_CHECK_TIMEOUT_S = 180.0
#: Seconds a systemctl/timedatectl query may take.
COMMAND_TIMEOUT_S = 10.0
#: systemd prints this for an unlimited resource limit.
SYSTEMD_INFINITY = str(2**64 - 1)
AGENT_UNIT = "llmgw-agent.service"
_MB = 1024 * 1024


async def gather(config: AgentConfig, *, config_problem: str = "", check_engines: bool = True,
                 progress: Callable[[str], None] = lambda _: None) -> NodeFacts:
    """Returns what this machine is and has, as the agent configured by ``config`` sees it.

    ``check_engines`` runs each installed engine's check (slow: vLLM imports torch);
    ``progress`` is told each step in words. Never raises for the machine's state.
    """
    progress("reading the hardware")
    facts = await trio.to_thread.run_sync(_machine, config)
    progress("probing the engines" + (" and running their checks" if check_engines else ""))
    engines = await _engines(config, bool(facts["gpus"].cards), check_engines, progress)
    progress("reaching the control planes")
    planes = await trio.to_thread.run_sync(_control_planes, config)
    return NodeFacts(engines=engines, control_planes=planes, config_problem=config_problem, **facts)


def _machine(config: AgentConfig) -> dict[str, object]:
    """Blocking: every fact that is a file or a quick command."""
    inventory = read_gpu_inventory()
    lines, log_note = read_kernel_log(since_s=_uptime_s())
    cpuinfo = _read("/proc/cpuinfo")
    memory = _memory()
    free_mb, total_mb = _disk(config.weights_dir)
    memlock, memlock_source = _memlock()
    synchronized, clock_detail = _clock()
    return {
        "os": os_name(), "kernel": platform.release(), "arch": platform.machine(),
        "cpu_model": _cpu_model(cpuinfo), "cpu_flags": cpu_flags(), "cpus": os.cpu_count() or 0,
        "memory_total_mb": memory[0], "memory_available_mb": memory[1],
        "weights_dir": str(config.weights_dir), "disk_free_mb": free_mb, "disk_total_mb": total_mb,
        "gpus": inventory, "readings": tuple(_readings(inventory)),
        "xids": tuple(parse_xid_lines(lines)), "kernel_log_note": log_note,
        "own_gpu_pids": _own_gpu_pids(config, inventory),
        "memlock": memlock, "memlock_source": memlock_source,
        "clock_synchronized": synchronized, "clock_detail": clock_detail,
        "engine_user": _engine_user(config, bool(inventory.cards)),
    }


def _disk(weights_dir: Path) -> tuple[int | None, int | None]:
    """Free and total MB of the file system weights go to (the nearest existing directory up
    from ``weights_dir``: the agent creates it at start); (None, None) where none can be read."""
    for path in (weights_dir, *weights_dir.parents):
        if path.exists():
            free_mb, total_mb = disk_usage(path)
            return (free_mb, total_mb) if total_mb else (None, None)
    return None, None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _uptime_s() -> float:
    try:
        return float(_read("/proc/uptime").split()[0])
    except (IndexError, ValueError):
        return 24 * 3600.0


def _cpu_model(cpuinfo: str) -> str:
    match = re.search(r"^(?:model name|Model|cpu model)\s*:\s*(.+)$", cpuinfo, re.M)
    return match.group(1).strip() if match else ""


def _memory() -> tuple[int, int | None]:
    try:
        reading = read_memory()
    except (OSError, ValueError):
        return 0, None
    return reading.total // _MB, None if reading.available is None else reading.available // _MB


def _readings(inventory: GpuInventory) -> list[GpuReading]:
    """The cards' health readings, from the source the inventory came from ([] without GPUs)."""
    now = time.time()
    if inventory.source == "nvml":
        try:
            nvml = import_pynvml()
            nvml.nvmlInit()
        except Exception:  # noqa: BLE001 - NVML answered a moment ago; without it there are no readings
            return []
        try:
            return read_nvml_readings(nvml, now)
        except Exception:  # noqa: BLE001
            return []
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
    if inventory.source == "nvidia-smi":
        try:
            return parse_smi_readings(run_nvidia_smi(["nvidia-smi", "-q", "-x"], NVIDIA_SMI_TIMEOUT_S), now)
        except (OSError, ValueError, subprocess.SubprocessError):
            return []
    return []


def _own_gpu_pids(config: AgentConfig, inventory: GpuInventory) -> frozenset[int]:
    """The GPU processes that belong to llmgw's engines (in the process group of a marked engine)."""
    if not inventory.processes:
        return frozenset()
    engines = {m.identity.pid for m in markers.find_marked(config.state_dir / "shards")}
    own = set()
    for proc in inventory.processes:
        try:
            if os.getpgid(proc.pid) in engines:
                own.add(proc.pid)
        except OSError:
            continue
    return frozenset(own)


def _memlock() -> tuple[str, str]:
    """The agent unit's memlock limit ("infinity", bytes, or "") and where it was read."""
    if shutil.which("systemctl"):
        out = _command(["systemctl", "show", "-p", "LimitMEMLOCK", "--value", AGENT_UNIT])
        if out and out != "0":
            return ("infinity" if out in ("infinity", SYSTEMD_INFINITY) else out), f"systemd, {AGENT_UNIT}"
    for unit_dir in ("/etc/systemd/system", "/lib/systemd/system"):
        match = re.search(r"^LimitMEMLOCK=(\S+)", _read(f"{unit_dir}/{AGENT_UNIT}"), re.M)
        if match:
            return match.group(1), f"{unit_dir}/{AGENT_UNIT}"
    return "", f"no {AGENT_UNIT} installed"


def _clock() -> tuple[bool | None, str]:
    if not shutil.which("timedatectl"):
        return None, "timedatectl is not installed"
    out = _command(["timedatectl", "show", "-p", "NTPSynchronized", "--value"])
    if out in ("yes", "no"):
        return out == "yes", "timedatectl"
    return None, "timedatectl did not say (no systemd running?)"


def _command(argv: list[str]) -> str:
    """Returns what ``argv`` printed (stripped), "" when it failed or took too long."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _engine_user(config: AgentConfig, has_gpus: bool) -> EngineUserFacts:
    """Who engines run as on this node, and whether that user can open the NVIDIA device files."""
    name = engine_user.wanted_user(config.engine_user)
    try:
        user = engine_user.resolve(name)
    except engine_user.EngineUserError as exc:
        return EngineUserFacts(name, problem=str(exc))
    if user is None:
        return EngineUserFacts("", os.geteuid())
    python_problem = _python_problem(user)
    if not has_gpus:
        return EngineUserFacts(name, user.uid, python_problem=python_problem)
    blocked = []
    for device in sorted(Path("/dev").glob(engine_user.GPU_DEVICE_GLOB)):
        try:
            st = device.stat()
        except OSError:
            continue
        others = st.st_mode & 0o006 == 0o006
        group = st.st_mode & 0o060 == 0o060 and st.st_gid in user.groups
        if not (others or group or st.st_uid == user.uid):
            blocked.append(f"{device} ({oct(st.st_mode & 0o777)}, group {engine_user.group_name(st.st_gid)})")
    if blocked:
        return EngineUserFacts(name, user.uid, gpu_access=False, gpu_detail=", ".join(blocked),
                               python_problem=python_problem)
    return EngineUserFacts(name, user.uid, gpu_access=True, gpu_detail="/dev/nvidia* are open to it",
                           python_problem=python_problem)


def _python_problem(user: engine_user.EngineUser) -> str:
    """Why ``user`` cannot import llmgw with this Python ("" when it can), tried as that user
    the way the agent starts the simulator and installs."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": llmgw_pythonpath()}
    try:
        done = subprocess.run([sys.executable, "-c", "import llmgw"], capture_output=True, text=True, env=env, cwd="/",
                              timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL,
                              **engine_user.popen_identity(user))
    except PermissionError:
        return f"{sys.executable} is not readable or executable by it"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{sys.executable} could not be started as it: {exc}"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return f"`{sys.executable} -c 'import llmgw'` failed: {lines[-1] if lines else done.returncode}"
    return ""


async def _engines(config: AgentConfig, has_gpus: bool, check: bool,
                   progress: Callable[[str], None]) -> tuple[EngineProbe, ...]:
    from llmgw.node.install import InstallError, InstallSettings, build_installers
    from llmgw.node.install.as_user import as_engine_user

    settings = InstallSettings(install_dir=config.install_dir, cache_dir=config.cache_dir,
                               url_templates=config.engine_urls, pypi_index=config.pypi_index,
                               has_nvidia_gpu=has_gpus, engine_paths=config.engine_paths)
    # Checks run engines: as the engines' user, as the agent runs them (llmgw/node/install/as_user.py).
    installers = as_engine_user(build_installers(settings), settings, engine_user.wanted_user(config.engine_user),
                                config.state_dir / engine_user.ENGINE_HOME_DIR)
    probes = []
    for name, installer in sorted(installers.items()):
        if name in config.disabled_engines:
            probes.append(EngineProbe(name, False, detail="disabled in agent.yaml"))
            continue
        try:
            info = await installer.probe()
        except Exception as exc:  # noqa: BLE001 - a broken probe is a finding, not a crash
            probes.append(EngineProbe(name, False, detail=f"its probe failed: {exc}"))
            continue
        probe = EngineProbe(name, info.installed, info.version, info.detail)
        if info.installed and check:
            progress(f"running {name}'s check")
            try:
                with trio.fail_after(ENGINE_CHECK_TIMEOUT_S):
                    output = await installer.check()
                probe = EngineProbe(name, True, info.version, info.detail, True, output.strip().splitlines()[-1]
                                    if output.strip() else "")
            except trio.TooSlowError:
                probe = EngineProbe(name, True, info.version, info.detail, False,
                                    f"its check took longer than {ENGINE_CHECK_TIMEOUT_S:g}s")
            except InstallError as exc:
                probe = EngineProbe(name, True, info.version, info.detail, False, str(exc))
        probes.append(probe)
    return tuple(probes)


def _control_planes(config: AgentConfig) -> tuple[ControlPlaneProbe, ...]:
    """Opens a TLS session to each control plane with this node's certificate (no RPC is made)."""
    from llmgw.rpc.tls import TLSFileError, client_ssl_context, read_credentials

    try:
        creds = read_credentials(config.tls.ca, config.tls.cert, config.tls.key)
        context = client_ssl_context(creds.ca_pem, creds.cert_pem, creds.key_pem)
    except (TLSFileError, OSError) as exc:
        return tuple(ControlPlaneProbe(str(a), False, f"this node's TLS files cannot be used: {exc}")
                     for a in config.control_planes)
    probes = []
    for address in config.control_planes:
        try:
            with socket.create_connection((address.host, address.port), timeout=CONNECT_TIMEOUT_S) as raw:
                with context.wrap_socket(raw, server_hostname=address.host):
                    probes.append(ControlPlaneProbe(str(address), True, "TLS with this node's certificate"))
        except ssl.SSLError as exc:
            probes.append(ControlPlaneProbe(str(address), False, f"TLS refused: {exc.reason or exc}"))
        except OSError as exc:
            probes.append(ControlPlaneProbe(str(address), False, exc.strerror or str(exc)))
    return tuple(probes)
