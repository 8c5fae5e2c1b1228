"""GPUs from NVML (nvidia-ml-py's ``pynvml``), MIG instances and processes included.

:func:`read_nvml` takes the module as a parameter, so tests pass a stand-in. It is
synchronous and quick (NVML asks the driver); callers on the trio loop that call it
often may use ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from llmgw.node.gpus.inventory import GpuCard, GpuInventory, GpuProcess, MigInstance, assemble

logger = logging.getLogger(__name__)

_MB = 1024 * 1024

#: nvmlDeviceGetMigMode's value for "MIG on" (pynvml's NVML_DEVICE_MIG_ENABLE).
_MIG_ENABLE = 1

#: A MIG device's name ends with its profile: "NVIDIA A100-SXM4-80GB MIG 3g.40gb".
_MIG_PROFILE_RE = re.compile(r"\bMIG\s+(\S+)\s*$")


def read_nvml(nvml: Any) -> GpuInventory:
    """Returns this node's GPUs as NVML reports them. Never raises.

    ``nvml`` is the ``pynvml`` module (or a stand-in shaped like it). Where NVML does not
    start (library absent, driver not loaded) the result is empty, its source "", its
    note "NVML is not available (...)"; where it fails while listing (a card fallen off
    the bus) the result is empty with "NVML failed while listing GPUs (...)". On success
    the source is "nvml"; a card in MIG mode is given with its instances, and processes
    are read per card, or per MIG instance on a card in MIG mode.
    """
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return GpuInventory(note=f"NVML is not available ({_reason(exc)})")
    try:
        return _read(nvml)
    except Exception as exc:
        logger.warning("NVML failed while listing GPUs: %s", exc)
        return GpuInventory(note=f"NVML failed while listing GPUs ({_reason(exc)})")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _read(nvml: Any) -> GpuInventory:
    """Returns the inventory from an initialised NVML; raises what NVML raises."""
    cards: list[GpuCard] = []
    migs: list[MigInstance] = []
    processes: list[GpuProcess] = []
    notes: list[str] = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        mig_mode, mig_pending = _mig_mode(nvml, handle)
        cards.append(
            GpuCard(
                index=index,
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                name=_text(nvml.nvmlDeviceGetName(handle)),
                memory_total_mb=int(memory.total) // _MB,
                memory_used_mb=int(memory.used) // _MB,
                memory_free_mb=int(memory.free) // _MB,
                pci_bus_id=_pci_bus_id(nvml, handle),
                mig_mode=mig_mode,
                mig_pending=mig_pending,
            )
        )
        if not mig_mode:
            processes.extend(_processes(nvml, handle, index, None, notes))
            continue
        for number in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig_handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, number)
            except Exception as exc:
                if _is(nvml, exc, "NotFound"):
                    continue  # an empty slot: nothing carved there
                raise
            mig_memory = nvml.nvmlDeviceGetMemoryInfo(mig_handle)
            profile = _MIG_PROFILE_RE.search(_text(nvml.nvmlDeviceGetName(mig_handle)))
            migs.append(
                MigInstance(
                    card=index,
                    number=number,
                    gpu_instance_id=int(nvml.nvmlDeviceGetGpuInstanceId(mig_handle)),
                    compute_instance_id=int(nvml.nvmlDeviceGetComputeInstanceId(mig_handle)),
                    profile=profile[1] if profile else None,
                    uuid=_text(nvml.nvmlDeviceGetUUID(mig_handle)),
                    memory_total_mb=int(mig_memory.total) // _MB,
                    memory_used_mb=int(mig_memory.used) // _MB,
                )
            )
            processes.extend(_processes(nvml, mig_handle, index, number, notes))
    note = "; ".join(notes)
    if not cards:
        note = "no NVIDIA GPUs: the NVIDIA driver reports none"
    return assemble(
        cards,
        migs,
        processes,
        driver_version=_text(nvml.nvmlSystemGetDriverVersion()),
        cuda_version=_cuda_version(nvml),
        source="nvml",
        note=note,
    )


def _mig_mode(nvml: Any, handle: Any) -> tuple[bool, bool | None]:
    """Returns (MIG on now, MIG on after the next reset); (False, None) on a card without MIG."""
    try:
        current, pending = nvml.nvmlDeviceGetMigMode(handle)
    except Exception as exc:
        if _is(nvml, exc, "NotSupported"):
            return False, None
        raise
    return current == _MIG_ENABLE, pending == _MIG_ENABLE


def _processes(nvml: Any, handle: Any, card: int, mig: int | None, notes: list[str]) -> list[GpuProcess]:
    """Returns the compute and graphics processes on ``handle``, one per pid.

    A process listed by both keeps the larger figure. A listing NVML refuses (no
    permission, not supported) is skipped and said in ``notes``; it fails nothing else.
    """
    used: dict[int, int | None] = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            listed = getattr(nvml, getter)(handle)
        except Exception as exc:
            where = str(card) if mig is None else f"{card}/mig{mig}"
            notes.append(f"processes on {where} unreadable ({_reason(exc)})")
            continue
        for info in listed:
            pid = int(info.pid)
            memory = None if info.usedGpuMemory is None else int(info.usedGpuMemory) // _MB
            before = used.get(pid)
            used[pid] = memory if before is None else max(before, memory or 0)
    return [GpuProcess(pid, memory, card, mig, _process_name(nvml, pid)) for pid, memory in used.items()]


def _process_name(nvml: Any, pid: int) -> str | None:
    """Returns the process's name as NVML gives it, None where it cannot."""
    try:
        return _text(nvml.nvmlSystemGetProcessName(pid)) or None
    except Exception:
        return None


def _pci_bus_id(nvml: Any, handle: Any) -> str | None:
    """Returns the card's PCI bus id ("00000000:01:00.0"), None where NVML cannot say."""
    try:
        return _text(nvml.nvmlDeviceGetPciInfo(handle).busId) or None
    except Exception:
        return None


def _cuda_version(nvml: Any) -> str | None:
    """Returns the newest CUDA the driver supports, "12.4" (NVML says 12040); None if unknown."""
    try:
        version = int(nvml.nvmlSystemGetCudaDriverVersion())
    except Exception:
        return None
    return f"{version // 1000}.{version % 1000 // 10}"


def _is(nvml: Any, exc: Exception, kind: str) -> bool:
    """Returns whether ``exc`` is pynvml's NVMLError_<kind> ("NotFound", "NotSupported")."""
    cls = getattr(nvml, f"NVMLError_{kind}", None)
    return isinstance(cls, type) and isinstance(exc, cls)


def _text(value: str | bytes) -> str:
    """Returns NVML's string as str (older bindings return bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _reason(exc: Exception) -> str:
    """Returns the exception in words ("NVML Shared Library Not Found")."""
    return str(exc) or type(exc).__name__
