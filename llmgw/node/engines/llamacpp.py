"""Adapter for llama.cpp's ``llama-server`` (see :class:`llmgw.node.engines.Engine`).

Command line for a shard (what the agent sets itself; a profile may not set these)::

    llama-server -m SOURCE --alias MODEL --host H --port P --metrics -lv 4 -t THREADS
                 [-ngl 999 (GPU shards)] [--lora ADAPTER ...] [profile args: -c, -np, ...]

- threads: the profile's ``cpu_cores`` (reserved by placement) when set, else the
  per-node override (:attr:`LlamaCppEngine.threads`, the hook for agent.yaml's
  ``llamacpp.threads``), else half this machine's CPUs; ``-t``/``--threads`` in the
  profile's args wins over all of them.
- ``-lv 4`` makes llama.cpp print its devices, buffers and offload counts, which
  :func:`parse_output` turns into the shard's :class:`~llmgw.spec.Compute`.
- ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``CUDA_VISIBLE_DEVICES`` = the shard's GPUs (empty
  for a CPU shard, so it never touches a GPU placement did not give it).
- LoRA adapters: the catalog's adapters (``spec.adapters``, their sources already local
  paths: the supervisor fetched them) become ``--lora PATH`` each, in order, so adapter i
  has llama.cpp id i (the order the shard reports in ``ShardStatus.adapters``). llama.cpp
  applies every loaded adapter at scale 1 to a request without a ``lora`` field
  (``--lora-init-without-apply`` does not change that in build b11312: measured), so the
  gateway sends every request to such a replica with an explicit per-request ``lora``
  field (:mod:`llmgw.router.adapters`). ``--lora`` in a profile is refused: adapters are
  catalog entries.

Health: GET /health answers 503 while the model loads, 200 once it serves.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmgw.node.engines import DEFAULT_HEALTH_PATH, EngineRefused, check_refused, configured_probe, cuda_env
from llmgw.node.engines.load import LLAMACPP_SLOTS, InFlightProbe
from llmgw.node.install import llamacpp as install
from llmgw.node.engines.threads import default_threads
from llmgw.spec import ENGINE_INSTALLED, Compute, ComputeDevice, EngineInfo, ShardSpec

__all__ = ["AGENT_FLAGS", "LlamaCppEngine", "READING_FLAGS", "gpu_failure", "parse_output"]

# A multi-GB model loads in minutes from a slow disk; a tiny one in milliseconds.
LLAMACPP_STARTUP_TIMEOUT = 20 * 60.0
# Offload "all" layers to the GPUs a GPU shard was given (llama.cpp clamps to the model's count).
ALL_LAYERS = "999"
# llama.cpp prints devices, backends, buffers and offload counts only from this verbosity on.
VERBOSITY = "4"

#: Flags the agent sets itself (a profile setting them would fight the agent), with the reason.
AGENT_FLAGS: dict[str, str] = {
    **{f: "the agent sets the model from the catalog's source" for f in ("-m", "--model")},
    **{f: "the agent sets the alias to the model's name" for f in ("-a", "--alias")},
    "--host": "the agent chooses the listen address",
    "--port": "the agent chooses the port",
    **{f: "the agent needs -lv 4 to read the devices" for f in ("-lv", "--verbosity", "--log-verbosity", "--log-disable", "-v", "--verbose", "--log-jsonl")},
    "--metrics": "the agent always enables it",
}
#: Flags that read, write or fetch files or code at a path or URL a profile chooses.
READING_FLAGS: dict[str, str] = {
    **{f: "it downloads a model from the network; use the catalog's source" for f in (
        "-mu", "--model-url", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hfd", "-hfrd", "--hf-repo-draft",
        "-hfv", "-hfrv", "--hf-repo-v", "-hffv", "--hf-file-v", "-hft", "--hf-token", "-dr", "--docker-repo")},
    "--log-file": "it writes a file anywhere the engine's user can",
    "--slot-save-path": "it lets API clients write files under a chosen directory",
    "--path": "it serves the files of a directory over HTTP",
    "--api-key-file": "it reads a file",
    "--ssl-key-file": "it reads a file", "--ssl-cert-file": "it reads a file",
    "--chat-template-file": "it reads a file", "--system-prompt-file": "it reads a file",
    "--grammar-file": "it reads a file", "-bf": "it reads a file", "--binary-file": "it reads a file",
    "-f": "it reads a file", "--file": "it reads a file", "--media-path": "it reads files",
    "--webui-config-file": "it reads a file", "--models-dir": "it reads a directory of models",
    "--models-preset": "it reads a file", "--rpc": "it sends the model to remote servers",
    "-mm": "it loads another model", "--mmproj": "it loads another model", "-mmu": "it downloads a model",
    "--mmproj-url": "it downloads a model", "-md": "it loads another model", "--model-draft": "it loads another model",
    "--control-vector": "it loads a file", "--control-vector-scaled": "it loads a file",
    "--lora-base": "it loads another model", "--tools": "it lets the model run tools on the node",
    "--allowed-local-media-path": "it lets requests read local files",
}
_THREAD_FLAGS = ("-t", "--threads")
_GPU_LAYER_FLAGS = ("-ngl", "--gpu-layers", "--n-gpu-layers")


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0]


def _env_flag(name: str) -> str | None:
    """Returns the flag a ``LLAMA_ARG_*`` variable stands for (``LLAMA_ARG_MODEL`` -> ``--model``)."""
    if not name.startswith("LLAMA_ARG_"):
        return None
    return "--" + name[len("LLAMA_ARG_"):].lower().replace("_", "-")


def check_llamacpp_args(spec: ShardSpec, *, version: str | None = None) -> None:
    """Raises EngineRefused naming the first argument or LLAMA_ARG_* variable llama.cpp shards may not use.

    Refused: what the agent sets itself, flags that read/write/fetch chosen files or URLs,
    Returns None if all is allowed. ``version``: the llama.cpp version this node runs (named
    in the refusal of an option llmgw's table does not know).
    """
    check_refused(spec, version=version)
    for arg in spec.args:
        flag = _flag(arg)
        reason = AGENT_FLAGS.get(flag) or READING_FLAGS.get(flag)
        if reason:
            raise EngineRefused(f"shard {spec.id}: llama.cpp argument {flag!r} is refused: {reason}; "
                                "remove it from the model's profile engine_args")
    for name in spec.env:
        flag = _env_flag(name)
        if flag is None:
            continue
        reason = AGENT_FLAGS.get(flag) or READING_FLAGS.get(flag)
        if reason:
            raise EngineRefused(f"shard {spec.id}: environment variable {name!r} (= {flag}) is refused: {reason}; "
                                "remove it from the model's profile engine_env")


class LlamaCppEngine:
    """The llama.cpp adapter. ``binary``: llama-server to run (agent.yaml ``engines.llama.cpp.server``,
    never replaced by an installed one; default: the installed one, found with
    :func:`llmgw.node.install.llamacpp.find_installed`); ``threads``: the node's
    default thread count override (None: half the CPUs)."""

    name = install.ENGINE_NAME
    health_path = DEFAULT_HEALTH_PATH
    startup_timeout = LLAMACPP_STARTUP_TIMEOUT

    def in_flight_probe(self) -> InFlightProbe:
        """Returns how llama-server says how busy it is: its ``/slots`` processing."""
        return LLAMACPP_SLOTS

    def __init__(self, binary: Path | None = None, *, threads: int | None = None) -> None:
        self.binary = binary
        self.threads = threads

    def _binary(self) -> Path | None:
        if self.binary is not None:
            return self.binary
        found = install.find_installed()
        return found.binary if found is not None else None

    def probe(self) -> EngineInfo:
        """Returns installed/version from the install marker (written after ``--version`` ran); for
        a binary agent.yaml names, only whether it is executable (the agent's installers prove it runs)."""
        if self.binary is not None:
            return configured_probe(self.name, self.binary)
        found = install.find_installed()
        if found is None:
            return EngineInfo(self.name, False, "", True, "llama-server is not installed on this node")
        return EngineInfo(self.name, True, found.version, True, f"{found.version_line} at {found.binary}",
                          path=str(found.binary), origin=ENGINE_INSTALLED)

    def argv(self, spec: ShardSpec, host: str, port: int) -> list[str]:
        """Returns llama-server's command line for ``spec`` (see the module docstring).

        Raises FileNotFoundError (an OSError: the supervisor retries with backoff) if
        llama-server is not installed here yet.
        """
        binary = self._binary()
        if binary is None:
            raise FileNotFoundError(
                "llama-server is not installed on this node; install it (python -m llmgw.node.install.llamacpp) "
                "or let the agent install it"
            )
        argv = [str(binary), "-m", spec.source, "--alias", spec.model, "--host", host, "--port", str(port),
                "--metrics", "-lv", VERBOSITY]
        rest = list(spec.args)
        flags = {_flag(a) for a in rest}
        if not flags & set(_THREAD_FLAGS):
            argv += ["-t", str(default_threads(spec, self.threads))]
        if spec.gpus and not flags & set(_GPU_LAYER_FLAGS):
            argv += ["-ngl", ALL_LAYERS]
        for adapter in spec.adapters:
            argv += ["--lora", adapter.source]
        return argv + rest

    def env(self, spec: ShardSpec) -> dict[str, str]:
        """Returns the GPU selection (PCI bus order, the shard's GPUs only) plus the profile's env."""
        return {**cuda_env(spec), **spec.env}

    def check_args(self, spec: ShardSpec) -> None:
        """Raises EngineRefused for refused args/env (see :func:`check_llamacpp_args`)."""
        check_llamacpp_args(spec, version=self.probe().version or None)

    def parse_output(self, lines: list[str]) -> Compute | None:
        """Returns the Compute llama-server's startup output describes (see :func:`parse_output`)."""
        return parse_output(lines)

    def gpu_failure(self, compute: Compute | None, spec: ShardSpec) -> str | None:
        """Returns why a GPU shard got no GPU, in the engine's words (see :func:`gpu_failure`)."""
        return gpu_failure(compute, spec)


# -- reading the output ---------------------------------------------------------------

# "0.00.123.456 I " (timestamp + level) in front of every line of llama.cpp's text log.
_PREFIX = re.compile(r"^\s*\d+\.\d+\.\d+\.\d+\s+[IWEDT]\s+")
# common_params_print_info / device_info: "  - CPU     : AMD EPYC 7B13 (24105 MiB, 24105 MiB free)"
_DEVICE_INFO = re.compile(r"-\s+(?P<name>[A-Za-z][\w-]*)\s*:\s*(?P<desc>.*?)\s*\((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)")
# llama_model_load_from_file_impl: using device CUDA0 (NVIDIA H200) (0000:19:00.0) - 140123 MiB free
_USING_DEVICE = re.compile(r"using device (?P<name>\S+) \((?P<desc>[^)]*)\).*?- (?P<free>\d+) MiB free")
# ggml_cuda_init:   Device 0: NVIDIA H200, compute capability 9.0, VMM: yes, VRAM: 143167 MiB
_CUDA_DEVICE = re.compile(r"Device (?P<idx>\d+): (?P<desc>[^,]+), .*VRAM: (?P<total>\d+) MiB")
_MODEL_BUF = re.compile(r"(?P<buf>\S+) model buffer size\s*=\s*(?P<mib>\d+(?:\.\d+)?) MiB")
_KV_BUF = re.compile(r"(?P<buf>\S+) KV buffer size\s*=\s*(?P<mib>\d+(?:\.\d+)?) MiB")
_OFFLOADED = re.compile(r"offloaded (?P<done>\d+)/(?P<total>\d+) layers to GPU")
_THREADS = re.compile(r"system_info: n_threads = (?P<n>\d+)")
_LORA = re.compile(r"loaded \d+ tensors from lora file")
#: Lines in which llama.cpp says it could not use a GPU; kept verbatim in Compute.notes.
_GPU_COMPLAINTS = re.compile(
    r"no usable GPU found|failed to initialize (CUDA|ROCm|MUSA|Vulkan)|CUDA error|no CUDA-capable device"
    r"|not compiled with GPU offload support", re.IGNORECASE,
)


def _message(line: str) -> str:
    return _PREFIX.sub("", line).strip()


def _backend_of(device: str) -> str:
    """Returns "CUDA" for "CUDA0", "Vulkan" for "Vulkan1", "CPU" for "CPU"."""
    return re.sub(r"\d+$", "", device) or device


def parse_output(lines: list[str]) -> Compute | None:
    """Returns what llama-server's startup output (at ``-lv 4``) says it computes on.

    Reads the device list (``device_info`` lines; ``using device`` lines narrow it to the
    model's devices; ``ggml_cuda_init`` lines as a fallback), the model and KV buffer sizes
    (summed over buffers), ``offloaded X/Y layers to GPU``, ``n_threads`` and LoRA loads.
    GPU complaints ("no usable GPU found", "failed to initialize CUDA") are kept verbatim
    in ``notes``. Returns None if the output names no device and no buffer (an older or
    quieter build): the caller then falls back to nvidia-smi or CPU.
    """
    listed: dict[str, ComputeDevice] = {}
    used: dict[str, ComputeDevice] = {}
    cuda: dict[str, ComputeDevice] = {}
    model_mb = kv_mb = 0.0
    offloaded = total = -1
    threads = 0
    notes: list[str] = []
    seen_any = False
    for raw in lines:
        msg = _message(raw)
        if m := _USING_DEVICE.search(msg):
            name = m["name"]
            prev = listed.get(name) or cuda.get(name)
            used[name] = ComputeDevice(name, m["desc"], prev.memory_total_mb if prev else 0, int(m["free"]))
        elif m := _DEVICE_INFO.search(msg):
            listed[m["name"]] = ComputeDevice(m["name"], m["desc"], int(m["total"]), int(m["free"]))
        elif m := _CUDA_DEVICE.search(msg):
            name = f"CUDA{m['idx']}"
            cuda[name] = ComputeDevice(name, m["desc"].strip(), int(m["total"]), 0)
        elif m := _MODEL_BUF.search(msg):
            model_mb += float(m["mib"])
            seen_any = True
        elif m := _KV_BUF.search(msg):
            kv_mb += float(m["mib"])
            seen_any = True
        elif m := _OFFLOADED.search(msg):
            offloaded, total = int(m["done"]), int(m["total"])
        elif m := _THREADS.search(msg):
            threads = int(m["n"])
        elif _LORA.search(msg) or _GPU_COMPLAINTS.search(msg):
            notes.append(msg)
    devices = dict(listed or cuda)
    if used:  # the model's own devices, plus the CPU (it always holds the input embeddings)
        devices = {**used, **{k: v for k, v in devices.items() if _backend_of(k) == "CPU"}}
    if not devices and not seen_any:
        return None
    gpu_names = [n for n in devices if _backend_of(n) != "CPU"]
    if offloaded == 0:  # a GPU build that placed nothing on the GPU computes on the CPU
        gpu_names = []
    backend = _backend_of(gpu_names[0]) if gpu_names else "CPU"
    ordered = tuple(devices[n] for n in gpu_names) + tuple(d for n, d in devices.items() if _backend_of(n) == "CPU")
    return Compute(
        backend=backend,
        devices=ordered or (ComputeDevice("CPU"),),
        model_buffer_mb=round(model_mb, 2),
        kv_buffer_mb=round(kv_mb, 2),
        layers_offloaded=offloaded,
        layers_total=total,
        threads=threads,
        source="engine",
        notes=tuple(notes),
    )


def gpu_failure(compute: Compute | None, spec: ShardSpec) -> str | None:
    """Returns why a shard given GPUs is not using them, quoting llama.cpp, or None if it is fine.

    Fails only on what the engine said: a GPU complaint line, ``offloaded 0/Y layers``, or a
    device list without any GPU. A CPU shard, or an engine that said nothing, never fails.
    """
    if not spec.gpus or compute is None or compute.source != "engine":
        return None
    gpus = ",".join(str(g) for g in spec.gpus)
    complaints = [n for n in compute.notes if _GPU_COMPLAINTS.search(n)]
    if complaints:
        return f"GPU {gpus} given, but llama.cpp says: {complaints[0]}"
    if compute.layers_offloaded == 0:
        return f"GPU {gpus} given, but llama.cpp says: offloaded 0/{compute.layers_total} layers to GPU"
    if compute.devices and all(_backend_of(d.name) == "CPU" for d in compute.devices):
        names = ", ".join(f"{d.name} ({d.description})" if d.description else d.name for d in compute.devices)
        return f"GPU {gpus} given, but llama.cpp lists no GPU device (devices: {names}); is this a CPU-only build?"
    return None
