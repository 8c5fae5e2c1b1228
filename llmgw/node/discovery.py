"""What this node is and has: its id, its address toward the control plane, its hardware.

Everything here is synchronous and quick (psutil reads /proc, NVML asks the driver);
callers on the trio loop that call it often may use ``trio.to_thread.run_sync``.
:func:`read_hardware` never raises: a missing or broken NVML gives no GPUs and says why
in ``Hardware.gpu_note``.
"""

from __future__ import annotations

import importlib
import logging
import socket
from typing import Any

import psutil

from llmgw.spec import GpuInfo, Hardware

logger = logging.getLogger(__name__)

_MB = 1024 * 1024

# Any port will do for route_address: connecting a UDP socket sends nothing, it only
# makes the kernel choose the route (and so the local address) toward the host.
_ROUTE_PROBE_PORT = 9


def node_id() -> str:
    """Returns this node's id: its host name (without the domain part, as systemd shows it)."""
    return socket.gethostname().split(".", 1)[0] or "localhost"


def route_address(control_plane_host: str, port: int = _ROUTE_PROBE_PORT) -> str:
    """Returns the local IP address the kernel would use to reach ``control_plane_host``.

    No packet is sent (a UDP socket is connected, then asked for its own address).
    Resolves the host name, which may block on DNS. Raises OSError, with advice, if the
    host does not resolve or no route leads to it.
    """
    try:
        infos = socket.getaddrinfo(control_plane_host, port, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise OSError(
            f"cannot resolve the control plane host {control_plane_host!r} ({exc}); "
            "check its name in the agent's configuration or give the node's address explicitly"
        ) from exc
    last: OSError | None = None
    for family, type_, proto, _canon, sockaddr in infos:
        try:
            with socket.socket(family, type_, proto) as sock:
                sock.connect(sockaddr)
                return str(sock.getsockname()[0])
        except OSError as exc:
            last = exc
    raise OSError(
        f"no route from this node to the control plane host {control_plane_host!r} ({last}); "
        "check the network or give the node's address explicitly"
    )


def read_hardware() -> Hardware:
    """Returns this node's CPUs, memory (total and available now) and GPUs. Never raises.

    GPUs come from NVML (the nvidia-ml-py ``pynvml`` module); where it is missing or
    fails the result has no GPUs and ``gpu_note`` says why ("no GPUs: ...").
    """
    memory = psutil.virtual_memory()
    gpus, note = read_gpus()
    return Hardware(
        cpu_count=psutil.cpu_count(logical=True) or 1,
        memory_total_mb=memory.total // _MB,
        memory_available_mb=memory.available // _MB,
        gpus=gpus,
        gpu_note=note,
    )


def read_gpus() -> tuple[tuple[GpuInfo, ...], str]:
    """Returns (GPUs by index, note). The note is "" when NVML answered, else says why not.

    Never raises: any NVML failure (library absent, driver not loaded, a GPU that fell
    off the bus) becomes "no GPUs: <reason>".
    """
    try:
        nvml: Any = importlib.import_module("pynvml")
    except ImportError:
        return (), "no GPUs: the NVML Python bindings (nvidia-ml-py) are not installed"
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return (), f"no GPUs: NVML is not available ({_nvml_reason(exc)}); is the NVIDIA driver installed?"
    try:
        count = nvml.nvmlDeviceGetCount()
        gpus = []
        for index in range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_total_mb=int(memory.total) // _MB,
                    memory_free_mb=int(memory.free) // _MB,
                )
            )
    except Exception as exc:
        logger.warning("NVML failed while listing GPUs: %s", exc)
        return (), f"no GPUs: NVML failed while listing them ({_nvml_reason(exc)})"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    if not gpus:
        return (), "no GPUs: the NVIDIA driver reports none"
    return tuple(gpus), ""


def _text(value: str | bytes) -> str:
    """Returns NVML's string as str (older bindings return bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_reason(exc: Exception) -> str:
    """Returns the exception in words ("NVML Shared Library Not Found")."""
    return str(exc) or type(exc).__name__
