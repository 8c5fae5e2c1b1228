"""Plain values shared by the control plane, the agent and the wire layer.

These attrs classes are what llmgw's own code passes around; ``llmgw.rpc.convert``
turns them into Cap'n Proto structs and back at the edge. Nothing here does I/O.
"""

from __future__ import annotations

import enum
import re
from typing import Any, Iterable, Mapping

import attrs


class ShardState(str, enum.Enum):
    """Lifecycle of one engine process (one replica of one model on one node)."""

    STARTING = "starting"  # process spawned, health check not yet passing
    READY = "ready"  # health check passing: the gateway may route to it
    UNHEALTHY = "unhealthy"  # was ready, health check now failing
    RESTARTING = "restarting"  # crashed; waiting out the backoff before the next start
    FAILED = "failed"  # gave up (or refused to start); message says why
    STOPPING = "stopping"  # SIGTERM sent, waiting for the grace period
    STOPPED = "stopped"  # stopped on request

    @property
    def is_terminal(self) -> bool:
        return self in (ShardState.FAILED, ShardState.STOPPED)


#: A MIG instance n on card c is placed as GPU MIG_INDEX_BASE + MIG_CARD_STRIDE * c + n. The base
#: keeps MIG numbers clear of plain card indexes (a node has far fewer than 1000 cards); the
#: stride is more than the 7 instances an A100/H100 can be cut into.
MIG_INDEX_BASE = 1000
MIG_CARD_STRIDE = 100


def is_mig(index: int) -> bool:
    """Returns whether placement index ``index`` is a MIG instance (not a whole card)."""
    return index >= MIG_INDEX_BASE


def gpu_display(index: int) -> str:
    """Returns how every view shows a placement index: "0" for a card, "0/mig2" for a MIG instance."""
    if not is_mig(index):
        return str(index)
    card, n = divmod(index - MIG_INDEX_BASE, MIG_CARD_STRIDE)
    return f"{card}/mig{n}"


def is_mig_class(gpu_class: str) -> bool:
    """Returns whether ``gpu_class`` names MIG instances ("a100-80g-mig-3g.40gb")."""
    return "-mig" in gpu_class


def gpu_summary(gpus: Iterable[GpuInfo]) -> str:
    """Returns ``gpus`` counted by class, as tables show them: "4x a100-80g-mig-1g.20gb, 3x a100-80g"
    (a GPU of unknown class by its name); "" for none."""
    counts: dict[str, int] = {}
    for gpu in gpus:
        key = gpu.gpu_class or gpu.name
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n}x {key}" for key, n in counts.items())


@attrs.frozen
class GpuInfo:
    """One unit placement may use: a whole card, or a MIG instance (``index`` >= :data:`MIG_INDEX_BASE`,
    ``uuid`` its MIG-... UUID). ``gpu_class``: "a100-80g", "a100-80g-mig-3g.40gb" ("" = unknown)."""

    index: int
    uuid: str
    name: str
    memory_total_mb: int
    memory_free_mb: int
    gpu_class: str = ""


@attrs.frozen
class Hardware:
    """What a node has; memory and GPU free figures are re-read every heartbeat."""

    cpu_count: int
    memory_total_mb: int
    memory_available_mb: int
    gpus: tuple[GpuInfo, ...] = ()
    gpu_note: str = ""  # e.g. "no GPUs: NVML library not found"
    disk_free_mb: int = 0  # free space on the file system of the agent's weights directory (0 = unknown)
    disk_total_mb: int = 0
    driver_version: str = ""  # the NVIDIA driver ("" = none)
    cuda_version: str = ""  # the newest CUDA that driver supports
    os: str = ""  # "Debian GNU/Linux 12 (bookworm)"
    arch: str = ""  # "x86_64"
    cpu_flags: tuple[str, ...] = ()  # the CPU's vector extensions (avx2, avx512f, asimd, sve, ...)


@attrs.frozen
class EngineInfo:
    """An engine as a node reports it."""

    name: str
    installed: bool
    version: str = ""
    installable: bool = False
    detail: str = ""
    state: str = ""  # what the agent is doing about it, in words ("installing: downloading X (16 MB)"); "" = idle
    path: str = ""  # what the agent runs: llama-server, or the Python of vLLM/SGLang ("" = none or built in)
    origin: str = ""  # where ``path`` comes from: ENGINE_FROM_CONFIG, ENGINE_INSTALLED or ENGINE_BUILT_IN


#: EngineInfo.origin: the operator named the path in agent.yaml ``engines:`` (it wins over anything installed).
ENGINE_FROM_CONFIG = "agent.yaml"
#: EngineInfo.origin: an environment or build llmgw's installer made (its marker checked).
ENGINE_INSTALLED = "installed"
#: EngineInfo.origin: part of llmgw itself (the simulator).
ENGINE_BUILT_IN = "built-in"


#: Engines whose ``source`` (and adapters' sources) are free-form labels: nothing is loaded from disk.
FREE_SOURCE_ENGINES = frozenset({"sim"})
#: Engines that load LoRA adapters at run time through vLLM's API, at most a model's
#: ``max_loaded_adapters`` at a time (the gateway loads them on demand).
ON_DEMAND_ADAPTER_ENGINES = frozenset({"vllm", "sim"})
#: Engines that load every adapter at start and pick them with a per-request ``lora`` field.
LORA_FIELD_ENGINES = frozenset({"llama.cpp"})
#: Engines that serve LoRA adapters at all (SGLang's adapter support is not wired up yet).
ADAPTER_ENGINES = ON_DEMAND_ADAPTER_ENGINES | LORA_FIELD_ENGINES


@attrs.frozen
class Adapter:
    """A LoRA adapter of a catalog model. ``name`` shares the model namespace (requests
    name it as their ``model``); ``source`` is where its files come from (same forms as a
    model's source: local path, http(s) URL, ``hf://org/repo[@rev]``)."""

    name: str
    source: str


def adapters_to_dicts(adapters: Iterable[Adapter]) -> list[dict[str, str]]:
    """Return ``adapters`` as ``[{"name", "source"}, ...]`` (JSON, the catalog's YAML, RPC structs)."""
    return [{"name": a.name, "source": a.source} for a in adapters]


def adapters_from_dicts(items: Iterable[Mapping[str, Any]]) -> tuple[Adapter, ...]:
    """Return the adapters ``items`` (as :func:`adapters_to_dicts` writes them) describe.

    Raises KeyError if an item lacks ``name`` or ``source``.
    """
    return tuple(Adapter(str(a["name"]), str(a["source"])) for a in items)


@attrs.frozen
class KvDelta:
    """A change to the KV-cache blocks one replica holds, from its engine's KV events.

    ``reset``: the replica now holds exactly ``stored`` (a full copy when a session starts,
    or a resync after a gap, an engine restart or AllBlocksCleared); otherwise ``stored`` are
    added and ``removed`` evicted. Hashes are vLLM's 64-bit event form. ``block_size``: tokens
    per block (0: not known yet). The counters are the shard subscriber's cumulative totals.
    """

    reset: bool = False
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    block_size: int = 0
    events_applied: int = 0
    gaps: int = 0
    resyncs: int = 0


#: Hashes in one KV message (agent -> control plane, control plane -> gateway workers; 64 KiB
#: of uint64): a full copy of a large cache is split into several messages, not one huge call.
MAX_HASHES_PER_DELTA = 8192


def split_delta(delta: KvDelta, limit: int = MAX_HASHES_PER_DELTA) -> list[KvDelta]:
    """Returns ``delta`` as messages of at most ``limit`` hashes each, same meaning in order.

    Only the first part of a reset is a reset; the rest add to it. An empty delta is one
    message (an empty reset means "holds nothing"). Raises ValueError if ``limit`` < 1.
    """
    if limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    if len(delta.stored) + len(delta.removed) <= limit:
        return [delta]
    hashes = [(h, True) for h in delta.stored] + [(h, False) for h in delta.removed]
    parts = []
    for i in range(0, len(hashes), limit):
        chunk = hashes[i : i + limit]
        parts.append(attrs.evolve(
            delta,
            reset=delta.reset and i == 0,
            stored=tuple(h for h, s in chunk if s),
            removed=tuple(h for h, s in chunk if not s),
        ))
    return parts


@attrs.frozen
class ShardSpec:
    """What the control plane asks a node to run: one replica of one model.

    ``cpu_cores``/``memory_mb``/``gpus`` are what placement reserved on the node.
    ``args``/``env`` come from the model's profile and were validated by the catalog;
    the node validates them again before start.
    """

    id: str
    model: str
    engine: str
    source: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = attrs.field(factory=dict, converter=lambda d: dict(d))
    memory_mb: int = 0
    cpu_cores: float = 0.0
    gpus: tuple[int, ...] = ()
    adapters: tuple[Adapter, ...] = ()  # the model's LoRA adapters (fetched by the node like the weights)
    max_loaded_adapters: int = 0  # 0: all loaded at start; N: at most N at a time, loaded on demand
    # The engine's secret (minted by the control plane when it places the shard): the engine
    # answers only requests that carry it as a Bearer token, and the gateway sends it. Kept out
    # of reprs, logs and ctl output; the agent hands it to the engine in its environment.
    api_key: str = attrs.field(default="", repr=False)
    # The model definition this shard runs (llmgw.catalog.fingerprint): the agent keeps it across
    # adoption; a rollout replaces shards whose fingerprint is not their catalog model's ("" = unknown).
    fingerprint: str = ""
    #: The UUID of each of ``gpus`` (GPU-... or MIG-...): a MIG instance is named to CUDA by it.
    gpu_uuids: tuple[str, ...] = ()


#: How an "unknown shard" answer begins, on the node and across the RPC (where only the
#: message travels): the control plane recognises it with :meth:`UnknownShard.in_text`.
UNKNOWN_SHARD = "unknown shard"


class UnknownShard(KeyError):
    """A node has no shard by this id: it never started it there, or stopped and forgot it.

    The control plane treats the shard as gone (nothing to adopt or stop) and places anew.
    A KeyError, so callers that look shards up by id catch it as before.
    """

    def __init__(self, shard_id: str) -> None:
        super().__init__(f"{UNKNOWN_SHARD} {shard_id!r}: this node does not run it (never started here, or stopped since)")
        self.shard_id = shard_id

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])

    @staticmethod
    def in_text(text: str) -> bool:
        """Returns True if a remote error's text is a node's "unknown shard" answer."""
        return f"{UNKNOWN_SHARD} '" in text


@attrs.frozen
class ComputeDevice:
    """One device an engine says it uses ("CUDA0", "NVIDIA H200", 143000 MiB; or "CPU")."""

    name: str  # the engine's device name: "CUDA0", "CPU", "Vulkan0"
    description: str = ""  # "NVIDIA H200", "AMD EPYC 7B13"
    memory_total_mb: int = 0
    memory_free_mb: int = 0


@attrs.frozen
class Compute:
    """What an engine says it computes on, read from its output (or nvidia-smi) at READY.

    ``source`` says where the facts came from: "engine" (its own output), "nvidia-smi"
    (GPUs the shard's processes hold memory on) or "default" (nothing said: CPU).
    Sizes are MiB as the engine printed them (floats: tiny models have fractions).
    """

    backend: str = ""  # "CPU", "CUDA", "Metal", "Vulkan", ...
    devices: tuple[ComputeDevice, ...] = ()
    model_buffer_mb: float = 0.0  # weights resident (sum over buffers)
    kv_buffer_mb: float = 0.0  # KV cache (sum over buffers)
    layers_offloaded: int = -1  # layers on GPU; -1 = the engine did not say
    layers_total: int = -1
    threads: int = 0
    source: str = ""
    notes: tuple[str, ...] = ()  # other facts worth showing ("loaded 16 tensors from lora file")

    def summary(self) -> str:
        """Returns one line for tables: "CPU, 0.4 MiB model, 0.5 MiB KV" / "CUDA0 H200, 33/33 layers"."""
        gpus = [d for d in self.devices if d.name.upper() != "CPU"]
        if gpus:
            names = []
            for d in gpus:
                short = d.description.removeprefix("NVIDIA ").removeprefix("GeForce ")
                names.append(f"{d.name} {short}".strip())
            parts = [" + ".join(names)]
        else:
            parts = [self.backend or "CPU"]
        if self.layers_total > 0 and self.layers_offloaded >= 0:
            parts.append(f"{self.layers_offloaded}/{self.layers_total} layers")
        if self.model_buffer_mb > 0:
            parts.append(f"{_mib(self.model_buffer_mb)} MiB model")
        if self.kv_buffer_mb > 0:
            parts.append(f"{_mib(self.kv_buffer_mb)} MiB KV")
        return ", ".join(parts)


def _mib(value: float) -> str:
    """Returns a MiB figure for people: one decimal below 100, whole numbers above."""
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


@attrs.frozen
class ShardStatus:
    """How one shard is doing, as the agent reports it."""

    id: str
    state: ShardState
    endpoint: str = ""  # "http://host:port" of the engine's OpenAI API, once known
    pid: int = 0
    restarts: int = 0
    message: str = ""  # the reason for the current state, in words
    last_output: tuple[str, ...] = ()  # last lines the engine printed (on failure/crash)
    compute: Compute | None = None  # what the engine computes on (from its output at READY); None = not known yet
    adapters: tuple[tuple[str, str], ...] = ()  # adapter name -> path on the node, as the engine loads it


@attrs.frozen
class Profile:
    """How a model is run: how many replicas and what each one reserves on its node."""

    replicas: int = 1
    memory_mb: int = 0  # host memory (CPU replicas) or per-GPU memory (GPU replicas) reserved
    cpu_cores: float = 0.0  # cores reserved on the node (CPU replicas); 0 = no reservation
    gpus: int = 0  # whole GPUs per replica; 0 = CPU replica
    engine_args: tuple[str, ...] = ()
    engine_env: Mapping[str, str] = attrs.field(factory=dict, converter=lambda d: dict(d))
    #: Labels a node must carry (every one, same value) for a replica to be placed there; {} = any node.
    node_labels: Mapping[str, str] = attrs.field(factory=dict, converter=lambda d: dict(d))
    #: The class of GPU each replica runs on ("h100-80g", "a100-80g-mig-3g.40gb"); "" = any.
    gpu_class: str = ""


@attrs.frozen
class ModelSpec:
    """A catalog entry. ``source`` is where the weights come from (a local path for now)."""

    name: str
    engine: str
    source: str
    profile: Profile = Profile()
    adapters: tuple[Adapter, ...] = ()  # LoRA adapters; their names share the model namespace
    max_loaded_adapters: int = 0  # 0: every adapter loaded at start; N: at most N per replica, on demand


def model_to_dict(spec: ModelSpec) -> dict[str, Any]:
    """Returns ``spec`` as plain JSON-friendly data: the catalog's YAML/JSON form (``ctl models
    list --json``, catalog export); the RPC form renames its keys. :func:`llmgw.catalog.validate_model`
    of it gives ``spec`` back."""
    profile = spec.profile
    return {
        "name": spec.name,
        "engine": spec.engine,
        "source": spec.source,
        "profile": {
            "replicas": profile.replicas,
            "memory_mb": profile.memory_mb,
            "cpu_cores": profile.cpu_cores,
            "gpus": profile.gpus,
            "engine_args": list(profile.engine_args),
            "engine_env": dict(profile.engine_env),
            # Only when set: a catalog without labels reads (and exports) as it did before.
            **({"node_labels": dict(profile.node_labels)} if profile.node_labels else {}),
            **({"gpu_class": profile.gpu_class} if profile.gpu_class else {}),
        },
        "adapters": adapters_to_dicts(spec.adapters),
        "max_loaded_adapters": spec.max_loaded_adapters,
    }


# -- several control planes ----------------------------------------------------------------

#: How a standby names the leader when it refuses a call only the leader answers; agents
#: and clients read the address back with :func:`leader_hint` and dial it next.
_LEADER_HINT = re.compile(r"the leader is (\S+) at (\S+) \(epoch (\d+)\)")


def not_leader_message(name: str, leader: str, address: str, epoch: int) -> str:
    """Returns the refusal of control plane ``name``, a standby, naming the ``leader`` at
    ``address`` (host:port of its RPC port) and its ``epoch``."""
    return f"control plane {name} is a standby: the leader is {leader} at {address} (epoch {epoch})"


def leader_hint(reason: str) -> str | None:
    """Returns the leader's RPC address named in a standby's refusal ``reason``, or None."""
    match = _LEADER_HINT.search(reason)
    return match.group(2) if match else None
