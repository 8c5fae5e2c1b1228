"""Benchmark: ``llmgw.control.placement.plan`` on synthetic fleets of 100 to 5,000 nodes.

Run::

    python bench/placement.py            # 100, 1,000 and 5,000 nodes (under 2 minutes on 2 cores)
    python bench/placement.py --quick    # fewer runs per figure (under 20 s)

For each fleet size three passes are timed (median of several runs, each with a fresh
deterministic id factory, so every run plans exactly the same thing):

* ``first``: every node ONLINE and empty, the whole catalog to place (all starts);
* ``steady``: the first pass's starts applied as READY shards: nothing left to do;
* ``lost``: the steady fleet with 1% of its nodes LOST for longer than the replace
  grace: their replicas are started elsewhere.

The ratios compare each size with the 100-node steady pass measured in the same run
(``steady_vs_100``) and the time per node (``per_node_us``; ``per_node_vs_100`` is 1.0
for linear scaling). Human progress goes to stderr; the last line of stdout is one JSON
object. A pass that does not produce the expected actions (the steady pass must start
and stop nothing; the lost pass must replace exactly the lost nodes' replicas, less what
is unplaceable) makes the benchmark exit with status 1: its timing would mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmgw.control.placement import (  # noqa: E402
    Action,
    SequentialIds,
    StartReplica,
    StopReplica,
    Unplaceable,
    Waiting,
    plan,
)
from llmgw.control.registry import Fleet, NodeState, NodeView, ShardView  # noqa: E402
from llmgw.spec import (  # noqa: E402
    EngineInfo,
    GpuInfo,
    Hardware,
    ModelSpec,
    Profile,
    ShardSpec,
    ShardState,
    ShardStatus,
)

# Fleet sizes timed; the first is the baseline every ratio is taken against.
BASELINE_NODES = 100
SIZES = (BASELINE_NODES, 1_000, 5_000)
# Runs per pass (the median is reported). Chosen so the full run stays under 2 minutes
# and --quick under 20 s on 2 shared cores; small fleets get more runs because a single
# millisecond-scale run is at the mercy of the scheduler.
RUNS = {100: 101, 1_000: 31, 5_000: 11}
QUICK_RUNS = {100: 21, 1_000: 5, 5_000: 3}
# Share of nodes with 8 GPUs; the rest are CPU-only inference boxes.
GPU_NODE_SHARE = 0.4
# One catalog model per this many nodes, each with 1-8 replicas: about 1.1 replicas per
# node. Placement spreads GPU replicas over every GPU node but stacks CPU replicas on the
# CPU nodes with the most free memory, so about 60% of the nodes end up holding replicas.
NODES_PER_MODEL = 4
MAX_REPLICAS = 8
# Share of catalog models that need GPUs (vLLM), and the GPUs per replica they ask for.
GPU_MODEL_SHARE = 0.35
GPUS_PER_REPLICA = (1, 2, 2, 4, 4, 8)
# Share of nodes that go LOST in the third pass. They are drawn from the nodes holding
# replicas: a LOST empty node changes nothing, and at 100 nodes 1% is a single node.
LOST_SHARE = 0.01
# The planning clock, far from zero so `since` and `lost_since` values are plausible.
NOW = 100_000.0
SEED = 20240601

# (name, total MB) of the GPU types a GPU node may carry (8 of one type).
GPU_TYPES = (
    ("NVIDIA H100 80GB HBM3", 81_559),
    ("NVIDIA A100-SXM4-40GB", 40_960),
    ("NVIDIA L40S", 46_068),
)
# Memory the driver and the CUDA context keep on each GPU: never free.
GPU_RESERVED_MB = 600


def _gpu_node(i: int, rng: random.Random) -> NodeView:
    gpu_name, gpu_mb = rng.choice(GPU_TYPES)
    gpus = tuple(
        GpuInfo(index=g, uuid=f"GPU-{i:05d}-{g}", name=gpu_name, memory_total_mb=gpu_mb,
                memory_free_mb=gpu_mb - GPU_RESERVED_MB)
        for g in range(8)
    )
    memory = rng.choice((1_048_576, 2_097_152))
    hw = Hardware(cpu_count=rng.choice((128, 192, 224)), memory_total_mb=memory,
                  memory_available_mb=memory - 16_384, gpus=gpus)
    engines = (
        EngineInfo("vllm", installed=True, version="0.8.5"),
        EngineInfo("llama.cpp", installed=True, version="b5000"),
        EngineInfo("sim", installed=True, version="0.1.0"),
    )
    return _node(f"gpu-{i:05d}", i, hw, engines)


def _cpu_node(i: int, rng: random.Random) -> NodeView:
    memory = rng.choice((131_072, 262_144, 524_288))
    hw = Hardware(cpu_count=rng.choice((32, 64, 96)), memory_total_mb=memory,
                  memory_available_mb=memory - 4_096, gpu_note="no GPUs: NVML library not found")
    # One CPU node in ten can install llama.cpp but has not yet: placement must skip it.
    llama_installed = rng.random() >= 0.1
    engines = (
        EngineInfo("llama.cpp", installed=llama_installed, version="b5000" if llama_installed else "",
                   installable=True),
        EngineInfo("sim", installed=True, version="0.1.0"),
    )
    return _node(f"cpu-{i:05d}", i, hw, engines)


def _node(node_id: str, i: int, hw: Hardware, engines: tuple[EngineInfo, ...]) -> NodeView:
    return NodeView(
        id=node_id,
        address=f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}",
        hardware=hw,
        engines=engines,
        state=NodeState.ONLINE,
        last_heartbeat=NOW - 1.0,
        epoch=i + 1,
    )


def build_nodes(count: int, rng: random.Random) -> list[NodeView]:
    """Return ``count`` ONLINE nodes without shards: GPU_NODE_SHARE of them 8-GPU nodes."""
    gpu_count = round(count * GPU_NODE_SHARE)
    nodes = [_gpu_node(i, rng) for i in range(gpu_count)]
    nodes += [_cpu_node(i, rng) for i in range(count - gpu_count)]
    rng.shuffle(nodes)
    return nodes


def build_catalog(node_count: int, rng: random.Random) -> list[ModelSpec]:
    """Return ``node_count / NODES_PER_MODEL`` models with 1..MAX_REPLICAS replicas each."""
    models = []
    for i in range(max(1, node_count // NODES_PER_MODEL)):
        replicas = rng.randint(1, MAX_REPLICAS)
        if rng.random() < GPU_MODEL_SHARE:
            gpus = rng.choice(GPUS_PER_REPLICA)
            profile = Profile(replicas=replicas, gpus=gpus,
                              memory_mb=rng.choice((16_000, 24_000, 36_000, 70_000)),
                              engine_args=("--max-model-len", "8192"))
            models.append(ModelSpec(f"gpu-model-{i:05d}", "vllm", f"/models/gpu-{i}", profile))
        else:
            engine = "llama.cpp" if rng.random() < 0.8 else "sim"
            profile = Profile(replicas=replicas, memory_mb=rng.choice((4_096, 8_192, 16_384, 32_768, 65_536)),
                              cpu_cores=float(rng.choice((4, 8, 16))), engine_args=("--ctx-size", "4096"))
            models.append(ModelSpec(f"cpu-model-{i:05d}", engine, f"/models/cpu-{i}.gguf", profile))
    return models


def make_fleet(nodes: Sequence[NodeView], shards: Mapping[str, Mapping[str, ShardView]] | None = None,
               lost: frozenset[str] = frozenset(), replace_grace: float = 60.0) -> Fleet:
    """Return a Fleet of ``nodes`` with ``shards`` (node id -> shard id -> view) and the
    ``lost`` node ids LOST for longer than ``replace_grace``."""
    shards = shards or {}
    views = {}
    for node in nodes:
        gone = node.id in lost
        views[node.id] = NodeView(
            id=node.id, address=node.address, hardware=node.hardware, engines=node.engines,
            state=NodeState.LOST if gone else NodeState.ONLINE, last_heartbeat=node.last_heartbeat,
            epoch=node.epoch, shards=shards.get(node.id, {}),
            lost_since=NOW - replace_grace - 1.0 if gone else None,
        )
    return Fleet(nodes=views, replace_grace=replace_grace, version=1)


def ready_shards(actions: Sequence[Action]) -> dict[str, dict[str, ShardView]]:
    """Return the READY shards the StartReplica ``actions`` would become, by node id."""
    out: dict[str, dict[str, ShardView]] = {}
    for n, action in enumerate(a for a in actions if isinstance(a, StartReplica)):
        spec: ShardSpec = action.shard_spec
        status = ShardStatus(id=spec.id, state=ShardState.READY, endpoint=f"http://{action.node_id}:{8000 + n % 1000}",
                             pid=10_000 + n)
        out.setdefault(action.node_id, {})[spec.id] = ShardView(spec, status, since=NOW - 3_600.0 + n * 0.001)
    return out


def count(actions: Sequence[Action]) -> dict[str, int]:
    """Return the number of actions of each kind (and unplaceable replicas)."""
    return {
        "actions": len(actions),
        "starts": sum(isinstance(a, StartReplica) for a in actions),
        "stops": sum(isinstance(a, StopReplica) for a in actions),
        "waiting": sum(isinstance(a, Waiting) for a in actions),
        "unplaceable_replicas": sum(a.missing for a in actions if isinstance(a, Unplaceable)),
    }


def time_plan(desired: Sequence[ModelSpec], fleet: Fleet, runs: int) -> tuple[float, list[Action], list[float]]:
    """Run ``plan`` ``runs`` times; return (median seconds, the actions, all timings).

    Each run gets a fresh SequentialIds factory, so all runs return the same actions.
    A full garbage collection before each run keeps one run's garbage out of the next.
    """
    timings = []
    actions: list[Action] = []
    for _ in range(runs):
        new_id: Callable[[str], str] = SequentialIds()
        gc.collect()
        start = time.perf_counter()
        actions = plan(desired, fleet, now=NOW, new_id=new_id)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings), actions, timings


class BenchError(RuntimeError):
    """A pass produced actions that contradict what the fleet should need."""


def bench_size(node_count: int, runs: int, seed: int) -> dict[str, Any]:
    """Time the three passes on a fleet of ``node_count`` nodes; return their figures.

    Raises :class:`BenchError` if a pass returns the wrong kind of actions.
    """
    rng = random.Random(seed + node_count)
    nodes = build_nodes(node_count, rng)
    catalog = build_catalog(node_count, rng)
    result: dict[str, Any] = {
        "nodes": node_count,
        "gpu_nodes": sum(bool(n.hardware.gpus) for n in nodes),
        "models": len(catalog),
        "gpu_models": sum(m.profile.gpus > 0 for m in catalog),
        "replicas_wanted": sum(m.profile.replicas for m in catalog),
        "runs": runs,
    }

    def record(name: str, fleet: Fleet) -> list[Action]:
        seconds, actions, timings = time_plan(catalog, fleet, runs)
        result[name] = {
            "seconds": seconds,
            "min_seconds": min(timings),
            "per_node_us": seconds / node_count * 1e6,
            **count(actions),
        }
        print(f"  {node_count:>5} nodes  {name:<6} {seconds * 1e3:9.2f} ms  "
              f"({len(actions)} actions, {runs} runs)", file=sys.stderr)
        return actions

    first = record("first", make_fleet(nodes))
    shards = ready_shards(first)
    result["nodes_holding_replicas"] = len(shards)
    result["gpus_reserved_share"] = (
        sum(len(s.spec.gpus) for on_node in shards.values() for s in on_node.values())
        / max(1, sum(len(n.hardware.gpus) for n in nodes))
    )

    steady = record("steady", make_fleet(nodes, shards))
    if any(isinstance(a, (StartReplica, StopReplica)) for a in steady):
        raise BenchError(f"{node_count} nodes: the steady pass still starts or stops replicas")

    lost_count = max(1, round(node_count * LOST_SHARE))
    lost = frozenset(rng.sample(sorted(shards), min(lost_count, len(shards))))
    after = record("lost", make_fleet(nodes, shards, lost))
    on_lost = sum(len(shards.get(node_id, {})) for node_id in lost)
    result["lost"].update(lost_nodes=lost_count, replicas_on_lost_nodes=on_lost)
    c = result["lost"]
    if c["stops"] or c["starts"] + c["unplaceable_replicas"] - result["steady"]["unplaceable_replicas"] != on_lost:
        raise BenchError(
            f"{node_count} nodes: {on_lost} replicas were on LOST nodes but the pass started "
            f"{c['starts']} and stopped {c['stops']}"
        )
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print progress to stderr and the JSON result as stdout's last line.

    Returns the exit status: 0, or 1 if a pass produced the wrong actions.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs per figure (under 20 s)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                        help=f"fleet sizes to time ({BASELINE_NODES} is always added: it is the baseline)")
    parser.add_argument("--runs", type=int, default=0, help="runs per pass (default: by size)")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)

    sizes = sorted({BASELINE_NODES, *args.sizes})
    table = QUICK_RUNS if args.quick else RUNS
    started = time.perf_counter()
    print(f"placement.plan benchmark ({'quick' if args.quick else 'full'}), sizes {sizes}", file=sys.stderr)
    results = []
    try:
        for size in sizes:
            runs = args.runs or table.get(size, min(table.values()))
            results.append(bench_size(size, runs, args.seed))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    base = results[0]
    for r in results:
        for name in ("first", "steady", "lost"):
            r[name]["vs_100"] = r[name]["seconds"] / base[name]["seconds"]
            r[name]["per_node_vs_100"] = r[name]["per_node_us"] / base[name]["per_node_us"]
    out = {
        "benchmark": "placement.plan",
        "mode": "quick" if args.quick else "full",
        "baseline": f"the same pass at {BASELINE_NODES} nodes, measured in this run",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "seed": args.seed,
        "sizes": results,
        "ratios": {
            "steady_vs_100": {str(r["nodes"]): r["steady"]["vs_100"] for r in results},
            "steady_per_node_vs_100": {str(r["nodes"]): r["steady"]["per_node_vs_100"] for r in results},
            "first_per_node_vs_100": {str(r["nodes"]): r["first"]["per_node_vs_100"] for r in results},
            "lost_per_node_vs_100": {str(r["nodes"]): r["lost"]["per_node_vs_100"] for r in results},
        },
        "wall_seconds": time.perf_counter() - started,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
