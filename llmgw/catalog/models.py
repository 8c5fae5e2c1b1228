"""Model validation: user input (YAML, JSON, CLI flags) -> ModelSpec, with precise errors.

:func:`validate_model` is the only way a model enters the catalog; every error names the
field path and the reason (``profile.replicas: must be an integer >= 0, got -1``).
:func:`llmgw.spec.model_to_dict` is its inverse. :func:`check_engine_args` applies the
engine argument/environment policy (:mod:`llmgw.catalog.engine_options`), which the node
applies again before it starts an engine. :func:`namespace_conflict` is the rule a write
checks against the rest of the catalog. Pure: no I/O.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, Mapping, Sequence

from llmgw.catalog.engine_options import device_violations, violations
from llmgw.catalog.sources import SourceError, is_remote, parse_source
from llmgw.labels import check_labels
from llmgw.spec import ADAPTER_ENGINES, FREE_SOURCE_ENGINES, ON_DEMAND_ADAPTER_ENGINES, Adapter, ModelSpec, Profile
from llmgw.spec import is_mig_class

__all__ = [
    "KNOWN_ENGINES",
    "NAME_PATTERN",
    "CatalogError",
    "check_engine_args",
    "namespace_conflict",
    "validate_model",
]

#: Engines a model may name; each has an adapter in llmgw/node/engines.
KNOWN_ENGINES = frozenset({"sim", "llama.cpp", "vllm", "sglang"})

NAME_PATTERN = r"[a-z0-9][a-z0-9._-]{0,62}"
_NAME_RE = re.compile(NAME_PATTERN)
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_TOP_KEYS = ("name", "engine", "source", "profile", "adapters", "max_loaded_adapters")
_ADAPTER_KEYS = ("name", "source")
_PROFILE_KEYS = ("replicas", "memory_mb", "cpu_cores", "gpus", "engine_args", "engine_env", "node_labels", "gpu_class")


class CatalogError(ValueError):
    """Invalid catalog input. ``path`` is the field (e.g. ``profile.replicas``), ``reason`` why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def _check_keys(data: Mapping[Any, Any], allowed: Sequence[str], prefix: str) -> None:
    for key in data:
        if key in allowed:
            continue
        path = f"{prefix}{key}"
        if not isinstance(key, str):
            raise CatalogError(path, "unknown key")
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(allowed))})"
        raise CatalogError(path, f"unknown key{hint}")


def _integer(data: Mapping[str, Any], key: str, default: int, path: str) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CatalogError(path, f"must be an integer >= 0, got {value!r}")
    return value


def _number(data: Mapping[str, Any], key: str, default: float, path: str) -> float:
    value = data.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise CatalogError(path, f"must be a number >= 0, got {value!r}")
    return float(value)


def _string(data: Mapping[str, Any], key: str, path: str, *, required: bool) -> str:
    if key not in data:
        if required:
            raise CatalogError(path, "required")
        return ""
    value = data[key]
    if not isinstance(value, str):
        raise CatalogError(path, f"must be a string, got {value!r}")
    return value


def _args(value: Any, path: str) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise CatalogError(path, f"must be a list of strings, got {value!r}")
    for i, arg in enumerate(value):
        if not isinstance(arg, str):
            raise CatalogError(f"{path}[{i}]", f"must be a string, got {arg!r}")
    return tuple(value)


def _env(value: Any, path: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise CatalogError(path, f"must be a mapping of variable names to strings, got {value!r}")
    for name, val in value.items():
        if not isinstance(name, str) or not _ENV_NAME_RE.fullmatch(name):
            raise CatalogError(f"{path}.{name}", "not a valid environment variable name")
        if not isinstance(val, str):
            raise CatalogError(f"{path}.{name}", f"must be a string, got {val!r}")
    return dict(value)


def check_engine_args(
    engine: str,
    args: Sequence[str],
    env: Mapping[str, str],
    *,
    path: str = "profile",
    on_cpu: bool | None = None,
) -> None:
    """Refuse engine arguments and environment that the engine policy does not allow.

    Returns None if ``args`` and ``env`` are acceptable for ``engine``; otherwise raises
    CatalogError naming every offending argument (``{path}.engine_args[i]``) and variable
    (``{path}.engine_env.NAME``) and why, in one message (its ``path`` is the first one's),
    so that one fix of the profile is enough. The policy (the options each engine version's
    table classifies safe, :mod:`llmgw.catalog.engine_flags`; an allowlist of tuning
    variables) is
    :mod:`llmgw.catalog.engine_options`, which the node applies again before start; with
    ``on_cpu`` (None: the device kind is not known) values the engine refuses on that kind
    of device are refused too.
    """
    found = [*violations(engine, args, env), *device_violations(engine, args, on_cpu=on_cpu)]
    if found:
        first, *rest = found
        reason = "; ".join([first.reason, *(f"{path}.{v.where}: {v.reason}" for v in rest)])
        raise CatalogError(f"{path}.{first.where}", reason)


def _profile(engine: str, data: Any) -> Profile:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise CatalogError("profile", f"must be a mapping, got {data!r}")
    _check_keys(data, _PROFILE_KEYS, "profile.")
    replicas = _integer(data, "replicas", 1, "profile.replicas")
    memory_mb = _integer(data, "memory_mb", 0, "profile.memory_mb")
    cpu_cores = _number(data, "cpu_cores", 0.0, "profile.cpu_cores")
    gpus = _integer(data, "gpus", 0, "profile.gpus")
    args = _args(data.get("engine_args", ()), "profile.engine_args")
    env = _env(data.get("engine_env", {}), "profile.engine_env")
    check_engine_args(engine, args, env, on_cpu=gpus == 0)
    try:
        node_labels = check_labels(data.get("node_labels") or {})
    except ValueError as exc:
        raise CatalogError("profile.node_labels", str(exc)) from None
    gpu_class = _gpu_class(data.get("gpu_class") or "", gpus)
    return Profile(
        replicas=replicas,
        memory_mb=memory_mb,
        cpu_cores=cpu_cores,
        gpus=gpus,
        engine_args=args,
        engine_env=env,
        node_labels=node_labels,
        gpu_class=gpu_class,
    )


#: A GPU class as discovery names them: "h100-80g", "rtx-3080-10g", "a100-80g-mig-3g.40gb".
_GPU_CLASS = re.compile(r"[a-z0-9][a-z0-9.-]{0,79}")
def _gpu_class(value: Any, gpus: int) -> str:
    """Returns ``profile.gpu_class`` checked; a MIG class takes exactly one instance per replica.

    Raises CatalogError for a malformed class, or a MIG class with ``gpus`` other than 1 (tensor,
    pipeline and data parallelism and several nodes come only from ``gpus``: the engine policy
    refuses those options in ``engine_args``, so one instance means one device).
    """
    if not value:
        return ""
    if not isinstance(value, str) or not _GPU_CLASS.fullmatch(value):
        raise CatalogError("profile.gpu_class", f"expected a GPU class as `llmgw ctl nodes` shows them "
                           f"(lower case, e.g. h100-80g or a100-80g-mig-3g.40gb), got {value!r}")
    if is_mig_class(value):
        if gpus != 1:
            raise CatalogError("profile.gpus", f"a replica on a MIG class ({value}) runs on exactly one instance: "
                               f"gpus must be 1, got {gpus}")
    elif gpus < 1:
        raise CatalogError("profile.gpu_class", f"a GPU class ({value}) needs gpus of 1 or more, got {gpus}")
    return value


def _check_source(source: str, path: str, engine: str, what: str) -> None:
    """Raises CatalogError unless ``source`` is an absolute local path, an http(s) URL or hf://org/repo."""
    if is_remote(source):
        try:
            parse_source(source)
        except SourceError as exc:
            raise CatalogError(path, str(exc)) from None
    elif not source.startswith("/"):
        raise CatalogError(
            path,
            f"must be an absolute local path, an http(s) URL or hf://org/repo[@rev] for {what}engine "
            f"{engine!r}, got {source!r}",
        )
    if "\0" in source:
        raise CatalogError(path, "must not contain a NUL character")


def _adapters(engine: str, model: str, data: Any) -> tuple[Adapter, ...]:
    """Returns the adapters listed in ``data`` (a list of {name, source} mappings)."""
    if data is None:
        return ()
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence):
        raise CatalogError("adapters", f"must be a list of {{name, source}} mappings, got {data!r}")
    if data and engine not in ADAPTER_ENGINES:
        raise CatalogError(
            "adapters",
            f"engine {engine!r} does not serve LoRA adapters through llmgw "
            f"(engines that do: {', '.join(sorted(ADAPTER_ENGINES))})",
        )
    adapters: list[Adapter] = []
    seen: set[str] = set()
    for i, item in enumerate(data):
        path = f"adapters[{i}]"
        if not isinstance(item, Mapping):
            raise CatalogError(path, f"must be a mapping with name and source, got {item!r}")
        _check_keys(item, _ADAPTER_KEYS, f"{path}.")
        name = _string(item, "name", f"{path}.name", required=True)
        if not _NAME_RE.fullmatch(name):
            raise CatalogError(f"{path}.name", f"must match {NAME_PATTERN}, got {name!r}")
        if name == model:
            raise CatalogError(
                f"{path}.name",
                f"{name!r} is the model's own name; adapter names share the model namespace: choose another",
            )
        if name in seen:
            raise CatalogError(f"{path}.name", f"adapter {name!r} is listed twice")
        seen.add(name)
        source = _string(item, "source", f"{path}.source", required=True)
        if engine in FREE_SOURCE_ENGINES:  # the simulator loads no files: any non-empty label
            if not source or "\0" in source:
                raise CatalogError(f"{path}.source", f"must be a non-empty string without NUL, got {source!r}")
        else:
            _check_source(source, f"{path}.source", engine, "an adapter of ")
        adapters.append(Adapter(name=name, source=source))
    return tuple(adapters)


def _max_loaded(engine: str, data: Mapping[str, Any], adapters: tuple[Adapter, ...]) -> int:
    value = _integer(data, "max_loaded_adapters", 0, "max_loaded_adapters")
    if value and engine not in ON_DEMAND_ADAPTER_ENGINES:
        raise CatalogError(
            "max_loaded_adapters",
            f"engine {engine!r} loads every adapter at start and cannot swap them at run time; "
            "remove max_loaded_adapters (or set it to 0)",
        )
    if value and not adapters:
        raise CatalogError("max_loaded_adapters", "the model has no adapters; list them under adapters first")
    return value


def namespace_conflict(spec: ModelSpec, others: Sequence[ModelSpec]) -> str | None:
    """Returns why ``spec`` cannot join a catalog holding ``others`` (every other entry), or None.

    Model and adapter names share one namespace (a request's ``model`` may name either), so
    neither the model's name nor any of its adapters' may be another entry's model or
    adapter name. The message names the clash and what to do.
    """
    taken: dict[str, str] = {}
    for other in others:
        if other.name == spec.name:
            continue
        taken[other.name] = f"model {other.name!r}"
        for adapter in other.adapters:
            taken[adapter.name] = f"an adapter of model {other.name!r}"
    for name in (spec.name, *(a.name for a in spec.adapters)):
        if name in taken:
            what = "model" if name == spec.name else "adapter"
            return (
                f"{what} name {name!r} is already taken by {taken[name]} "
                "(model and adapter names share one namespace): choose another name"
            )
    return None


def validate_model(data: Mapping[str, Any]) -> ModelSpec:
    """Return the ModelSpec that ``data`` describes.

    ``data`` has ``name``, ``engine``, ``source`` (an absolute local path, http(s) URL or
    hf:// repository; free-form and optional for the sim engine), an optional ``profile``
    mapping (Profile's fields; missing ones take Profile's defaults), optional ``adapters``
    (a list of ``{name, source}``: LoRA adapters, names unique and not the model's own) and
    ``max_loaded_adapters`` (0: all loaded at start; N > 0 only for vllm and sim). Names
    clashing with *other* catalog entries are checked at write time
    (:func:`namespace_conflict`). Raises CatalogError naming the first field that
    is missing, unknown or invalid, and why. Types are not coerced: ``"2"`` is not an integer.
    """
    if not isinstance(data, Mapping):
        raise CatalogError("model", f"must be a mapping, got {data!r}")
    _check_keys(data, _TOP_KEYS, "")
    name = _string(data, "name", "name", required=True)
    if not _NAME_RE.fullmatch(name):
        raise CatalogError("name", f"must match {NAME_PATTERN}, got {name!r}")
    if "engine" not in data:
        raise CatalogError("engine", f"required: one of {', '.join(sorted(KNOWN_ENGINES))} (ctl models add --engine)")
    engine = _string(data, "engine", "engine", required=True)
    if engine not in KNOWN_ENGINES:
        raise CatalogError(
            "engine", f"unknown engine {engine!r} (known: {', '.join(sorted(KNOWN_ENGINES))})"
        )
    source = _string(data, "source", "source", required=engine not in FREE_SOURCE_ENGINES)
    if engine not in FREE_SOURCE_ENGINES:
        _check_source(source, "source", engine, "")
    profile = _profile(engine, data.get("profile"))
    adapters = _adapters(engine, name, data.get("adapters"))
    return ModelSpec(
        name=name,
        engine=engine,
        source=source,
        profile=profile,
        adapters=adapters,
        max_loaded_adapters=_max_loaded(engine, data, adapters),
    )
