"""What a shard computes on: the engine-independent half of reading engine output.

Each engine adapter turns its own startup output into a :class:`~llmgw.spec.Compute`
(``Engine.parse_output(lines) -> Compute | None``) and says whether a shard that was
given GPUs actually got them (``Engine.gpu_failure(compute, spec) -> str | None``,
in the engine's own words). This module holds what every engine shares:

- :class:`OutputCollector`: the lines one engine run printed until READY (bounded);
- :func:`resolve_compute`: the engine's own account, else nvidia-smi (the GPUs the
  shard's processes hold memory on), else CPU;
- :func:`nvidia_smi_compute`: that nvidia-smi lookup;
- small parsing helpers (:func:`parse_mib`).

Nothing here raises for odd output: unparsable lines are skipped; a failing or missing
nvidia-smi means "not known from nvidia-smi".
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from typing import Callable, Iterable, Sequence

import psutil

from llmgw.node.gpus.discover import read_gpu_inventory
from llmgw.node.gpus.inventory import GpuInventory, placement_index
from llmgw.spec import Compute, ComputeDevice, ShardSpec, gpu_display

logger = logging.getLogger(__name__)

__all__ = [
    "COLLECT_MAX_LINES",
    "NVIDIA_SMI_TIMEOUT",
    "OutputCollector",
    "cpu_compute",
    "nvidia_smi_compute",
    "parse_mib",
    "process_tree_pids",
    "resolve_compute",
]

# Lines kept from one engine run until READY. llama.cpp at -lv 4 prints a few hundred
# lines while loading (more with many layers at -lv 5); a bounded list keeps a chatty
# engine from growing the agent's memory without limit. The first lines are the ones
# that name devices, so the list keeps the FIRST lines and drops later ones.
COLLECT_MAX_LINES = 20_000

# nvidia-smi answers in well under a second on a healthy node; a hung driver must not
# hold up a READY report for long.
NVIDIA_SMI_TIMEOUT = 10.0

# "12.50 MiB", "0.40", "1.2 GiB" -> MiB
_SIZE = re.compile(r"(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]i?B)?", re.IGNORECASE)
_UNIT_TO_MIB = {"k": 1 / 1024, "m": 1.0, "g": 1024.0, "t": 1024.0 * 1024.0}


def parse_mib(text: str) -> float | None:
    """Returns the first size in ``text`` in MiB (no unit = MiB), or None if there is none."""
    match = _SIZE.search(text)
    if match is None:
        return None
    value = float(match.group("value"))
    unit = (match.group("unit") or "MiB")[0].lower()
    return value * _UNIT_TO_MIB.get(unit, 1.0)


class OutputCollector:
    """Keeps the first :data:`COLLECT_MAX_LINES` lines an engine run prints, until READY.

    Use :meth:`add` as an output-line callback; :meth:`reset` at each new run;
    :meth:`close` at READY (later lines are request logs, not startup facts).
    """

    def __init__(self, max_lines: int = COLLECT_MAX_LINES) -> None:
        self.max_lines = max_lines
        self.lines: list[str] = []
        self.closed = False

    def reset(self) -> None:
        """Forgets what was collected and starts collecting again (a new engine run)."""
        self.lines = []
        self.closed = False

    def add(self, line: str) -> None:
        """Keeps ``line`` unless collection is closed or full."""
        if not self.closed and len(self.lines) < self.max_lines:
            self.lines.append(line)

    def close(self) -> list[str]:
        """Stops collecting; returns the lines collected."""
        self.closed = True
        return self.lines


def cpu_compute(threads: int = 0, source: str = "default") -> Compute:
    """Returns the Compute of a shard nothing else is known about: the CPU."""
    return Compute(backend="CPU", devices=(ComputeDevice("CPU"),), threads=threads, source=source)


def process_tree_pids(pid: int) -> set[int]:
    """Returns ``pid`` and its descendants' pids (empty if ``pid`` is gone). Blocks briefly (psutil)."""
    try:
        root = psutil.Process(pid)
        return {pid, *(child.pid for child in root.children(recursive=True))}
    except psutil.Error:
        return set()


Runner = Callable[[Sequence[str]], str]


def _run_nvidia_smi(args: Sequence[str]) -> str:
    """Returns nvidia-smi's stdout for ``args``; raises OSError/subprocess errors on failure."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise FileNotFoundError("nvidia-smi is not on PATH")
    done = subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT, check=True
    )
    return done.stdout


def _csv_rows(text: str) -> Iterable[list[str]]:
    for line in text.splitlines():
        if line.strip():
            yield [field.strip() for field in line.split(",")]


def nvidia_smi_compute(pids: set[int], run: Runner = _run_nvidia_smi) -> Compute | None:
    """Returns the GPUs ``pids`` hold memory on, per nvidia-smi, or None if none/unknown.

    Blocks (runs nvidia-smi twice, each bounded by :data:`NVIDIA_SMI_TIMEOUT`): call it
    in a thread. ``run`` is injectable for tests. Any nvidia-smi failure returns None
    (logged at debug): this is a fallback, never a reason to fail a shard.
    """
    if not pids:
        return None
    try:
        apps = run(["--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"])
        gpus = run(["--query-gpu=index,uuid,name,memory.total,memory.free", "--format=csv,noheader,nounits"])
    except (OSError, subprocess.SubprocessError) as exc:
        logger.debug("nvidia-smi is not usable for the compute fallback: %s", exc)
        return None
    used: dict[str, float] = {}
    for row in _csv_rows(apps):
        if len(row) < 3 or not row[0].isdigit() or int(row[0]) not in pids:
            continue
        used[row[1]] = used.get(row[1], 0.0) + (parse_mib(row[2]) or 0.0)
    if not used:
        return None
    devices = []
    for row in _csv_rows(gpus):
        if len(row) < 5 or row[1] not in used:
            continue
        total, free = parse_mib(row[3]), parse_mib(row[4])
        devices.append(ComputeDevice(f"GPU{row[0]}", row[2], int(total or 0), int(free or 0)))
    if not devices:
        return None
    return Compute(
        backend="CUDA",
        devices=tuple(devices),
        source="nvidia-smi",
        notes=tuple(f"{uuid} holds {mib:.0f} MiB" for uuid, mib in sorted(used.items())),
    )


def resolve_compute(
    parsed: Compute | None,
    spec: ShardSpec,
    engine_pid: int,
    *,
    nvidia_smi: Callable[[set[int]], Compute | None] = nvidia_smi_compute,
) -> Compute:
    """Returns the shard's compute: ``parsed`` (the engine's own account) if any, else
    nvidia-smi's view of the engine's process tree (only for shards given GPUs), else CPU.

    Blocks (psutil, nvidia-smi): call it in a thread.
    """
    if parsed is not None:
        return parsed
    if spec.gpus:
        found = nvidia_smi(process_tree_pids(engine_pid))
        if found is not None:
            return found
    return cpu_compute()


def engine_compute(engine: object, lines: list[str]) -> Compute | None:
    """Returns ``engine.parse_output(lines)``, or None if the adapter has no parser or it fails (logged)."""
    parse = getattr(engine, "parse_output", None)
    if parse is None:
        return None
    try:
        return parse(lines)
    except Exception:  # a parser bug must not fail a healthy shard
        logger.exception("the %s output parser failed; compute falls back to nvidia-smi/CPU", getattr(engine, "name", "?"))
        return None


def engine_gpu_failure(engine: object, compute: Compute | None, spec: ShardSpec) -> str | None:
    """Returns ``engine.gpu_failure(compute, spec)``, or None if the adapter has no such check."""
    check = getattr(engine, "gpu_failure", None)
    return None if check is None else check(compute, spec)


def unused_gpus(
    engine: object, spec: ShardSpec, engine_group: int, read_inventory: Callable[[], GpuInventory] = read_gpu_inventory,
) -> str | None:
    """Returns why a shard given GPUs is not ready: the GPUs (placement indexes, MIG instances
    included) on which no process of the engine's process group holds memory, in words; None
    when each holds some, and when the node cannot tell: no NVML nor nvidia-smi, an engine that
    holds no GPU memory by design (``holds_gpu_memory = False``: the simulator), or process
    lists whose pids are all foreign to this PID namespace (an agent in a container).

    Blocks (NVML or nvidia-smi): call it in a thread.
    """
    if not spec.gpus or not getattr(engine, "holds_gpu_memory", True):
        return None
    inventory = read_inventory()
    if not inventory.source or not inventory.processes:
        return None
    held: set[int] = set()
    visible = False
    for process in inventory.processes:
        try:
            group = os.getpgid(process.pid)
        except OSError:
            continue
        visible = True
        if group == engine_group:
            held.add(process.card if process.mig is None else placement_index(process.card, process.mig))
    if not visible:
        return None
    missing = [gpu for gpu in spec.gpus if gpu not in held]
    if not missing:
        return None
    names = ", ".join(gpu_display(gpu) for gpu in missing)
    return (f"the engine answers but holds no memory on GPU {names} it was given ({inventory.source} lists its "
            "processes on none of them): it would compute on the CPU or elsewhere; see its output "
            "(`llmgw ctl logs REPLICA`)")


def compute_to_json(c: Compute | None) -> dict | None:
    """Returns a JSON-ready dict of ``c`` (None stays None), for the shard's state on disk."""
    if c is None:
        return None
    return {
        "backend": c.backend,
        "devices": [[d.name, d.description, d.memory_total_mb, d.memory_free_mb] for d in c.devices],
        "model_buffer_mb": c.model_buffer_mb,
        "kv_buffer_mb": c.kv_buffer_mb,
        "layers_offloaded": c.layers_offloaded,
        "layers_total": c.layers_total,
        "threads": c.threads,
        "source": c.source,
        "notes": list(c.notes),
    }


def compute_from_json(data: dict | None) -> Compute | None:
    """Returns the Compute of :func:`compute_to_json`'s dict; raises ValueError/KeyError/TypeError if malformed."""
    if data is None:
        return None
    return Compute(
        backend=str(data["backend"]),
        devices=tuple(ComputeDevice(str(n), str(d), int(t), int(f)) for n, d, t, f in data["devices"]),
        model_buffer_mb=float(data["model_buffer_mb"]),
        kv_buffer_mb=float(data["kv_buffer_mb"]),
        layers_offloaded=int(data["layers_offloaded"]),
        layers_total=int(data["layers_total"]),
        threads=int(data["threads"]),
        source=str(data["source"]),
        notes=tuple(str(n) for n in data["notes"]),
    )
