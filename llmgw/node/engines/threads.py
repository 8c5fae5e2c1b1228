"""How many threads a CPU replica computes with, whatever its engine."""

from __future__ import annotations

import os

from llmgw.spec import ShardSpec


def default_threads(spec: ShardSpec, node_threads: int | None = None, cpu_count: int | None = None) -> int:
    """Returns the thread count for ``spec``: its cpu_cores (which placement reserved out of the
    node's CPUs), else the node's override (agent.yaml ``llamacpp.threads``), else half this
    machine's CPUs, at least 1: two engines spinning on every core each run several times
    slower than one on half of them."""
    if spec.cpu_cores >= 1:
        return int(spec.cpu_cores)
    if node_threads:
        return node_threads
    return max(1, (cpu_count or os.cpu_count() or 2) // 2)
