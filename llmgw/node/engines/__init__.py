"""Engine adapters: how the node agent runs one kind of inference engine.

An adapter knows whether its engine is installed here (:meth:`Engine.probe`), the
command line and environment for one shard (:meth:`Engine.argv`, :meth:`Engine.env`),
how to tell that the engine is ready (:attr:`Engine.health_path`, polled over HTTP,
within :attr:`Engine.startup_timeout` seconds), and which of a shard's arguments and
environment variables it refuses (:meth:`Engine.check_args`).

The catalog validates a profile's args and env against an allowlist; the node checks
them again here before anything is started, because the node is the one that runs
the process. :func:`check_refused` is the check every adapter shares.

``ENGINES`` maps an engine's name to its adapter; :func:`get_engine` looks one up.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Mapping, Protocol, Sequence, runtime_checkable

from llmgw.catalog import engine_options
from llmgw.catalog.engine_flags import Table
from llmgw.spec import ENGINE_FROM_CONFIG, EngineInfo, ShardSpec, is_mig

__all__ = [
    "DEFAULT_HEALTH_PATH",
    "DEFAULT_STARTUP_TIMEOUT",
    "ENGINE_PATH",
    "ENGINES",
    "Engine",
    "EngineRefused",
    "UnknownEngine",
    "check_refused",
    "configured_probe",
    "get_engine",
    "node_engines",
]

# Generous on purpose: a large model can take many minutes to load its weights and
# warm up before its health check passes. Adapters for quick engines lower it.
DEFAULT_STARTUP_TIMEOUT = 30 * 60.0

DEFAULT_HEALTH_PATH = "/health"
#: The directory put on a keyed vLLM or SGLang shard's ``PYTHONPATH``, and nothing else: it holds
#: only stdlib-only modules that run in the engine's own interpreter (``llmgw_vllm_guard``, vLLM's
#: guard middleware; ``llmgw_sglang_launch``, which hands SGLang its secret off the command line).
ENGINE_PATH = str(Path(__file__).resolve().with_name("engine_path"))
#: The directory holding the ``llmgw`` package: put on the PYTHONPATH of what the agent runs
#: as ``python -m llmgw...`` (the simulator, installs as the engines' user), so it imports this
#: very llmgw even where it runs from a source tree (``llmgw up``, the tests).
PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])


def llmgw_pythonpath(*more: str, environ: Mapping[str, str] | None = None) -> str:
    """Returns the PYTHONPATH of a process the agent runs as ``python -m llmgw...``:
    :data:`PACKAGE_ROOT`, then ``more``, then what ``environ`` (default: the agent's) has."""
    inherited = (os.environ if environ is None else environ).get("PYTHONPATH", "")
    return os.pathsep.join([PACKAGE_ROOT, *more] + ([inherited] if inherited else []))


class EngineRefused(ValueError):
    """A shard's args or env contain something the node refuses to run."""


class UnknownEngine(KeyError):
    """No adapter is registered under the requested engine name."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "unknown engine"


@runtime_checkable
class Engine(Protocol):
    """What the supervisor needs from an engine adapter.

    ``name``: the catalog's engine name. ``health_path``: the HTTP path that answers
    200 once the engine serves. ``startup_timeout``: seconds from process start within
    which the health check must pass, or the shard is killed and restarted.
    """

    name: str
    health_path: str
    startup_timeout: float

    def probe(self) -> EngineInfo:
        """Returns whether (and which version of) this engine is installed on this node."""
        ...

    def argv(self, spec: ShardSpec, host: str, port: int) -> list[str]:
        """Returns the command line that serves ``spec`` on ``host:port``."""
        ...

    def env(self, spec: ShardSpec) -> dict[str, str]:
        """Returns the variables added to the agent's environment for this shard's engine."""
        ...

    def check_args(self, spec: ShardSpec) -> None:
        """Raises :class:`EngineRefused` naming the first refused argument or variable."""
        ...

    # Optional (the supervisor uses them when present; see llmgw.node.engines.compute):
    #   parse_output(lines: list[str]) -> Compute | None
    #       what the engine's startup output says it computes on (devices, buffers, layers);
    #   gpu_failure(compute: Compute | None, spec: ShardSpec) -> str | None
    #       why a shard given GPUs is not using them, in the engine's own words (None: fine).
    #   kv_events_for(spec: ShardSpec, host: str, avoid: set[int]) -> llmgw.node.kvevents.KvEventsConfig | None
    #       fresh KV-event endpoints (ports outside ``avoid``, the node's shards' ports) and block
    #       size for a shard whose engine publishes vLLM KV events (None: it does not); such an
    #       adapter's argv also takes ``kv_events=config``.
    #       The supervisor asks once per shard, persists it, and binds the subscriber first.
    #   in_flight_probe() -> llmgw.node.engines.load.InFlightProbe
    #       how the engine says how many requests it has in flight (a rollout's drain waits for 0);
    #       without it (llmgw.node.engines.load.in_flight_probe gives None) the drain waits a fixed time.


#: Variables of the agent's own environment an engine inherits. Everything else (credentials,
#: proxies, library paths, the agent's own settings) stays with the agent: an engine gets this,
#: plus what its adapter and the model's validated profile add.
INHERITED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "LC_*")


def cuda_env(spec: ShardSpec) -> dict[str, str]:
    """Returns the GPU selection every shard gets (:func:`gpu_env` of its GPUs)."""
    return gpu_env(spec.gpus, spec.gpu_uuids)


def gpu_env(gpus: Sequence[int], uuids: Sequence[str]) -> dict[str, str]:
    """Returns the GPU selection of a process given ``gpus`` (placement indexes, with their
    ``uuids``): CUDA numbering GPUs in PCI bus order, as placement does, and only those GPUs
    visible ("" for none: a CPU process sees no GPU). A MIG instance is named by its MIG-...
    UUID (CUDA takes no index for one)."""
    by_index = dict(zip(gpus, uuids))
    devices = [by_index[g] if is_mig(g) and by_index.get(g) else str(g) for g in gpus]
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(devices)}


def base_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Returns the part of ``environ`` (default: the agent's) that engines inherit."""
    environ = os.environ if environ is None else environ
    return {
        key: value
        for key, value in environ.items()
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in INHERITED_ENV)
    }


def check_refused(spec: ShardSpec, *, version: str | None = None, table: Table | None = None) -> None:
    """Raises :class:`EngineRefused` if ``spec`` uses a refused argument or env variable,
    or a value its engine refuses on this shard's device kind (no GPUs given: CPUs).

    The policy is :mod:`llmgw.catalog.engine_options` (the catalog applies the same one):
    the options allowed are those the engine's classified table marks safe, and ``version``
    (the engine version this node runs, when known) is named in the refusal of an option
    that table does not know. ``table``: the classified options, for an adapter whose engine
    llmgw has no table of (default: the engine's own).
    The message is one line naming the shard and every offending argument and variable, so
    an operator can fix the model's profile in one go. Returns None when everything is allowed.
    """
    found = [
        *engine_options.violations(spec.engine, spec.args, spec.env, version=version, table=table),
        *engine_options.device_violations(spec.engine, spec.args, on_cpu=not spec.gpus),
    ]
    if found:
        problems = "; ".join(str(v) for v in found)
        raise EngineRefused(
            f"shard {spec.id}: refused on this node: {problems}; fix the model's profile "
            "(engine_args / engine_env) and add it again"
        )


def configured_probe(name: str, path: Path) -> EngineInfo:
    """Returns what an adapter can say, cheaply, of the ``path`` agent.yaml names for engine
    ``name``: the agent's last proof that it runs, with its version
    (:func:`llmgw.node.install.configured.last_proof`), or before any, installed when it is an
    executable file, version unknown."""
    from llmgw.node.install.configured import last_proof

    proof = last_proof(name, path)
    if proof is not None:
        return EngineInfo(name, installed=proof.ok, version=proof.version,
                          detail="named in agent.yaml" if proof.ok else f"not usable: {proof.reason}",
                          path=str(path), origin=ENGINE_FROM_CONFIG)
    runnable = path.is_file() and os.access(path, os.X_OK)
    detail = ("named in agent.yaml (the agent proves it runs)" if runnable
              else f"not usable: {path} is not an executable file (named in agent.yaml)")
    return EngineInfo(name, installed=runnable, detail=detail, path=str(path), origin=ENGINE_FROM_CONFIG)


def get_engine(name: str, engines: Mapping[str, Engine] | None = None) -> Engine:
    """Returns the adapter called ``name`` from ``engines`` (default: :data:`ENGINES`).

    Raises :class:`UnknownEngine` (a KeyError) listing the engines this node knows.
    """
    table = ENGINES if engines is None else engines
    try:
        return table[name]
    except KeyError:
        known = ", ".join(sorted(table)) or "none"
        raise UnknownEngine(
            f"engine {name!r} is not known to this node (known: {known}); "
            "check the model's engine name in the catalog"
        ) from None


from llmgw.node.engines.sim import SimEngine  # noqa: E402  (sim uses check_refused above)

from llmgw.node.engines.sglang import SglangEngine  # noqa: E402
from llmgw.node.engines.vllm import VllmEngine  # noqa: E402

ENGINES: dict[str, Engine] = {SimEngine.name: SimEngine(), VllmEngine.name: VllmEngine(), SglangEngine.name: SglangEngine()}

from llmgw.node.engines.llamacpp import LlamaCppEngine  # noqa: E402

ENGINES[LlamaCppEngine.name] = LlamaCppEngine()


def node_engines(llamacpp_threads: int | None = None, paths: Mapping[str, Path] | None = None) -> dict[str, Engine]:
    """Returns the adapters for this node: :data:`ENGINES` with the node's own settings applied
    (``llamacpp_threads``: agent.yaml ``llamacpp.threads``, the thread count of CPU llama.cpp
    replicas whose profile reserves no cores; ``paths``: agent.yaml ``engines:``, engine name ->
    the llama-server or Python the operator named, which the adapter then always runs)."""
    paths = dict(paths or {})
    engines = dict(ENGINES)
    if llamacpp_threads is not None or LlamaCppEngine.name in paths:
        engines[LlamaCppEngine.name] = LlamaCppEngine(paths.get(LlamaCppEngine.name), threads=llamacpp_threads)
    if VllmEngine.name in paths:
        engines[VllmEngine.name] = VllmEngine(python=paths[VllmEngine.name])
    if SglangEngine.name in paths:
        engines[SglangEngine.name] = SglangEngine(python=paths[SglangEngine.name])
    return engines
