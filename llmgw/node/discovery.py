"""What this node is and has: its id, its address toward the control plane, its hardware.

Everything here is synchronous and quick (psutil reads /proc, NVML asks the driver, or
``nvidia-smi`` where NVML cannot load: llmgw/node/gpus/); callers on the trio loop use
``trio.to_thread.run_sync``. :func:`read_hardware` never raises: no GPUs found gives
none and says why in ``Hardware.gpu_note``.
"""

from __future__ import annotations

import functools
import logging
import platform
import re
import socket
from pathlib import Path
from typing import Any, Callable

import psutil

from llmgw.node.gpus.discover import read_gpu_inventory
from llmgw.node.gpus.inventory import GpuInventory
from llmgw.spec import MIG_CARD_STRIDE, MIG_INDEX_BASE, GpuInfo, Hardware, is_mig

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


#: The CPU flags that say which vector extensions engines can use (x86 and Arm spellings).
VECTOR_EXTENSIONS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni",
                               "amx_bf16", "amx_int8", "asimd", "asimdhp", "sve", "sve2"})


def read_hardware(read_inventory: Callable[[], GpuInventory] = read_gpu_inventory) -> Hardware:
    """Returns this node's CPUs, memory (total and available now), GPUs (whole cards and MIG
    instances, from NVML or nvidia-smi through ``read_inventory``), driver and CUDA versions,
    OS, architecture and CPU vector extensions. Never raises: without GPUs, ``gpu_note`` says why.
    """
    memory = psutil.virtual_memory()
    inventory = read_inventory()
    gpus, note = gpus_of(inventory)
    return Hardware(
        cpu_count=psutil.cpu_count(logical=True) or 1,
        memory_total_mb=memory.total // _MB,
        memory_available_mb=memory.available // _MB,
        gpus=gpus,
        gpu_note=note,
        driver_version=inventory.driver_version or "",
        cuda_version=inventory.cuda_version or "",
        **_platform(),
    )


@functools.cache
def _platform() -> dict[str, Any]:
    """What cannot change while the agent runs (OS, architecture, vector extensions): read once,
    not every heartbeat."""
    return {"os": os_name(), "arch": platform.machine(), "cpu_flags": tuple(sorted(cpu_flags() & VECTOR_EXTENSIONS))}


def read_gpus() -> tuple[tuple[GpuInfo, ...], str]:
    """Returns (GPUs by placement index, note) as :func:`gpus_of` gives them for this node. Never raises."""
    return gpus_of(read_gpu_inventory())


def gpus_of(inventory: GpuInventory) -> tuple[tuple[GpuInfo, ...], str]:
    """Returns what placement may use of ``inventory``: every whole card not in MIG mode and every
    MIG instance (index 1000 + 100 x card + n, its MIG UUID and class), and the note ("" when
    all is well; "no GPUs: ..." when there is nothing; else what cannot be used and why)."""
    names = {card.index: card.name for card in inventory.cards}
    gpus = []
    for unit in inventory.units():
        total = unit.memory_total_mb or 0
        used = unit.memory_used_mb or 0
        if is_mig(unit.index):
            card = (unit.index - MIG_INDEX_BASE) // MIG_CARD_STRIDE
            name = f"{names.get(card, 'GPU')} MIG {unit.gpu_class.rsplit('-mig-', 1)[-1]}"
        else:
            name = names.get(unit.index, "GPU")
        gpus.append(GpuInfo(unit.index, unit.uuid or "", name, total, max(0, total - used), unit.gpu_class))
    if gpus:
        return tuple(gpus), inventory.note if inventory.cards and _unusable(inventory) else ""
    if inventory.cards:  # cards, but nothing to place on (MIG mode with nothing carved)
        return (), f"no GPUs: {inventory.note}"
    note = inventory.note or "the NVIDIA driver reports none"
    return (), note if note.startswith("no ") else f"no GPUs: {note}"


def _unusable(inventory: GpuInventory) -> bool:
    """Whether a card of ``inventory`` is in MIG mode with nothing carved (the note says which)."""
    carved = {m.card for m in inventory.migs}
    return any(c.mig_mode and c.index not in carved for c in inventory.cards)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """Returns the first CPU's flags (x86 ``flags``, Arm ``Features``); empty where unreadable."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    match = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.M)
    return frozenset(match.group(1).split()) if match else frozenset()


def os_name(os_release: Path = Path("/etc/os-release")) -> str:
    """Returns the OS's name as /etc/os-release prints it ("Debian GNU/Linux 12 (bookworm)")."""
    try:
        match = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', os_release.read_text(errors="replace"), re.M)
    except OSError:
        match = None
    return match.group(1) if match else platform.system()
