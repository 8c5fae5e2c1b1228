"""What a model's profile may pass to an engine: the argument and environment policy.

One policy, applied twice: by catalog validation (:func:`llmgw.catalog.validate_model`: a
model that breaks it never enters the catalog) and by the node right before it starts an
engine (:func:`llmgw.node.engines.check_refused`: the node is the one that runs the
process, and a catalog written by an older llmgw may hold anything). Plain data and pure
functions, so both sides read the same table without importing each other.

Environment: for real engines an **allowlist** of tuning families (:data:`ENV_FAMILIES`:
OpenMP, BLAS, CUDA and NCCL tuning, the engine's own ``VLLM_*``/``SGLANG_*``/``GGML_*``
knobs...). Inside those families, and for every engine, names that carry a path, a
plugin, a library, a cache or config directory, an address or a credential are refused
(:data:`REFUSED_ENV_NAMES`), as are variables the agent sets itself (:data:`AGENT_ENV`).
A ``LLAMA_ARG_*`` variable is how llama-server reads one of its options from the
environment: it is checked as the option llama.cpp's table says it sets (one the table
does not know is refused as not classified).
The simulator (llmgw's own code) gets the name refusals but no family allowlist.

Arguments: an **allowlist** per engine version. Each engine has a classified table of every
option its parser knows (:mod:`llmgw.catalog.engine_flags`): safe (tuning, limits, features
that name no path, address, credential or code) or refused with the reason. The arguments are
read the way the engine's parser reads them (:mod:`llmgw.catalog.engine_flags.reader`), and
refused: options classified as refused, options the table does not know (a newer engine's new
options, until classified), values with no option before them, spellings that could mean
another option (argparse abbreviations, short options with the value attached), values outside
a safe option's allowed ones. ``--llmgw-*`` options are llmgw's own (read by the adapter, never
passed on); unknown ones are refused.

:func:`violations` returns every problem; :func:`check` raises listing them all.

Device kind: some values an engine refuses only on one kind of device (vLLM's CPU attention
needs a ``--block-size`` that is a multiple of 32). :func:`device_violations` returns those
for the device kind a shard runs on: the catalog knows it from ``profile.gpus`` (0: CPUs),
the node from the GPUs the shard was given, so the catalog refuses them first.
"""

from __future__ import annotations

import fnmatch
from typing import Mapping, Sequence

import attrs

from llmgw.catalog.engine_flags import Table, table_for
from llmgw.catalog.engine_flags.reader import Problem, read

__all__ = [
    "AGENT_ENV",
    "API_KEY_ENV",
    "ENV_FAMILIES",
    "LLMGW_OPTIONS",
    "REFUSED_ENV_NAMES",
    "UnsafeSetting",
    "Violation",
    "check",
    "device_violations",
    "llmgw_options",
    "option_name",
    "violations",
]

#: The profile option that turns an engine's KV events off (vLLM, sim): the router then
#: routes that model's replicas approximately.
NO_KV_EVENTS_OPTION = "--llmgw-no-kv-events"
#: llmgw's own profile options, per engine: read by the adapter, never passed to the engine.
LLMGW_OPTIONS: Mapping[str, frozenset[str]] = {
    # vLLM and the simulator publish KV events by default (the router needs them);
    # --llmgw-no-kv-events turns them off, --llmgw-kv-events is accepted for older catalogs.
    "vllm": frozenset({"--llmgw-kv-events", NO_KV_EVENTS_OPTION}),
    "sim": frozenset({NO_KV_EVENTS_OPTION}),
}
#: llmgw options that were replaced, with what replaced them (named in the refusal).
RETIRED_OPTIONS: Mapping[str, str] = {
    "--llmgw-lora": "adapters are catalog entries now: `llmgw ctl models add ... --adapter NAME=SOURCE`",
}

#: Engines whose ``--block-size`` (tokens per KV block) must be a positive integer on every device.
BLOCK_SIZE_ENGINES = frozenset({"vllm", "sim"})
#: vLLM's CPU attention needs a block size that is a multiple of 32 (vLLM refuses 16 with
#: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"); 128 is its CPU default.
VLLM_CPU_BLOCK_MULTIPLE = 32
VLLM_CPU_BLOCK_SIZE = 128

#: Environment families a real engine's profile may set (fnmatch patterns), per engine.
_COMMON_FAMILIES = (
    "OMP_*", "KMP_*", "GOMP_*", "MKL_*", "OPENBLAS_*", "BLIS_*", "MALLOC_*",
    "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
    "CUDA_*", "NCCL_*", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCH_NCCL_*",
)
ENV_FAMILIES: Mapping[str, tuple[str, ...]] = {
    "vllm": (*_COMMON_FAMILIES, "VLLM_*"),
    "sglang": (*_COMMON_FAMILIES, "SGLANG_*", "SGL_*"),
    "llama.cpp": (*_COMMON_FAMILIES, "GGML_*", "LLAMA_ARG_*"),
}
#: Names refused for every engine, even inside a family, with the reason.
REFUSED_ENV_NAMES: tuple[tuple[str, str], ...] = (
    ("LD_*", "it changes which shared libraries the engine loads"),
    ("PYTHON*", "it changes which Python code the engine runs (or its hashing)"),
    ("CUDA_INJECTION64_PATH", "it injects a library into the CUDA runtime"),
    ("*_PRELOAD", "it injects a library into the engine"),
    ("*_PLUGIN", "plugin variables make the engine load code from a path"),
    ("*_PLUGINS", "plugin variables make the engine load code"),
    ("*_PLUGIN_*", "plugin variables make the engine load code from a path"),
    ("*_LIB", "it names a library to load"),
    ("*_LIBS", "it names libraries to load"),
    ("*LIBRARY*", "it names a library to load"),
    ("*_MODULE", "it names code to load"),
    ("*_PATH", "it names a path the engine reads, writes or loads code from"),
    ("*_PATHS", "it names paths the engine reads, writes or loads code from"),
    ("*_DIR", "it names a directory the engine reads or writes"),
    ("*_DIRS", "it names directories the engine reads or writes"),
    ("*_FILE", "it names a file the engine reads or writes"),
    ("*_ROOT", "it names a directory the engine reads or writes"),
    ("*_HOME", "it names a directory the engine reads or writes"),
    ("*_TOKEN", "it carries a credential"),
    ("*_TOKEN_*", "it carries a credential"),
    ("*_KEY", "it carries a credential"),
    ("*_KEY_*", "it carries a credential"),
    ("*SECRET*", "it carries a credential"),
    ("*PASSWORD*", "it carries a credential"),
    ("*CREDENTIAL*", "it carries a credential"),
    ("*_HOST", "it names a network address"),
    ("*_HOST_IP", "it names a network address"),
    ("*_IP", "it names a network address"),
    ("*_ADDR", "it names a network address"),
    ("*_ADDRESS", "it names a network address"),
    ("*_PORT", "it names a network port"),
    ("*_URL", "it names a network address"),
    ("*_URI", "it names a network address"),
    ("*_ENDPOINT", "it names a network address"),
    ("*_PROXY", "it names a network address"),
    ("*LIBRARIES*", "it names libraries to load"),
    ("OMP_TOOL*", "it makes the OpenMP runtime load tool libraries (and write where they say)"),
    ("*_CACHE", "it names a cache directory the engine reads and writes"),
    ("*_FOLDER", "it names a directory the engine reads or writes"),
    ("*_LOCATION", "it names a path or address the engine reads"),
    ("*_IPS", "it names network addresses"),
    ("*_SERVER", "it names a network address"),
    ("*_SERVERS", "it names network addresses"),
    ("VLLM_TRACE_FUNCTION", "it writes a trace of every function call to files"),
    ("VLLM_LORA_RESOLVER_*", "it downloads adapters; llmgw loads adapters itself"),
    ("VLLM_RAY_EXTRA_ENV_*", "it copies other variables into the engine's workers"),
    ("*TRUST_REMOTE_CODE*", "it runs Python code shipped with the model weights"),
    ("VLLM_ALLOW_INSECURE_SERIALIZATION", "it lets the engine unpickle data, which runs code"),
    ("VLLM_SERVER_DEV_MODE", "it opens the engine's development endpoints"),
    ("VLLM_USE_MODELSCOPE", "it downloads weights from elsewhere; llmgw fetches weights itself"),
)
#: The variable through which the agent hands a shard's engine its secret (``ShardSpec.api_key``),
#: per engine: never on the command line, which every local user can read in /proc. vLLM reads
#: VLLM_API_KEY (vllm.envs) and llama-server LLAMA_API_KEY (its ``--api-key`` option's variable);
#: the simulator reads LLMGW_SIM_API_KEY (:data:`llmgw.sim.config.API_KEY_ENV`). SGLang takes its
#: key only as ``--api-key``: a keyed SGLang shard runs llmgw's launcher
#: (``llmgw/node/engines/engine_path/llmgw_sglang_launch.py``), which reads LLMGW_SGLANG_API_KEY,
#: unsets it and passes the key to SGLang's argument parser inside the process.
API_KEY_ENV: Mapping[str, str] = {
    "vllm": "VLLM_API_KEY",
    "llama.cpp": "LLAMA_API_KEY",
    "sim": "LLMGW_SIM_API_KEY",
    "sglang": "LLMGW_SGLANG_API_KEY",
}
#: Variables the agent sets itself, per engine.
AGENT_ENV: Mapping[str, frozenset[str]] = {
    "vllm": frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                       "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "VLLM_API_KEY"}),
    "sglang": frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LLMGW_SGLANG_API_KEY"}),
    "llama.cpp": frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LLAMA_API_KEY", "LLAMA_ARG_API_KEY",
                            "LLAMA_ARG_API_KEY_FILE"}),
    "sim": frozenset({"LLMGW_SIM_API_KEY"}),
}
#: Engines that get the name refusals only (no family allowlist): llmgw's own simulator.
FREE_ENV_ENGINES = frozenset({"sim"})
_LLAMA_ARG_PREFIX = "LLAMA_ARG_"


@attrs.frozen
class Violation:
    """One refused setting. ``where``: ``engine_args[i]`` or ``engine_env.NAME``;
    ``subject``: the option or variable; ``reason``: a sentence starting with the subject."""

    where: str
    subject: str
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


class UnsafeSetting(ValueError):
    """A profile's engine args or env break the policy; ``violations`` lists every problem."""

    def __init__(self, found: Sequence[Violation]) -> None:
        super().__init__("; ".join(str(v) for v in found))
        self.violations = tuple(found)


def option_name(arg: str) -> str | None:
    """Returns the normalised option of ``arg`` (``--a_b=1`` -> ``--a-b``, ``-m`` -> ``-m``), or None.

    Values (anything not starting with ``-``) and negative numbers give None.
    """
    if arg.startswith("--"):
        return arg.split("=", 1)[0].replace("_", "-")
    if arg.startswith("-") and len(arg) > 1 and not arg[1].isdigit() and arg[1] != ".":
        return arg.split("=", 1)[0]
    return None


def option_value(args: Sequence[str], name: str) -> str | None:
    """Returns the value of option ``name`` in ``args`` (``--x V`` or ``--x=V``; last wins), or None."""
    value = None
    for i, arg in enumerate(args):
        if option_name(arg) != name:
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def _llmgw_problem(engine: str, option: str) -> str | None:
    """Returns why llmgw option ``option`` (``--llmgw-*``) is refused for ``engine``, or None."""
    if option in LLMGW_OPTIONS.get(engine, ()):
        return None
    if option in RETIRED_OPTIONS:
        return f"{option} is no longer an llmgw option: {RETIRED_OPTIONS[option]}"
    known = ", ".join(sorted(LLMGW_OPTIONS.get(engine, ()))) or "none"
    return f"{option} is not an llmgw option for engine {engine!r} (known: {known})"


def _llama_arg_problem(engine: str, name: str, value: str, version: str | None) -> str | None:
    """Returns why llama-server variable ``name`` (``LLAMA_ARG_*``) set to ``value`` is refused, or None."""
    table = table_for(engine)
    option = table.by_env.get(name) if table is not None else None
    if option is None:
        what = table.describe(version) if table is not None else engine
        return f"not allowed: it is not an option variable classified for {what}"
    if option.refused is not None:
        return f"not allowed: llama-server reads it as {option.name} is not allowed: {option.refused}"
    if option.values and option.allowed_values is not None and value not in option.allowed_values:
        return (f"not allowed: llama-server reads it as {option.name} {value!r}, not one of the safe values "
                f"({', '.join(option.allowed_values)})")
    return None


#: Allowed for every engine although ``PYTHON*`` is refused: vLLM seeds its block hashes with
#: it. The agent sets :data:`llmgw.kvhash.KV_HASH_SEED`; a profile that sets another value
#: BREAKS precise KV routing (the router's hashes no longer match the engine's, which the
#: router's hash-agreement check reports as an alarm). Meant for tests of that alarm.
HASH_SEED_ENV = "PYTHONHASHSEED"


def _env_problem(engine: str, name: str, value: str, version: str | None) -> str | None:
    """Returns why variable ``name`` (set to ``value``) is refused for ``engine``, or None."""
    if name == HASH_SEED_ENV:
        return None
    families = ENV_FAMILIES.get(engine, _COMMON_FAMILIES)
    if name.startswith(_LLAMA_ARG_PREFIX) and f"{_LLAMA_ARG_PREFIX}*" in families:
        problem = _llama_arg_problem(engine, name, value, version)
        if problem is not None:
            return problem
    for pattern, reason in REFUSED_ENV_NAMES:
        if fnmatch.fnmatchcase(name, pattern):
            return f"not allowed: {reason}"
    if name in AGENT_ENV.get(engine, ()):
        return "not allowed: the agent sets it itself"
    if engine in FREE_ENV_ENGINES:
        return None
    if not any(fnmatch.fnmatchcase(name, pattern) for pattern in families):
        return (
            f"not allowed: only tuning variables may be set for {engine} "
            f"({', '.join(families)})"
        )
    return None


def violations(
    engine: str, args: Sequence[str], env: Mapping[str, str], *, version: str | None = None,
    table: Table | None = None,
) -> list[Violation]:
    """Returns every refused argument and variable of a profile for ``engine`` (empty: all allowed).

    ``version``: the engine version that will run them, when known (the node knows it; the
    catalog does not): named in the refusal of an option the table does not know. ``table``:
    the classified options (default: ``engine``'s, :func:`~llmgw.catalog.engine_flags.table_for`;
    an engine with none has every argument refused).
    """
    problems: list[Problem] = []
    items: list[tuple[int, str]] = []
    for i, arg in enumerate(args):
        option = option_name(arg)
        if option is not None and option.startswith("--llmgw-"):
            problem = _llmgw_problem(engine, option)
            if problem is not None:
                problems.append(Problem(i, option, problem))
            continue
        items.append((i, arg))
    table = table or table_for(engine)
    if table is None:
        problems += [Problem(i, arg, f"{arg} is not allowed: llmgw has no classified options for engine {engine!r}")
                     for i, arg in items]
    else:
        problems += read(table, items, running=version)[1]
    problems.sort(key=lambda p: p.index)
    found = [Violation(f"engine_args[{p.index}]", p.subject, p.reason) for p in problems]
    for name, value in env.items():
        problem = _env_problem(engine, name, value, version)
        if problem is not None:
            found.append(Violation(f"engine_env.{name}", name, problem))
    return found


def _block_size_problem(engine: str, value: str, on_cpu: bool | None) -> str | None:
    """Returns why ``--block-size value`` cannot run for ``engine`` (on a CPU when ``on_cpu``), or None."""
    if engine not in BLOCK_SIZE_ENGINES:
        return None
    if not value.isdigit() or int(value) <= 0:
        return f"--block-size {value} is not a positive integer (tokens per KV block)"
    if engine == "vllm" and on_cpu and int(value) % VLLM_CPU_BLOCK_MULTIPLE:
        return (
            f"--block-size {value} does not work on a CPU (profile.gpus 0): vLLM's CPU attention needs "
            f"a multiple of {VLLM_CPU_BLOCK_MULTIPLE} (default {VLLM_CPU_BLOCK_SIZE})"
        )
    return None


def device_violations(engine: str, args: Sequence[str], *, on_cpu: bool | None) -> list[Violation]:
    """Returns every argument ``engine`` would refuse on the device kind it runs on.

    ``on_cpu``: the shard runs on CPUs (True), on GPUs (False), or either (None: only
    what every device kind refuses). Empty: the engine takes them all.
    """
    found: list[Violation] = []
    for i, arg in enumerate(args):
        if option_name(arg) != "--block-size":
            continue
        value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
        problem = _block_size_problem(engine, value, on_cpu)
        if problem is not None:
            found.append(Violation(f"engine_args[{i}]", "--block-size", problem))
    return found


def check(engine: str, args: Sequence[str], env: Mapping[str, str], *, version: str | None = None) -> None:
    """Returns None if the profile is allowed; raises :class:`UnsafeSetting` listing every problem."""
    found = violations(engine, args, env, version=version)
    if found:
        raise UnsafeSetting(found)


def llmgw_options(engine: str, args: Sequence[str]) -> tuple[set[str], list[str]]:
    """Splits ``args`` into (llmgw's own options present, the engine's args without them)."""
    own = LLMGW_OPTIONS.get(engine, frozenset())
    present = {a for a in args if option_name(a) in own}
    return present, [a for a in args if option_name(a) not in own]
