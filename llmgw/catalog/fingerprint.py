"""The fingerprint of a model definition: what a running replica must match to be current.

A rollout replaces replicas whose fingerprint differs from their catalog model's. The
fingerprint covers what the model decides about each of its shards: engine, source,
engine arguments and environment, adapters, ``max_loaded_adapters`` and the resources a
replica reserves (memory, cores, GPU count), and the node labels and GPU class it asks for. It leaves out what placement decides (shard id,
node, which GPU indices) and the replica count (scaling is not a rollout).

Public API::

    model_fingerprint(model) -> str   # what placement puts into each new ShardSpec
    shard_fingerprint(spec) -> str    # what a running shard carries (or, when it carries none, its fields give)

Both agree: a shard placed from a model has the model's fingerprint, whichever way it is
computed. Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterable, Mapping

from llmgw.spec import Adapter, ModelSpec, ShardSpec

#: Hex digits kept of the SHA-256: 64 bits tell definitions apart and fit a table column.
FINGERPRINT_HEX_DIGITS = 16


def definition_fingerprint(
    *,
    engine: str,
    source: str,
    args: Iterable[str],
    env: Mapping[str, str],
    adapters: Iterable[Adapter],
    max_loaded_adapters: int,
    memory_mb: int,
    cpu_cores: float,
    gpus: int,
    node_labels: Mapping[str, str] | None = None,
    gpu_class: str = "",
) -> str:
    """Returns the fingerprint (16 hex digits) of one definition's shard-deciding fields.

    Argument order matters (engines read it so); environment order does not. Negative
    resources count as 0, as placement reserves them. ``node_labels`` count only when some
    are set: changing them moves replicas (a rollout places the new ones on matching nodes),
    and a definition without any keeps the fingerprint it had before labels existed.
    """
    data = {
        "engine": engine,
        "source": source,
        "args": list(args),
        "env": sorted((str(k), str(v)) for k, v in env.items()),
        "adapters": [[a.name, a.source] for a in adapters],
        "max_loaded_adapters": int(max_loaded_adapters),
        "memory_mb": max(0, int(memory_mb)),
        "cpu_cores": max(0.0, float(cpu_cores)),
        "gpus": max(0, int(gpus)),
    }
    if node_labels:
        data["node_labels"] = sorted(node_labels.items())
    if gpu_class:  # likewise: only when set
        data["gpu_class"] = gpu_class
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:FINGERPRINT_HEX_DIGITS]


def model_fingerprint(model: ModelSpec) -> str:
    """Returns the fingerprint every shard placed from ``model`` carries."""
    p = model.profile
    return definition_fingerprint(
        engine=model.engine,
        source=model.source,
        args=p.engine_args,
        env=p.engine_env,
        adapters=model.adapters,
        max_loaded_adapters=model.max_loaded_adapters,
        memory_mb=p.memory_mb,
        cpu_cores=p.cpu_cores,
        gpus=p.gpus,
        node_labels=p.node_labels,
        gpu_class=p.gpu_class,
    )


def shard_fingerprint(spec: ShardSpec) -> str:
    """Returns the fingerprint of the definition ``spec`` runs: the one it carries, or, for a
    shard started before fingerprints existed (it carries ""), the one its own fields give."""
    if spec.fingerprint:
        return spec.fingerprint
    return definition_fingerprint(
        engine=spec.engine,
        source=spec.source,
        args=spec.args,
        env=spec.env,
        adapters=spec.adapters,
        max_loaded_adapters=spec.max_loaded_adapters,
        memory_mb=spec.memory_mb,
        cpu_cores=spec.cpu_cores,
        gpus=len(spec.gpus),
    )
