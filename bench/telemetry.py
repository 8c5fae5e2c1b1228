"""Benchmark: what node telemetry (issue 16) costs the agent and the control plane.

Run::

    python bench/telemetry.py            # both parts (about 2.5 minutes on 2 shared cores)
    python bench/telemetry.py --quick    # fewer rounds, one 10 s window per mode (about 1 minute)
    python bench/telemetry.py --only agent      # or --only fleet; --nodes, --clients, --window, --rounds

**Part 1, the agent** (``agent`` in the JSON): :class:`llmgw.node.telemetry.sampler.NodeSampler`
on this machine's real /proc and /sys, with 4 engine process groups (``sleep`` processes,
each the leader of its own session) passed as ``engine_groups``. Its clock is a stand-in
advanced by :data:`~llmgw.telemetry.SAMPLE_INTERVAL_S` (10 s) between calls, so every call
is a real sample (host, groups, cards); a round is 6 calls (one simulated minute, so the
kernel log is read once per round, as it is once a minute on a node with cards), with 30 ms
of real time between calls (not timed) so the kernel's CPU counters move and every sample
computes its rates. Variants:

* ``no_cards``: the host as it is (NVML cannot be imported, nvidia-smi is not installed);
* ``a100_recorded``: nvidia-smi is a stand-in printing recorded output of one A100-SXM4-80GB
  in MIG mode (tests/fixtures/gpu-telemetry/telegraf-a100-sxm4-v12.xml for ``-q -x``, and
  the GPU 0 lines of tests/fixtures/nvidia-smi/telegraf-issue-5812-a100-sxm4-80gb-mig-L.txt,
  the same machine, for ``-L``), so the parse of a real card's XML is counted;
* ``a100_x8``: the same card eight times in one log (distinct UUIDs and bus ids), the size
  of an 8-GPU node's answer.

With cards, the kernel log is read for XID lines by the agent's own watcher (``journalctl``,
a child process: its CPU is ``children_cpu_s_per_sample``). The nvidia-smi program's own CPU
(the driver's work: up to seconds on an 8-card node without persistence mode) and NVML are
not measured: there is no GPU here.

Figures per variant: ``cpu_s_per_sample`` (this process's CPU time per real sample, median
over rounds; ``_min`` the lowest round), ``children_cpu_s_per_sample``, ``wall_s_per_sample``,
``share_of_one_core`` (CPU of one sample per 10 s, children included), ``cached_sample_us``
(a call between samples: the agent calls the sampler every 2 s heartbeat),
``telemetry_dict_us`` (``convert.telemetry_dict``), ``message_us`` (building the capnp
``Telemetry`` from that dict and ``to_bytes()``), ``message_bytes``, and the whole
heartbeat path per 10 s as the agent runs it (one sample, four cached calls, five
``telemetry_dict`` conversions, one message with telemetry): ``heartbeat_path_cpu_s_per_10s``
and ``heartbeat_path_share_of_one_core``. ``fleet_node_telemetry`` gives the conversion and
message figures for part 2's simulated 8-GPU telemetry.

**Part 2, the control plane** (``fleet``): ``--nodes`` (1,000) simulated agents heartbeat a
server process through real Cap'n Proto RPC over TCP on 127.0.0.1, llmgw's trio backend on
both sides (``capnp_runtime``, ``trio.serve_tcp`` + ``serve_stream``, ``open_client``), no TLS.
The server holds a real :class:`~llmgw.control.registry.Registry` (its watchdog running; nodes
lost only after an hour, so a slow start loses none) with every node joined, and serves each
accepted connection the real ``NodeDesk`` of one node (``NodeSession(...).desk()``), so every
heartbeat runs the control plane's own handler: ``convert.hardware_from``, ``convert.telemetry_from``
when the call carries telemetry, ``Registry.heartbeat``. It counts heartbeats in a ``Registry``
subclass and reports its own CPU time (``time.process_time``, every thread) when asked.
``--clients`` (4) client processes hold one connection per node; each node heartbeats every
``DEFAULT_HEARTBEAT_INTERVAL`` (2 s), the nodes' first beats spread evenly over the interval.
Each node has 8 GPUs in its ``Hardware``; its telemetry has 8 cards with every reading in
``GPU_READINGS`` and 2 throttle reasons, every ``HOST_READINGS``, 8 shard usages, 2 foreign
processes and 1 XID count. Modes, each in every round, in this order:

* ``bare`` (the baseline): every heartbeat carries hardware only;
* ``telemetry``: what agents send now: telemetry with every 5th heartbeat (a new sample every
  10 s), hardware only in between: 500 heartbeats/s, 100 of them with telemetry;
* ``every_beat``: telemetry with every heartbeat (what agents sent before they sent it only
  with a new sample): 500 heartbeats/s, all with telemetry.

A mode runs one interval before its window opens (every node has beaten in it), then the
server's CPU time and heartbeat counts are read at the start and end of a ``--window``-second
window (30 s in all per mode, full; 10 s quick). Figures per mode: ``server_cpu_share_of_one_core``
(server CPU seconds per second), ``server_cpu_us_per_heartbeat``, ``heartbeats_per_s_achieved``
and ``telemetry_heartbeats_per_s_achieved`` (counted by the server: what the clients really
delivered) against ``heartbeats_per_s_target``, and from the clients ``client_call_p50_ms`` /
``_p99_ms``, ``client_late_max_s`` (a beat that started late), ``client_errors`` and
``client_cpu_share``; ``idle`` is the server's CPU with every connection open and no heartbeat
(3 s, before the modes). ``ratios`` divides the server CPU share of each mode by ``bare``'s
(``ratios_by_round``: the median of each round's own ratio). ``server_extra_cpu_us_per_telemetry``
is what one heartbeat with telemetry costs over one without, from each mode against ``bare``
(``every_beat`` is the steadier estimate: 500 such heartbeats a second, not 100). ``summary``
repeats the headline figures (the top-level ``heartbeats_per_s_achieved`` is the
``telemetry`` mode's). ``goal`` checks issue 16's target: the ``telemetry`` mode under
20% of one core.
``scrape``: after the last mode, the server writes its fleet (every node with live telemetry)
as :class:`~llmgw.control.fleet_metrics.FleetMetrics` does for a scrape, 5 times: ``cpu_s``
(median, snapshot and text), ``trio_thread_cpu_s`` (the snapshot alone: the part on the trio
thread; the text is written in a worker thread), ``series``, ``bytes``.
``in_process_us``: the server's handler parts timed alone on the same messages
(``hardware_from``, ``telemetry_from``, ``Registry.heartbeat``), to tell them from the RPC
dispatch.

Human progress goes to stderr; the last line of stdout is one JSON object. A process that
fails, a client error or a server that reports no heartbeats makes it exit with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import resource
import select
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rpc import percentile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
A100_QUERY = FIXTURES / "gpu-telemetry" / "telegraf-a100-sxm4-v12.xml"
A100_LISTING = FIXTURES / "nvidia-smi" / "telegraf-issue-5812-a100-sxm4-80gb-mig-L.txt"

HOST = "127.0.0.1"

# Part 1: (rounds, calls timed for the cached sample and the conversions).
AGENT_FULL = (20, 300)
AGENT_QUICK = (5, 100)
#: Real samples per round: one simulated minute at one sample per 10 s.
SAMPLES_PER_ROUND = 6
#: Real time between two samples (not timed): long enough for /proc/stat's 10 ms ticks to move.
PAUSE_S = 0.03
#: Engine process groups the sampler walks.
ENGINE_GROUPS = 4

# Part 2: (rounds, window seconds).
FLEET_FULL = (3, 10.0)
FLEET_QUICK = (1, 10.0)
NODES = 1000
CLIENTS = 4
#: A heartbeat carries telemetry every this many beats (SAMPLE_INTERVAL_S / heartbeat interval).
TELEMETRY_EVERY = 5
MODES = ("bare", "telemetry", "every_beat")
#: Issue 16's goal: ingesting 1,000 agents' heartbeats takes under this share of one core.
GOAL_SHARE = 0.20
SCRAPES = 5
#: Seconds the server's CPU is measured with every connection open and no heartbeat.
IDLE_S = 3.0
IN_PROCESS_CALLS = 2000

# Bounds on the child processes: a hung one must fail the run, not stall it.
START_TIMEOUT = 60.0
CONNECT_TIMEOUT = 120.0
ANSWER_TIMEOUT = 60.0
STOP_TIMEOUT = 5.0


class BenchError(RuntimeError):
    """A process failed or a run produced something that makes its timing meaningless."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the simulated node (part 2's content; part 1 also times its conversion) --------------


def node_name(i: int) -> str:
    return f"node-{i:04d}"


def node_hardware(i: int) -> Any:
    """An 8-GPU node's hardware as its agent reports it (the same for every heartbeat)."""
    from llmgw.spec import GpuInfo, Hardware

    return Hardware(
        cpu_count=224, memory_total_mb=2_063_000, memory_available_mb=1_650_000,
        gpus=tuple(GpuInfo(g, f"GPU-{i:08x}-{g:04x}-4c1e-9a53-7d0b2f6e{g:04x}", "NVIDIA H100 80GB HBM3",
                           81_559, 60_000 + g, "h100-80g") for g in range(8)),
        disk_free_mb=3_200_000, disk_total_mb=7_000_000, driver_version="550.54.15", cuda_version="12.4",
        os="Ubuntu 22.04.4 LTS", arch="x86_64",
        cpu_flags=("avx", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16", "amx_int8"),
    )


def node_telemetry(i: int) -> Any:
    """A heavy node's sample: 8 cards with every reading, the whole host, 8 shards, 2 foreign
    processes, 1 XID count."""
    from llmgw.telemetry import (
        GPU_READINGS, HOST_READINGS, ForeignGpuProcess, GpuTelemetry, NodeTelemetry, ShardUsage, XidCount,
    )

    host = {name: 1000.0 + k * 17.25 for k, name in enumerate(HOST_READINGS)}
    gpus = tuple(
        GpuTelemetry(g, f"GPU-{i:08x}-{g:04x}-4c1e-9a53-7d0b2f6e{g:04x}", "h100-80g",
                     {name: 100.0 + g + k * 3.5 for k, name in enumerate(GPU_READINGS)},
                     ("sw_power_cap", "hw_slowdown"), 0.4)
        for g in range(8)
    )
    return NodeTelemetry(
        age_s=0.4, host=host, gpus=gpus,
        shards=tuple(ShardUsage(f"{node_name(i)}-shard-{s}", 3.75, 12_884_901_888) for s in range(8)),
        foreign_processes=(ForeignGpuProcess(41_000 + i, "python3", 3, 2048),
                           ForeignGpuProcess(42_000 + i, "nvtop", 1004, None)),
        xids=(XidCount("0000:18:00.0", 79, 1,
                       "NVRM: Xid (PCI:0000:18:00): 79, pid=1234, GPU has fallen off the bus."),),
        note="",
    )


# --- part 1: the agent's sampler ---------------------------------------------------------


class SteppedClock:
    """A monotonic clock a caller moves."""

    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now


def _no_nvml() -> Any:
    raise ImportError("no NVML on this machine")


def _no_smi(argv: Any, timeout: float) -> str:
    raise FileNotFoundError(argv[0])


class RecordedSmi:
    """nvidia-smi printing recorded output (``run(argv, timeout) -> str``, as the sampler calls it)."""

    def __init__(self, query: str, listing: str) -> None:
        self.query, self.listing = query, listing

    def __call__(self, argv: Any, timeout: float) -> str:
        args = tuple(argv[1:])
        if args == ("-q", "-x"):
            return self.query
        if args == ("-L",):
            return self.listing
        raise FileNotFoundError(f"no recording of nvidia-smi {' '.join(args)}")


def _recorded_a100(cards: int) -> RecordedSmi:
    """The recorded A100 (MIG mode, 4 instances), ``cards`` times: card k gets UUIDs and a
    bus id of its own; ``-L`` lists each card and its instances as the recording does."""
    listing_lines = A100_LISTING.read_text().splitlines()
    gpu0 = [listing_lines[0]] + [line for line in listing_lines[1:5] if line.lstrip().startswith("MIG")]
    if cards == 1:
        return RecordedSmi(A100_QUERY.read_text(), "\n".join(gpu0) + "\n")
    root = ET.fromstring(A100_QUERY.read_text())
    (template,) = root.findall("gpu")
    uuid0 = template.findtext("uuid") or ""
    root.remove(template)
    listing = []
    for k in range(cards):
        card = ET.fromstring(ET.tostring(template))
        uuid = uuid0 if k == 0 else f"GPU-{k:08x}{uuid0[12:]}"
        bus = f"00000000:{0x01 + 0x10 * k:02X}:00.0"
        card.set("id", bus)
        for path, value in (("uuid", uuid), ("minor_number", str(k)), ("pci/pci_bus_id", bus)):
            element = card.find(path)
            if element is not None:
                element.text = value
        root.append(card)
        for n, line in enumerate(gpu0):
            line = line.replace(uuid0, uuid).replace("GPU 0:", f"GPU {k}:")
            if n and k:  # a MIG line: a UUID of this card's own
                head, _, tail = line.partition("(UUID: MIG-")
                line = f"{head}(UUID: MIG-{k:04x}{tail[4:]}"
            listing.append(line)
    attached = root.find("attached_gpus")
    if attached is not None:
        attached.text = str(cards)
    return RecordedSmi(ET.tostring(root, encoding="unicode"), "\n".join(listing) + "\n")


@contextlib.contextmanager
def engine_processes(n: int) -> Iterator[dict[str, int]]:
    """Starts ``n`` ``sleep`` processes, each leading its own process group; yields {shard id: pid}."""
    procs = [subprocess.Popen(["sleep", "3600"], start_new_session=True) for _ in range(n)]
    try:
        yield {f"shard-{k}": p.pid for k, p in enumerate(procs)}
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _per_call_us(fn: Callable[[], Any], calls: int) -> float:
    """CPU microseconds per call of ``fn`` (median of 3 batches of ``calls`` / 3)."""
    batch = max(1, calls // 3)
    times = []
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(batch):
            fn()
        times.append((time.process_time() - t0) / batch * 1e6)
    return statistics.median(times)


def wire_costs(telemetry: Any, calls: int) -> dict[str, float]:
    """The agent's conversion of ``telemetry`` to the dict it sends and the capnp message built from it."""
    from llmgw.rpc import convert, schema

    s = schema.load()
    d = convert.telemetry_dict(telemetry)
    data = s.Telemetry.new_message(**d).to_bytes()
    dict_us = _per_call_us(lambda: convert.telemetry_dict(telemetry), calls)
    message_us = _per_call_us(lambda: s.Telemetry.new_message(**d).to_bytes(), calls)
    return {"telemetry_dict_us": dict_us, "message_us": message_us, "message_bytes": len(data)}


def measure_sampler(name: str, make: Callable[[SteppedClock], Any], groups: dict[str, int],
                    rounds: int, calls: int) -> dict[str, Any]:
    """Times ``rounds`` rounds of SAMPLES_PER_ROUND real samples of one sampler variant."""
    from llmgw.telemetry import SAMPLE_INTERVAL_S

    clock = SteppedClock()
    sampler = make(clock)
    for _ in range(2):  # the first sample has no rates; the second is the first full one
        sampler.sample(groups)
        clock.now += SAMPLE_INTERVAL_S
    cpu, children, wall = [], [], []
    generation = sampler.generation
    last = None
    for _ in range(rounds):
        gc.collect()
        round_cpu = round_children = round_wall = 0.0
        for _ in range(SAMPLES_PER_ROUND):
            # Real time passes between samples (untimed), so the kernel's CPU counters move
            # and the sample computes its rates, as it does 10 s apart.
            time.sleep(PAUSE_S)
            c0, k0, w0 = time.process_time(), _children_cpu(), time.perf_counter()
            last = sampler.sample(groups)
            round_cpu += time.process_time() - c0
            round_children += _children_cpu() - k0
            round_wall += time.perf_counter() - w0
            clock.now += SAMPLE_INTERVAL_S
        cpu.append(round_cpu / SAMPLES_PER_ROUND)
        children.append(round_children / SAMPLES_PER_ROUND)
        wall.append(round_wall / SAMPLES_PER_ROUND)
    assert last is not None
    if sampler.generation - generation < rounds * SAMPLES_PER_ROUND:
        raise BenchError(f"agent {name}: {sampler.generation - generation} new samples in "
                         f"{rounds * SAMPLES_PER_ROUND} calls: some calls were not real samples")
    if len(last.shards) != len(groups):
        raise BenchError(f"agent {name}: the sample has {len(last.shards)} shard usages for {len(groups)} groups")
    # A call between samples (the agent samples at every 2 s heartbeat): the clock has not moved.
    clock.now -= SAMPLE_INTERVAL_S / 2
    cached_us = _per_call_us(lambda: sampler.sample(groups), calls)
    wire = wire_costs(last, calls)
    per_sample = statistics.median(cpu)
    child = statistics.median(children)
    path = per_sample + child + 4 * cached_us / 1e6 + 5 * wire["telemetry_dict_us"] / 1e6 + wire["message_us"] / 1e6
    return {
        "gpus": len(last.gpus),
        "host_readings": len(last.host),
        "shards": len(last.shards),
        "note": last.note,
        "cpu_s_per_sample": per_sample,
        "cpu_s_per_sample_min": min(cpu),
        "children_cpu_s_per_sample": child,
        "wall_s_per_sample": statistics.median(wall),
        "share_of_one_core": (per_sample + child) / SAMPLE_INTERVAL_S,
        "cached_sample_us": cached_us,
        **wire,
        "heartbeat_path_cpu_s_per_10s": path,
        "heartbeat_path_share_of_one_core": path / SAMPLE_INTERVAL_S,
    }


def agent_part(quick: bool) -> dict[str, Any]:
    """Part 1: the sampler's variants on this machine."""
    from llmgw.node.telemetry.sampler import NodeSampler

    rounds, calls = AGENT_QUICK if quick else AGENT_FULL
    variants: dict[str, Callable[[SteppedClock], Any]] = {
        "no_cards": lambda clock: NodeSampler(import_nvml=_no_nvml, run_smi=_no_smi, clock=clock),
        "a100_recorded": lambda clock: NodeSampler(import_nvml=_no_nvml, run_smi=_recorded_a100(1), clock=clock),
        "a100_x8": lambda clock: NodeSampler(import_nvml=_no_nvml, run_smi=_recorded_a100(8), clock=clock),
    }
    result: dict[str, Any] = {"rounds": rounds, "samples_per_round": SAMPLES_PER_ROUND,
                              "engine_groups": ENGINE_GROUPS,
                              "processes_in_proc": sum(1 for p in os.listdir("/proc") if p.isdigit())}
    with engine_processes(ENGINE_GROUPS) as groups:
        result["variants"] = {}
        for name, make in variants.items():
            figures = measure_sampler(name, make, groups, rounds, calls)
            result["variants"][name] = figures
            _log(f"  agent {name:<14} {figures['gpus']} GPU(s)  {figures['cpu_s_per_sample'] * 1e3:7.2f} ms CPU "
                 f"+ {figures['children_cpu_s_per_sample'] * 1e3:5.2f} ms children per sample  "
                 f"share {figures['share_of_one_core']:.5f}  message {figures['message_bytes']} B")
    result["fleet_node_telemetry"] = wire_costs(node_telemetry(0), calls)
    return result


# --- part 2: the server process ------------------------------------------------------------


async def _stdin_lines() -> Any:
    """Yields this process's standard input, line by line, without blocking trio."""
    import trio

    stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    buffer = b""
    async with stream:
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                yield line.decode().strip()


def _say(obj: Any) -> None:
    print(json.dumps(obj) if not isinstance(obj, str) else obj, flush=True)


def serve(nodes: int) -> None:
    """The control plane's part: a registry with ``nodes`` nodes, each connection served the
    ``NodeDesk`` of the next node. Prints ``port N``, then answers commands on stdin:
    ``mark`` (CPU time, heartbeat counts), ``scrape K``, ``inprocess N``, ``quit``."""
    import functools

    import trio

    from llmgw.control.fleet_metrics import render_fleet
    from llmgw.control.registry import Registry
    from llmgw.control.sessions import NodeSession
    from llmgw.gctune import tune_for_serving
    from llmgw.rpc import convert, schema
    from llmgw.rpc.connection import serve_stream
    from llmgw.rpc.kjtrio import capnp_runtime

    counts = {"heartbeats": 0, "with_telemetry": 0}

    class CountingRegistry(Registry):
        def heartbeat(self, node_id: str, hardware: Any, *, telemetry: Any = None, epoch: int | None = None) -> None:
            counts["heartbeats"] += 1
            if telemetry is not None:
                counts["with_telemetry"] += 1
            super().heartbeat(node_id, hardware, telemetry=telemetry, epoch=epoch)

    async def main() -> None:
        async with capnp_runtime(), trio.open_nursery() as nursery:
            # Nodes are lost only after an hour: connecting 1,000 takes a while, and every
            # node heartbeats every 2 s once the modes run, so nothing is ever lost.
            registry = CountingRegistry(lost_after=3600.0)
            desks = []
            for i in range(nodes):
                epoch = registry.node_joined(node_name(i), f"10.1.{i // 250}.{i % 250}:7070", node_hardware(i), ())
                desks.append(NodeSession(registry, node_name(i), epoch, None, lambda: None).desk())
            await nursery.start(registry.watchdog)
            accepted = 0

            async def on_tcp(stream: trio.SocketStream) -> None:
                nonlocal accepted
                i, accepted = accepted, accepted + 1
                if i >= nodes:
                    await stream.aclose()
                    return
                await serve_stream(stream, desks[i])

            listeners = await nursery.start(functools.partial(trio.serve_tcp, on_tcp, 0, host=HOST))
            tune_for_serving()  # as `llmgw server` does once set up (llmgw/gctune.py)
            _say(f"port {listeners[0].socket.getsockname()[1]}")
            async for line in _stdin_lines():
                command, *args = line.split() or [""]
                if command == "mark":
                    _say({"cpu_s": time.process_time(), "wall_s": time.perf_counter(), "accepted": accepted,
                          "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **counts})
                elif command == "scrape":
                    _say(scrape(registry, int(args[0])))
                elif command == "inprocess":
                    _say(in_process(registry, int(args[0])))
                elif command == "quit":
                    break
            nursery.cancel_scope.cancel()

    def scrape(registry: Any, times: int) -> dict[str, Any]:
        # What FleetMetrics.render does, timed in parts: the snapshot on the trio thread, the
        # text in a worker thread (here inline, so process_time counts it alone).
        cpu, on_loop, text = [], [], b""
        for _ in range(times):
            gc.collect()
            t0 = time.process_time()
            fleet = registry.snapshot()
            t1 = time.process_time()
            text = render_fleet(fleet, trio.current_time())
            cpu.append(time.process_time() - t0)
            on_loop.append(t1 - t0)
        now = trio.current_time()
        live = sum(1 for node in registry.snapshot().nodes.values()
                   if (t := node.live_telemetry(now)) is not None and t.gpus)
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        return {"cpu_s": statistics.median(cpu), "cpu_s_min": min(cpu), "trio_thread_cpu_s": statistics.median(on_loop),
                "scrapes": times, "series": series,
                "bytes": len(text), "nodes_with_live_telemetry": live}

    def in_process(registry: Any, calls: int) -> dict[str, Any]:
        s = schema.load()
        hw = s.Hardware.new_message(**convert.hardware_dict(node_hardware(0))).as_reader()
        tel = s.Telemetry.new_message(**convert.telemetry_dict(node_telemetry(0))).as_reader()
        hardware, sample = convert.hardware_from(hw), convert.telemetry_from(tel)
        node = registry.snapshot().nodes[node_name(0)]
        return {
            "hardware_from": _per_call_us(lambda: convert.hardware_from(hw), calls),
            "telemetry_from": _per_call_us(lambda: convert.telemetry_from(tel), calls),
            "registry_heartbeat_bare": _per_call_us(
                lambda: Registry.heartbeat(registry, node.id, hardware, epoch=node.epoch), calls),
            "registry_heartbeat_telemetry": _per_call_us(
                lambda: Registry.heartbeat(registry, node.id, hardware, telemetry=sample, epoch=node.epoch), calls),
        }

    trio.run(main)


# --- part 2: a client process (many simulated agents) --------------------------------------


def client(port: int, first: int, count: int, nodes: int, interval: float) -> None:
    """``count`` simulated agents (nodes ``first``...), one connection each. Prints
    ``connected`` once all are, then runs ``run MODE`` ... ``stop`` phases from stdin, printing
    each phase's figures as one JSON line; ``quit`` ends it."""
    import capnp
    import trio

    from llmgw.rpc import convert, schema
    from llmgw.rpc.connection import open_client
    from llmgw.rpc.kjtrio import capnp_runtime

    async def main() -> None:
        s = schema.load()
        async with capnp_runtime(), contextlib.AsyncExitStack() as stack:
            agents = []
            for k in range(count):
                g = first + k
                with trio.fail_after(CONNECT_TIMEOUT):
                    stream = await trio.open_tcp_stream(HOST, port)
                connection = await stack.enter_async_context(open_client(stream))
                desk = connection.bootstrap().cast_as(s.NodeDesk)
                # Built once: the server's work does not depend on how the client built the bytes.
                hardware = s.Hardware.new_message(**convert.hardware_dict(node_hardware(g)))
                telemetry = s.Telemetry.new_message(**convert.telemetry_dict(node_telemetry(g)))
                with trio.fail_after(CONNECT_TIMEOUT):
                    await desk.heartbeat(hardware)  # the server answers: this connection is a node's desk
                agents.append((g, desk, hardware, telemetry))
            _say("connected")
            commands: Any = _stdin_lines()
            async for line in commands:
                command, *args = line.split() or [""]
                if command == "run":
                    _say(await phase(agents, args[0], commands))
                elif command == "quit":
                    break

    async def phase(agents: list[Any], mode: str, commands: Any) -> dict[str, Any]:
        stop = trio.Event()
        figures = {"sent": 0, "sent_telemetry": 0, "errors": 0, "error": "", "late_max_s": 0.0, "late_over_1s": 0}
        latencies: list[float] = []
        start = trio.current_time() + 0.05

        async def agent(g: int, desk: Any, hardware: Any, telemetry: Any) -> None:
            due = start + (g % nodes) / nodes * interval
            beat = 0
            while True:
                with trio.move_on_at(due):
                    await stop.wait()
                if stop.is_set():
                    return
                now = trio.current_time()
                late = now - due
                figures["late_max_s"] = max(figures["late_max_s"], late)
                figures["late_over_1s"] += late > 1.0
                with_telemetry = mode == "every_beat" or (mode == "telemetry" and (beat + g) % TELEMETRY_EVERY == 0)
                request = desk.heartbeat_request()
                request.hardware = hardware
                if with_telemetry:
                    request.telemetry = telemetry
                try:
                    await request.send()
                except capnp.KjException as exc:
                    figures["errors"] += 1
                    figures["error"] = figures["error"] or str(exc)[:300]
                else:
                    latencies.append(trio.current_time() - now)
                    figures["sent"] += 1
                    figures["sent_telemetry"] += with_telemetry
                beat += 1
                due += interval
                if due < trio.current_time() - interval:
                    due = trio.current_time()  # more than a beat behind: no burst to catch up

        cpu0, wall0 = time.process_time(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for g, desk, hardware, telemetry in agents:
                nursery.start_soon(agent, g, desk, hardware, telemetry)
            async for line in commands:
                if line == "stop":
                    break
            stop.set()
        latencies.sort()
        return {**figures, "cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - wall0,
                "latency_p50_s": percentile(latencies, 0.5) if latencies else None,
                "latency_p99_s": percentile(latencies, 0.99) if latencies else None}

    trio.run(main)


# --- part 2: orchestration -------------------------------------------------------------------


def _child(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


def _read_line(proc: subprocess.Popen[str], timeout: float, what: str) -> str:
    """Returns the next line ``proc`` prints; raises BenchError if none comes within ``timeout``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        status = proc.poll()
        raise BenchError(f"{what}: no answer within {timeout:g}s"
                         + (f" (it exited with status {status}; its stderr is above)" if status is not None else ""))
    return line.strip()


def _tell(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _ask(proc: subprocess.Popen[str], line: str, what: str) -> dict[str, Any]:
    _tell(proc, line)
    return json.loads(_read_line(proc, ANSWER_TIMEOUT, what))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            _tell(proc, "quit")
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _mode_figures(mode: str, before: dict[str, Any], after: dict[str, Any], clients: list[dict[str, Any]],
                  target: float, telemetry_target: float) -> dict[str, Any]:
    wall = after["wall_s"] - before["wall_s"]
    cpu = after["cpu_s"] - before["cpu_s"]
    beats = after["heartbeats"] - before["heartbeats"]
    with_telemetry = after["with_telemetry"] - before["with_telemetry"]
    if beats <= 0:
        raise BenchError(f"{mode}: the server counted no heartbeats in the window")
    errors = sum(c["errors"] for c in clients)
    if errors:
        raise BenchError(f"{mode}: {errors} heartbeat(s) failed, e.g. "
                         f"{next(c['error'] for c in clients if c['errors'])}")
    p50 = [c["latency_p50_s"] for c in clients if c["latency_p50_s"] is not None]
    p99 = [c["latency_p99_s"] for c in clients if c["latency_p99_s"] is not None]
    return {
        "server_cpu_share_of_one_core": cpu / wall,
        "server_cpu_us_per_heartbeat": cpu / beats * 1e6,
        "heartbeats_per_s_target": target,
        "heartbeats_per_s_achieved": beats / wall,
        "telemetry_heartbeats_per_s_target": telemetry_target,
        "telemetry_heartbeats_per_s_achieved": with_telemetry / wall,
        "window_s": wall,
        "client_call_p50_ms": statistics.median(p50) * 1e3 if p50 else None,
        "client_call_p99_ms": max(p99) * 1e3 if p99 else None,
        "client_late_max_s": max(c["late_max_s"] for c in clients),
        "client_beats_late_over_1s": sum(c["late_over_1s"] for c in clients),
        "client_errors": errors,
        "client_cpu_share": sum(c["cpu_s"] for c in clients) / statistics.median(c["wall_s"] for c in clients),
    }


def fleet_part(quick: bool, nodes: int, n_clients: int, rounds: int | None, window: float | None) -> dict[str, Any]:
    """Part 2: one server process, ``n_clients`` client processes holding ``nodes`` agents."""
    from llmgw.config.defaults import DEFAULT_HEARTBEAT_INTERVAL

    default_rounds, default_window = FLEET_QUICK if quick else FLEET_FULL
    rounds, window = rounds or default_rounds, window or default_window
    interval = DEFAULT_HEARTBEAT_INTERVAL
    target = nodes / interval
    targets = {"bare": (target, 0.0), "telemetry": (target, target / TELEMETRY_EVERY),
               "every_beat": (target, target)}
    procs: list[subprocess.Popen[str]] = []
    try:
        server = subprocess.Popen(_child("_serve", "--nodes", str(nodes)), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
        procs.append(server)
        line = _read_line(server, START_TIMEOUT, "the server")
        if not line.startswith("port "):
            raise BenchError(f"the server said {line!r} instead of its port")
        port = int(line.split()[1])
        t0 = time.perf_counter()
        clients = []
        share = -(-nodes // n_clients)
        for c in range(n_clients):
            first, count = c * share, min(share, nodes - c * share)
            if count <= 0:
                break
            proc = subprocess.Popen(
                _child("_client", "--port", str(port), "--first", str(first), "--count", str(count),
                       "--nodes", str(nodes), "--interval", str(interval)),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
            procs.append(proc)
            clients.append(proc)
            if _read_line(proc, CONNECT_TIMEOUT + START_TIMEOUT, f"client {c}") != "connected":
                raise BenchError(f"client {c} did not connect")
        connect_s = time.perf_counter() - t0
        accepted = _ask(server, "mark", "the server")["accepted"]
        if accepted != nodes:
            raise BenchError(f"the server accepted {accepted} connections for {nodes} nodes")
        _log(f"  fleet: {nodes} agents connected over {len(clients)} client processes in {connect_s:.1f} s")
        before = _ask(server, "mark", "the server")
        time.sleep(IDLE_S)
        after = _ask(server, "mark", "the server")
        idle_wall = after["wall_s"] - before["wall_s"]
        idle = {"server_cpu_share_of_one_core": (after["cpu_s"] - before["cpu_s"]) / idle_wall,
                "heartbeats": after["heartbeats"] - before["heartbeats"], "window_s": idle_wall}
        _log(f"  idle (connections open, no heartbeats): server {idle['server_cpu_share_of_one_core']:.4f} of a core")
        per_round: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for r in range(rounds):
            for mode in MODES:
                for proc in clients:
                    _tell(proc, f"run {mode}")
                time.sleep(interval + 0.5)  # every node has beaten once in this mode
                before = _ask(server, "mark", "the server")
                time.sleep(window)
                after = _ask(server, "mark", "the server")
                for proc in clients:
                    _tell(proc, "stop")
                answers = [json.loads(_read_line(proc, ANSWER_TIMEOUT, f"client {c}"))
                           for c, proc in enumerate(clients)]
                figures = _mode_figures(mode, before, after, answers, *targets[mode])
                per_round[mode].append(figures)
                _log(f"  round {r + 1}/{rounds}  {mode:<10} server {figures['server_cpu_share_of_one_core']:6.3f} "
                     f"of a core  {figures['server_cpu_us_per_heartbeat']:6.0f} us/heartbeat  "
                     f"{figures['heartbeats_per_s_achieved']:5.0f} beats/s "
                     f"({figures['telemetry_heartbeats_per_s_achieved']:.0f} with telemetry)  "
                     f"clients {figures['client_cpu_share']:.2f} of a core")
        scrape = _ask(server, f"scrape {SCRAPES}", "the server")
        _log(f"  scrape of {scrape['nodes_with_live_telemetry']} nodes: {scrape['cpu_s'] * 1e3:.0f} ms CPU, "
             f"{scrape['series']} series, {scrape['bytes']} bytes")
        in_process = _ask(server, f"inprocess {IN_PROCESS_CALLS}", "the server")
        rss = _ask(server, "mark", "the server")["max_rss_mib"]
        for proc in procs:
            if proc.poll() is not None:
                raise BenchError(f"a process exited with status {proc.returncode} during the run")
    finally:
        for proc in reversed(procs):
            _stop(proc)

    modes = {m: {k: statistics.median(run[k] for run in runs) if runs[0][k] is not None else None
                 for k in runs[0]} for m, runs in per_round.items()}
    bare = modes["bare"]
    bare_share = bare["server_cpu_share_of_one_core"]
    ratios = {f"{m}_vs_bare_server_cpu": modes[m]["server_cpu_share_of_one_core"] / bare_share
              for m in MODES if m != "bare"}
    by_round = {
        f"{m}_vs_bare_server_cpu": statistics.median(
            t["server_cpu_share_of_one_core"] / b["server_cpu_share_of_one_core"]
            for t, b in zip(per_round[m], per_round["bare"]))
        for m in MODES if m != "bare"
    }
    # The extra CPU of a heartbeat with telemetry over one without, from each mode against bare.
    extra = {}
    for m in ("telemetry", "every_beat"):
        f = modes[m]
        bare_us = bare["server_cpu_us_per_heartbeat"]
        beats, with_t = f["heartbeats_per_s_achieved"], f["telemetry_heartbeats_per_s_achieved"]
        if with_t:
            extra[m] = (f["server_cpu_share_of_one_core"] * 1e6 - beats * bare_us) / with_t
    share = modes["telemetry"]["server_cpu_share_of_one_core"]
    return {
        "nodes": nodes,
        "connections": nodes,
        "client_processes": len(clients),
        "heartbeat_interval_s": interval,
        "telemetry_every_beats": TELEMETRY_EVERY,
        "heartbeats_per_s_target": target,
        "heartbeats_per_s_achieved": modes["telemetry"]["heartbeats_per_s_achieved"],
        "rounds": rounds,
        "window_s": window,
        "connect_s": connect_s,
        "idle": idle,
        "modes": modes,
        "ratios": ratios,
        "ratios_by_round": by_round,
        "summary": {
            "server_cpu_share_of_one_core": {m: modes[m]["server_cpu_share_of_one_core"] for m in MODES},
            "server_cpu_us_per_heartbeat": {m: modes[m]["server_cpu_us_per_heartbeat"] for m in MODES},
            "heartbeats_per_s_achieved": {m: modes[m]["heartbeats_per_s_achieved"] for m in MODES},
            "telemetry_vs_bare_server_cpu": ratios["telemetry_vs_bare_server_cpu"],
            "scrape_cpu_s": scrape["cpu_s"],
        },
        "server_extra_cpu_us_per_telemetry": extra,
        "goal": {"mode": "telemetry", "server_cpu_share_max": GOAL_SHARE, "server_cpu_share": share,
                 "met": share < GOAL_SHARE},
        "scrape": scrape,
        "in_process_us": in_process,
        "server_max_rss_mib": rss,
        "rounds_raw": per_round,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: the benchmark, or (with a leading ``_serve``/``_client``) one of its child
    processes. Returns the exit status (1 when a part failed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_serve", "_client"):
        child = argparse.ArgumentParser(prog=f"telemetry.py {argv[0]}")
        child.add_argument("--nodes", type=int, default=NODES)
        child.add_argument("--port", type=int)
        child.add_argument("--first", type=int, default=0)
        child.add_argument("--count", type=int, default=0)
        child.add_argument("--interval", type=float, default=2.0)
        a = child.parse_args(argv[1:])
        if argv[0] == "_serve":
            serve(a.nodes)
        else:
            client(a.port, a.first, a.count, a.nodes, a.interval)
        return 0

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, one 10 s window per mode")
    parser.add_argument("--only", choices=("agent", "fleet"), help="run one part only")
    parser.add_argument("--nodes", type=int, default=NODES, help="simulated agents (one connection each)")
    parser.add_argument("--clients", type=int, default=CLIENTS, help="client processes holding them")
    parser.add_argument("--rounds", type=int, default=0, help="rounds of the fleet modes (default 3; quick 1)")
    parser.add_argument("--window", type=float, default=0.0, help="seconds measured per mode and round (default 10)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    _log(f"telemetry benchmark ({'quick' if args.quick else 'full'})")
    result: dict[str, Any] = {
        "benchmark": "telemetry",
        "mode": "quick" if args.quick else "full",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
    }
    try:
        if args.only in (None, "agent"):
            result["agent"] = agent_part(args.quick)
        if args.only in (None, "fleet"):
            result["fleet"] = fleet_part(args.quick, args.nodes, args.clients, args.rounds or None,
                                         args.window or None)
    except BenchError as exc:
        _log(f"error: {exc}")
        return 1
    result["load_average_at_end"] = os.getloadavg()[0]
    result["wall_seconds"] = time.perf_counter() - started
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
