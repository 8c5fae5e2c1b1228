"""Plain values shared by the control plane, the agent and the wire layer.

These attrs classes are what llmgw's own code passes around; ``llmgw.rpc.convert``
turns them into Cap'n Proto structs and back at the edge. Nothing here does I/O.
"""

from __future__ import annotations

import enum
from typing import Mapping

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


@attrs.frozen
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_total_mb: int
    memory_free_mb: int


@attrs.frozen
class Hardware:
    """What a node has; memory and GPU free figures are re-read every heartbeat."""

    cpu_count: int
    memory_total_mb: int
    memory_available_mb: int
    gpus: tuple[GpuInfo, ...] = ()
    gpu_note: str = ""  # e.g. "no GPUs: NVML library not found"


@attrs.frozen
class EngineInfo:
    """An engine as a node reports it."""

    name: str
    installed: bool
    version: str = ""
    installable: bool = False
    detail: str = ""


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


@attrs.frozen
class Profile:
    """How a model is run: how many replicas and what each one reserves on its node."""

    replicas: int = 1
    memory_mb: int = 0  # host memory (CPU replicas) or per-GPU memory (GPU replicas) reserved
    cpu_cores: float = 0.0  # cores reserved on the node (CPU replicas); 0 = no reservation
    gpus: int = 0  # whole GPUs per replica; 0 = CPU replica
    engine_args: tuple[str, ...] = ()
    engine_env: Mapping[str, str] = attrs.field(factory=dict, converter=lambda d: dict(d))


@attrs.frozen
class ModelSpec:
    """A catalog entry. ``source`` is where the weights come from (a local path for now)."""

    name: str
    engine: str
    source: str
    profile: Profile = Profile()
