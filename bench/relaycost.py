"""What one relayed stream costs llmgw's gateway, counted rather than timed.

``python -m bench.relaycost [--seconds 5] [--streams 16] [--requests C] [--profile] [--gateway-tree DIR]``

Starts four fast engines (``bench/fastengine.c``: chunked SSE, one token per millisecond) and
llmgw's router alone in its own process (as ``bench.gateway`` does), runs ``--streams`` paced
streaming clients for ``--seconds`` (``bench.gateway.run_streams``) and prints one JSON object:
the streams served, the gateway's CPU per stream (psutil, user + system), TTFT and event gaps,
and ``added_ttft_p50_ms``: the TTFT p50 over that of the same clients sent to the engines
directly for as long right before (``direct_ttft_p50_ms``), so that the engines' and the
client's own part of the TTFT, which moves between runs too, is not counted as the
gateway's; with ``--profile`` the gateway runs under cProfile and the report adds what
wall-clock noise on a shared machine hides: Python function calls, socket reads and socket
writes per stream and per event (exact counts, comparable between two versions of the
gateway), and the functions with the most time of their own (``--profile-out FILE`` keeps
the raw profile). ``--requests C`` counts non-streaming requests instead: ``wrk`` at
concurrency ``C`` (as ``bench.gateway`` runs it), the figures per request. ``--routing
POLICY`` picks the gateway's routing (``kv``: the cache-aware pair's). ``--gateway-tree DIR``
runs the gateway from another checkout (its ``llmgw`` and ``bench.gateway``) under this
harness: ``bench.ab`` compares two trees so.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import psutil

from bench import gateway as gw
from llmgw.sim.launch import free_tcp_port

#: Engines behind the gateway (as bench.gateway runs them).
REPLICAS = 4
#: Functions listed in the report, by time of their own.
TOP_FUNCTIONS = 40


def run(seconds: float, streams: int, profile: bool, requests: int = 0,
        profile_out: Path | None = None, gateway_tree: Path | None = None,
        routing: str = gw.LLMGW_POLICY) -> dict[str, Any]:
    """Runs the streams (or, with ``requests``, wrk at that concurrency) through a fresh gateway;
    returns the report (see the module docstring). With ``profile_out`` the raw cProfile file is
    copied there (for ``python -m pstats``); ``gateway_tree``: the checkout the gateway runs
    from (default: this one); ``routing``: the gateway's routing policy (default: the cheapest
    path, as ``bench.gateway`` runs ``llmgw``)."""
    work = Path(tempfile.mkdtemp(prefix="llmgw-relaycost-"))
    fleet = gw.Fleet(work)
    stats_path = work / "gateway.prof"
    try:
        replicas, _ = gw.start_fast_replicas(fleet, REPLICAS, gw.build_fastengine(), 1000)
        # The engines alone under the same streams first: the baseline of added_ttft_p50_ms.
        direct = None if requests else gw.run_streams(replicas, streams, seconds)
        port = free_tcp_port()
        serve = ["-m", "bench.gateway", "--serve-llmgw", str(port), "--workers", "1", "--routing", routing,
                 *[f"http://{host}:{p}" for host, p in replicas]]
        cmd = [sys.executable, *(["-m", "cProfile", "-o", str(stats_path)] if profile else []), *serve]
        tree = gateway_tree if gateway_tree is not None else Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
        proc = fleet.spawn("llmgw", cmd, env)
        gw._wait_port(port, proc, gw.START_TIMEOUT_S, lambda: gw._http_ok(port, gw.CHAT_BODY))
        gateway = psutil.Process(proc.pid)
        before = gateway.cpu_times()
        if requests:
            figures = {**gw.run_wrk(fleet, [(gw.HOST, port)], requests, seconds), "events_per_stream": 1.0}
        else:
            figures = gw.run_streams([(gw.HOST, port)], streams, seconds)
        after = gateway.cpu_times()
        fleet.stop(proc)  # SIGTERM: the gateway returns, and cProfile writes its file
        cpu_s = (after.user + after.system) - (before.user + before.system)
        served = max(int(figures["requests"]), 1)
        unit = "request" if requests else "stream"
        report: dict[str, Any] = {("concurrency" if requests else "streams"): requests or streams,
                                  "seconds": seconds, **figures, f"gateway_cpu_ms_per_{unit}": 1000 * cpu_s / served}
        if direct is not None:
            report["direct_ttft_p50_ms"] = direct["ttft_p50_ms"]
            report["added_ttft_p50_ms"] = figures["ttft_p50_ms"] - direct["ttft_p50_ms"]
        if profile:
            report["profile"] = _profile(stats_path, served, figures["events_per_stream"])
            if profile_out is not None:
                shutil.copyfile(stats_path, profile_out)
        return report
    finally:
        fleet.close()


def _profile(path: Path, streams: int, events_per_stream: float) -> dict[str, Any]:
    """Counts from the gateway's cProfile file, per stream and per event (the profile covers the
    whole run, warm-up included: counts per stream are comparable between runs, not exact)."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    calls = sum(row[1] for row in stats.values())

    def count(name: str) -> int:
        return sum(row[1] for key, row in stats.items() if key[2] == name)

    per_event = max(streams * events_per_stream, 1.0)
    top = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:TOP_FUNCTIONS]
    return {
        "calls_per_stream": calls / streams, "calls_per_event": calls / per_event,
        "reads_per_stream": count("<built-in method posix.read>") / streams,
        "writes_per_stream": count("<built-in method posix.write>") / streams,
        "top_own_time": [{"function": f"{Path(k[0]).name}:{k[1]}({k[2]})", "calls": row[1], "own_s": round(row[2], 4)}
                         for k, row in top],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.relaycost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of streaming (default 5)")
    parser.add_argument("--streams", type=int, default=gw.STREAM_CONCURRENCY, help="concurrent streams")
    parser.add_argument("--requests", type=int, default=0, metavar="C",
                        help="count non-streaming requests instead, wrk at concurrency C")
    parser.add_argument("--profile", action="store_true", help="run the gateway under cProfile and count")
    parser.add_argument("--profile-out", type=Path, metavar="FILE",
                        help="with --profile: keep the raw cProfile file there")
    parser.add_argument("--gateway-tree", type=Path, metavar="DIR",
                        help="run the gateway from this checkout (its llmgw and bench.gateway; default: this one)")
    parser.add_argument("--routing", default=gw.LLMGW_POLICY, metavar="POLICY",
                        help=f"the gateway's routing policy (default {gw.LLMGW_POLICY}; {gw.LLMGW_KV_POLICY}: "
                             "the policy llmgw ships with, as bench.gateway's llmgw-kv)")
    args = parser.parse_args(argv)
    if args.gateway_tree is not None and not (args.gateway_tree / "llmgw" / "__init__.py").is_file():
        parser.error(f"--gateway-tree {args.gateway_tree}: no llmgw package there")
    print(json.dumps(run(args.seconds, args.streams, args.profile, args.requests, args.profile_out,
                         args.gateway_tree, args.routing), indent=1))


if __name__ == "__main__":
    main()
