"""Benchmark: llmgw's native trio backend for pycapnp against plain pycapnp on asyncio.

Run::

    python bench/rpc.py            # 5 rounds, 2,000 sequential + 20,000 concurrent calls each (< 3 min)
    python bench/rpc.py --quick    # 1 round, fewer calls (< 30 s)

Four variants, each a server process and a client process talking over TCP on
127.0.0.1 with the same one-method schema (``echo(text) -> (text)``):

* ``asyncio-tcp``: pycapnp's own asyncio glue (``capnp.AsyncIoStream.create_server`` /
  ``create_connection``, ``TwoPartyServer``/``TwoPartyClient`` inside ``capnp.kj_loop()``);
* ``trio-tcp``: :mod:`llmgw.rpc.kjtrio` with ``trio.serve_tcp`` and
  :mod:`llmgw.rpc.connection`;
* ``asyncio-tls`` and ``trio-tls``: the same over mutual TLS, with contexts made by
  :mod:`llmgw.rpc.tls` from one throwaway cluster CA (the trio side dials and listens with
  :mod:`llmgw.rpc.net`, exactly as llmgw does).

The trio backend replaces pycapnp's module-global ``asyncio`` once installed, so no
process ever runs both: this orchestrating process imports neither, and every variant
gets fresh processes. Rounds run the variants interleaved, so slow phases of a shared
machine hit every variant alike; each figure is the median over rounds.

Per variant: sequential call latency (p50, p99, mean over ``--calls`` calls), throughput
with ``--inflight`` calls in flight (calls/s over ``--tput-calls`` calls), and CPU time
per call in the client (per phase) and in the server (over the whole client run).
Ratios are trio/asyncio, per transport: above 1 means trio takes longer (latency, CPU),
below 1 means trio serves fewer calls per second (throughput). ``ratios`` divides the
medians over rounds; ``ratios_by_round`` is the median of each round's own ratio (the
steadier figure on a shared machine).

Human progress goes to stderr; the last line of stdout is one JSON object. A failed
variant (a process that crashed or timed out) makes the benchmark exit with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]

# The schema both backends serve. A fixed file id: both processes must load the same one.
SCHEMA_TEXT = """\
@0xd1f0c3a5b7e29a41;

interface BenchEcho {
  echo @0 (text :Text) -> (text :Text);
}
"""
# A short request: the figures are per-call overhead, not bandwidth.
PAYLOAD = "llmgw-rpc-bench"

VARIANTS = ("asyncio-tcp", "trio-tcp", "asyncio-tls", "trio-tls")

# Full and quick settings: (rounds, warm-up calls, sequential calls, concurrent calls).
# Full: about 90 s on 2 shared cores; quick: about 8 s. Warm-up fills caches and
# lets the allocators settle before anything is timed.
FULL = (5, 500, 2_000, 20_000)
QUICK = (1, 300, 1_000, 6_000)
# Calls kept in flight in the throughput phase.
IN_FLIGHT = 100

# A server prints its port within this many seconds or is considered broken (imports on
# a loaded machine can take a few seconds).
SERVER_START_TIMEOUT = 30.0
# One client process (connect, warm up, both phases) must finish within this.
CLIENT_TIMEOUT = 120.0
# Bound on each phase inside a client: a hung peer must fail the run, not stall it.
PHASE_TIMEOUT = 90.0
# How long a server may take to exit after SIGTERM before it is killed.
SERVER_STOP_TIMEOUT = 5.0

SERVER_NAME = "bench-server"
CLIENT_NAME = "bench-client"
HOST = "127.0.0.1"


class BenchError(RuntimeError):
    """A variant's processes failed; the message says which and how."""


# --- statistics ---------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Return the nearest-rank ``q`` quantile (0 < q <= 1) of an ascending, non-empty sequence."""
    rank = max(1, min(len(sorted_values), round(q * len(sorted_values) + 0.5 - 1e-9)))
    return sorted_values[rank - 1]


def summarise(latencies_ns: list[int], seq_cpu_s: float, tput_calls: int, tput_s: float,
              tput_cpu_s: float) -> dict[str, float]:
    """Return the client's figures from raw measurements (times in microseconds)."""
    lat = sorted(n / 1_000 for n in latencies_ns)
    return {
        "latency_p50_us": percentile(lat, 0.50),
        "latency_p99_us": percentile(lat, 0.99),
        "latency_mean_us": statistics.fmean(lat),
        "throughput_calls_per_s": tput_calls / tput_s,
        "client_cpu_us_per_call_sequential": seq_cpu_s / len(lat) * 1e6,
        "client_cpu_us_per_call_concurrent": tput_cpu_s / tput_calls * 1e6,
    }


# --- the server implementation (identical for both backends) -----------------------------


def load_schema(path: str) -> Any:
    """Load the benchmark schema from ``path``; returns the capnp module."""
    import capnp

    return capnp.load(path)


def echo_server(schema: Any) -> Any:
    """Return a BenchEcho server object. Its method never awaits, so the same code runs
    under pycapnp's asyncio glue and under the trio backend."""

    class Echo(schema.BenchEcho.Server):
        async def echo(self, text: str, **_: Any) -> str:
            return text

    return Echo()


def tls_contexts(tls_dir: str) -> tuple[Any, Any]:
    """Return (server context, client context) from the PEM files the orchestrator wrote."""
    from llmgw.rpc.tls import client_ssl_context, server_ssl_context

    d = Path(tls_dir)
    ca = (d / "ca.pem").read_bytes()
    server = server_ssl_context(ca, (d / "server-cert.pem").read_bytes(), (d / "server-key.pem").read_bytes())
    client = client_ssl_context(ca, (d / "client-cert.pem").read_bytes(), (d / "client-key.pem").read_bytes())
    return server, client


# --- trio processes -----------------------------------------------------------------------


def trio_serve(schema_path: str, tls_dir: str | None) -> None:
    """Serve BenchEcho with the trio backend; print ``port N``; run until killed."""
    import functools

    import trio

    from llmgw.rpc import net
    from llmgw.rpc.connection import serve_stream
    from llmgw.rpc.kjtrio import capnp_runtime

    schema = load_schema(schema_path)

    async def main() -> None:
        async with capnp_runtime(), trio.open_nursery() as nursery:
            if tls_dir:
                server_ctx, _ = tls_contexts(tls_dir)

                async def on_tls(stream: trio.SSLStream, identity: Any) -> None:
                    await serve_stream(stream, echo_server(schema))

                port = await nursery.start(net.listen, on_tls, HOST, 0, server_ctx)
            else:

                async def on_tcp(stream: trio.SocketStream) -> None:
                    await serve_stream(stream, echo_server(schema))

                listeners = await nursery.start(functools.partial(trio.serve_tcp, on_tcp, 0, host=HOST))
                port = listeners[0].socket.getsockname()[1]
            print(f"port {port}", flush=True)

    trio.run(main)


def trio_client(schema_path: str, port: int, tls_dir: str | None, warmup: int, calls: int,
                tput_calls: int, inflight: int) -> dict[str, float]:
    """Measure against a trio server on ``port``; return :func:`summarise`'s figures."""
    import trio

    from llmgw.rpc import net
    from llmgw.rpc.connection import open_client
    from llmgw.rpc.kjtrio import capnp_runtime

    schema = load_schema(schema_path)

    async def main() -> dict[str, float]:
        async with capnp_runtime():
            if tls_dir:
                _, client_ctx = tls_contexts(tls_dir)
                stream: trio.abc.Stream = await net.connect(f"{HOST}:{port}", client_ctx)
            else:
                with trio.fail_after(PHASE_TIMEOUT):
                    stream = await trio.open_tcp_stream(HOST, port)
            async with open_client(stream) as client:
                echo = client.bootstrap().cast_as(schema.BenchEcho)

                async def call() -> None:
                    await echo.echo(PAYLOAD)

                with trio.fail_after(PHASE_TIMEOUT):
                    for _ in range(warmup):
                        await call()

                latencies = []
                with trio.fail_after(PHASE_TIMEOUT):
                    cpu0 = time.process_time()
                    for _ in range(calls):
                        t0 = time.perf_counter_ns()
                        await call()
                        latencies.append(time.perf_counter_ns() - t0)
                    seq_cpu = time.process_time() - cpu0

                remaining = tput_calls

                async def worker() -> None:
                    nonlocal remaining
                    while remaining > 0:
                        remaining -= 1
                        await call()

                with trio.fail_after(PHASE_TIMEOUT):
                    cpu0, t0 = time.process_time(), time.perf_counter()
                    async with trio.open_nursery() as nursery:
                        for _ in range(inflight):
                            nursery.start_soon(worker)
                    elapsed, tput_cpu = time.perf_counter() - t0, time.process_time() - cpu0
        return summarise(latencies, seq_cpu, tput_calls, elapsed, tput_cpu)

    return trio.run(main)


# --- asyncio processes (plain pycapnp: the baseline) --------------------------------------


def asyncio_serve(schema_path: str, tls_dir: str | None) -> None:
    """Serve BenchEcho with pycapnp's asyncio glue; print ``port N``; run until killed."""
    import asyncio

    import capnp

    schema = load_schema(schema_path)

    async def main() -> None:
        async def on_connection(stream: Any) -> None:
            await capnp.TwoPartyServer(stream, bootstrap=echo_server(schema)).on_disconnect()

        kwargs: dict[str, Any] = {}
        if tls_dir:
            kwargs["ssl"], _ = tls_contexts(tls_dir)
        server = await capnp.AsyncIoStream.create_server(on_connection, HOST, 0, **kwargs)
        print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(capnp.run(main()))


def asyncio_client(schema_path: str, port: int, tls_dir: str | None, warmup: int, calls: int,
                   tput_calls: int, inflight: int) -> dict[str, float]:
    """Measure against an asyncio server on ``port``; return :func:`summarise`'s figures."""
    import asyncio

    import capnp

    schema = load_schema(schema_path)

    async def main() -> dict[str, float]:
        kwargs: dict[str, Any] = {}
        if tls_dir:
            _, kwargs["ssl"] = tls_contexts(tls_dir)
            kwargs["server_hostname"] = HOST
        async with asyncio.timeout(PHASE_TIMEOUT):
            stream = await capnp.AsyncIoStream.create_connection(HOST, port, **kwargs)
        client = capnp.TwoPartyClient(stream)
        echo = client.bootstrap().cast_as(schema.BenchEcho)

        async def call() -> None:
            await echo.echo(PAYLOAD)

        async with asyncio.timeout(PHASE_TIMEOUT):
            for _ in range(warmup):
                await call()

        latencies = []
        async with asyncio.timeout(PHASE_TIMEOUT):
            cpu0 = time.process_time()
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                await call()
                latencies.append(time.perf_counter_ns() - t0)
            seq_cpu = time.process_time() - cpu0

        remaining = tput_calls

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await call()

        async with asyncio.timeout(PHASE_TIMEOUT):
            cpu0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(inflight)))
            elapsed, tput_cpu = time.perf_counter() - t0, time.process_time() - cpu0
        client.close()
        return summarise(latencies, seq_cpu, tput_calls, elapsed, tput_cpu)

    return asyncio.run(capnp.run(main()))


# --- orchestration (this process imports neither backend) ---------------------------------


def write_tls_files(directory: Path) -> None:
    """Create a throwaway cluster CA under ``directory`` and write the PEM files the
    child processes read: ca.pem, server-{cert,key}.pem, client-{cert,key}.pem."""
    from llmgw.rpc.tls import ClusterCA, Role

    ca = ClusterCA.create(directory / "ca")
    server = ca.issue(Role.CONTROL, SERVER_NAME, sans=[HOST])
    client = ca.issue(Role.NODE, CLIENT_NAME)
    (directory / "ca.pem").write_bytes(ca.cert_pem)
    for name, issued in (("server", server), ("client", client)):
        (directory / f"{name}-cert.pem").write_bytes(issued.cert_pem)
        key = directory / f"{name}-key.pem"
        key.write_bytes(issued.key_pem)
        key.chmod(0o600)


def _child(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


def _read_port(proc: subprocess.Popen[str], variant: str) -> int:
    """Wait for the server's ``port N`` line; return N. Raises BenchError if it never comes."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], SERVER_START_TIMEOUT)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("port "):
        status = proc.poll()
        if ready and not line:  # end of output: the server is exiting; collect its status
            try:
                status = proc.wait(SERVER_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        if status is not None:
            raise BenchError(f"{variant}: the server exited with status {status} before listening; "
                             "its stderr is above")
        raise BenchError(f"{variant}: the server did not start within {SERVER_START_TIMEOUT:g}s "
                         f"(it said {line!r}); its stderr is above")
    return int(line.split()[1])


def _stop(proc: subprocess.Popen[str]) -> None:
    """Terminate ``proc`` (SIGTERM, then SIGKILL after SERVER_STOP_TIMEOUT) and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(SERVER_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_variant(variant: str, schema_path: str, tls_dir: str, settings: tuple[int, int, int, int],
                inflight: int) -> dict[str, float]:
    """Run one server and one client process for ``variant``; return the client's figures
    plus ``server_cpu_us_per_call``. Raises BenchError when either process fails."""
    import psutil

    _, warmup, calls, tput_calls = settings
    backend, transport = variant.split("-")
    tls_args = ["--tls-dir", tls_dir] if transport == "tls" else []
    server = subprocess.Popen(_child("_serve", backend, "--schema", schema_path, *tls_args),
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        port = _read_port(server, variant)
        server_cpu = psutil.Process(server.pid)
        cpu_before = sum(server_cpu.cpu_times()[:2])
        try:
            done = subprocess.run(
                _child("_client", backend, "--schema", schema_path, *tls_args, "--port", str(port),
                       "--warmup", str(warmup), "--calls", str(calls), "--tput-calls", str(tput_calls),
                       "--inflight", str(inflight)),
                stdout=subprocess.PIPE, text=True, cwd=ROOT, timeout=CLIENT_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            raise BenchError(f"{variant}: the client did not finish within {CLIENT_TIMEOUT:g}s") from None
        if server.poll() is not None:
            raise BenchError(f"{variant}: the server exited with status {server.returncode} during the run")
        cpu_after = sum(server_cpu.cpu_times()[:2])
    finally:
        _stop(server)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise BenchError(f"{variant}: the client exited with status {done.returncode}; its stderr is above")
    figures = json.loads(lines[-1])
    figures["server_cpu_us_per_call"] = (cpu_after - cpu_before) / (warmup + calls + tput_calls) * 1e6
    return figures


def _ratios(trio_figures: dict[str, float], asyncio_figures: dict[str, float]) -> dict[str, float]:
    return {key: trio_figures[key] / asyncio_figures[key] for key in trio_figures if asyncio_figures.get(key)}


def _round_ratios(trio_runs: list[dict[str, float]], asyncio_runs: list[dict[str, float]]) -> dict[str, float]:
    """Return the median over rounds of each round's own trio/asyncio ratio.

    Both variants of one round ran within seconds of each other, so a load spike from
    other work on the machine tends to hit both; this is the steadier estimate when the
    machine is shared."""
    per_round = [_ratios(t, a) for t, a in zip(trio_runs, asyncio_runs)]
    return {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}


def orchestrate(quick: bool, rounds: int | None, inflight: int) -> dict[str, Any]:
    """Run every variant ``rounds`` times, interleaved; return the JSON-ready result."""
    settings = QUICK if quick else FULL
    if rounds:
        settings = (rounds, *settings[1:])
    n_rounds, warmup, calls, tput_calls = settings
    started = time.perf_counter()
    per_round: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-rpc-") as tmp:
        tmp_path = Path(tmp)
        schema_path = tmp_path / "bench_echo.capnp"
        schema_path.write_text(SCHEMA_TEXT)
        tls_dir = tmp_path / "tls"
        tls_dir.mkdir(mode=0o700)
        write_tls_files(tls_dir)
        for r in range(n_rounds):
            for variant in VARIANTS:
                figures = run_variant(variant, str(schema_path), str(tls_dir), settings, inflight)
                per_round[variant].append(figures)
                print(f"  round {r + 1}/{n_rounds}  {variant:<12} p50 {figures['latency_p50_us']:8.1f} us  "
                      f"p99 {figures['latency_p99_us']:8.1f} us  "
                      f"{figures['throughput_calls_per_s']:9.0f} calls/s", file=sys.stderr)
    variants = {
        v: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        for v, runs in per_round.items()
    }
    return {
        "benchmark": "rpc",
        "mode": "quick" if quick else "full",
        "baseline": "plain pycapnp on asyncio, same transport, measured in this run",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "settings": {"rounds": n_rounds, "warmup_calls": warmup, "sequential_calls": calls,
                     "concurrent_calls": tput_calls, "in_flight": inflight, "payload_bytes": len(PAYLOAD)},
        "variants": variants,
        "ratios": {
            "tcp_trio_vs_asyncio": _ratios(variants["trio-tcp"], variants["asyncio-tcp"]),
            "tls_trio_vs_asyncio": _ratios(variants["trio-tls"], variants["asyncio-tls"]),
            "tls_vs_tcp_asyncio": _ratios(variants["asyncio-tls"], variants["asyncio-tcp"]),
            "tls_vs_tcp_trio": _ratios(variants["trio-tls"], variants["trio-tcp"]),
        },
        "ratios_by_round": {
            "tcp_trio_vs_asyncio": _round_ratios(per_round["trio-tcp"], per_round["asyncio-tcp"]),
            "tls_trio_vs_asyncio": _round_ratios(per_round["trio-tls"], per_round["asyncio-tls"]),
        },
        "rounds": per_round,
        "wall_seconds": time.perf_counter() - started,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: the benchmark, or (with a leading ``_serve``/``_client``) one of its
    child processes. Returns the exit status (1 when a variant failed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_serve", "_client"):
        child = argparse.ArgumentParser(prog=f"rpc.py {argv[0]}")
        child.add_argument("backend", choices=("trio", "asyncio"))
        child.add_argument("--schema", required=True)
        child.add_argument("--tls-dir")
        child.add_argument("--port", type=int)
        child.add_argument("--warmup", type=int, default=0)
        child.add_argument("--calls", type=int, default=0)
        child.add_argument("--tput-calls", type=int, default=0)
        child.add_argument("--inflight", type=int, default=IN_FLIGHT)
        a = child.parse_args(argv[1:])
        if argv[0] == "_serve":
            (trio_serve if a.backend == "trio" else asyncio_serve)(a.schema, a.tls_dir)
        else:
            run = trio_client if a.backend == "trio" else asyncio_client
            print(json.dumps(run(a.schema, a.port, a.tls_dir, a.warmup, a.calls, a.tput_calls, a.inflight)))
        return 0

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round, fewer calls (under 30 s)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds of all variants (default 5; quick 1)")
    parser.add_argument("--inflight", type=int, default=IN_FLIGHT, help="calls in flight in the throughput phase")
    args = parser.parse_args(argv)
    print(f"rpc benchmark ({'quick' if args.quick else 'full'}): {', '.join(VARIANTS)}", file=sys.stderr)
    try:
        result = orchestrate(args.quick, args.rounds or None, args.inflight)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
