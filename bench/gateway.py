"""Gateway overhead benchmark: llmgw against nginx, sglang-router, vllm-router and LiteLLM.

``python -m bench.gateway [--quick] [--replicas N] [--rounds R] [--duration S]`` starts,
on this machine and on 127.0.0.1 only:

* N simulated engines (``python -m llmgw.sim``, no prefill cost, short answers),
* the proxies under test, each pointed at all N: llmgw's gateway (the router alone,
  ``serve_gateway(create_app(table))`` in its own process), nginx as a plain reverse
  proxy, ``sglang-router`` and ``vllm-router`` (round robin), LiteLLM's proxy,

and measures every target, plus the engines directly ("direct": one load generator per
engine, the load split evenly), round by round so that all targets see the same machine
state: non-streaming chat completions at concurrency 1, 16 and 64 with ``wrk``, and
64-chunk streams with a trio client that timestamps every SSE event. Figures per
target and scenario: requests/s, p50/p99 latency, time to first token and inter-chunk
p50/p99 (streams), and the proxy's CPU seconds per 1,000 requests (psutil on the proxy
and its children, before and after). The medians over rounds and the ratios the issue
sets as targets are printed as one JSON object on the last stdout line; progress goes
to stderr.

Peers come from ``python -m bench.gateway_setup`` (``--setup`` runs it first). A peer
that is not installed or does not start is reported with the reason, never a crash.
The load generator, the proxies and the engines share the machine's cores: compare
ratios from one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import h11
import psutil
import trio

from bench import gateway_setup
from llmgw.sim.launch import SimProcess, free_tcp_port, start_sim

MODEL = "bench-model"
HOST = "127.0.0.1"

#: Non-streaming request: a short chat prompt and a short answer, so the engines are cheap
#: and the proxy hop dominates.
NONSTREAM_MAX_TOKENS = 4
#: Streaming request: one SSE event per generated token (plus the role and [DONE] events).
STREAM_CHUNKS = 64
#: Concurrency of the non-streaming scenarios (the issue's 1, 16, 64).
CONCURRENCIES = (1, 16, 64)
#: Concurrent streams in the streaming scenario. The Python stream client shares the
#: 2 cores with everything else; 8 streams keep it from being the bottleneck.
STREAM_CONCURRENCY = 8
#: Seconds a proxy gets to start listening (LiteLLM imports for a long time).
START_TIMEOUT_S = 120.0
#: Seconds of load before measuring, per scenario (connection setup, JIT-less warm caches).
WARMUP_S = 0.5
#: LiteLLM manages ~50 req/s: it gets shorter runs and no c64/streaming rounds beyond one.
SLOW_PEERS = frozenset({"litellm"})
#: Routing policy given to the Rust routers: round robin is their cheapest path.
RUST_ROUTER_POLICY = "round_robin"

CHAT_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": NONSTREAM_MAX_TOKENS}
)
STREAM_BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": STREAM_CHUNKS,
        "stream": True,
    }
).encode()

WRK_LUA = """
wrk.method = "POST"
wrk.body = %s
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer bench"
done = function(summary, latency, requests)
  io.write(string.format(
    'WRKJSON {"requests":%%d,"duration_us":%%d,"connect":%%d,"read":%%d,"write":%%d,"status":%%d,"timeout":%%d,' ..
    '"p50_us":%%d,"p99_us":%%d,"mean_us":%%.1f}\\n',
    summary.requests, summary.duration, summary.errors.connect, summary.errors.read, summary.errors.write,
    summary.errors.status, summary.errors.timeout, latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


def log(message: str) -> None:
    """Print a progress line on stderr."""
    print(f"[bench.gateway {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- processes -------------------------------------------------------------------------------


class Proxy:
    """A started proxy (or the engines themselves for ``direct``): where to send load, whom to bill CPU."""

    def __init__(self, name: str, urls: Sequence[tuple[str, int]], procs: Sequence[subprocess.Popen[bytes]],
                 version: str = "") -> None:
        self.name = name
        self.targets = list(urls)  # (host, port) pairs; load is split over them
        self.procs = list(procs)
        self.version = version

    def cpu_seconds(self) -> float:
        """Return user+system CPU seconds of the proxy processes and all their children so far."""
        total = 0.0
        for proc in self.procs:
            try:
                root = psutil.Process(proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        t = p.cpu_times()
                        total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def alive(self) -> bool:
        """Return whether every proxy process is still running."""
        return all(p.poll() is None for p in self.procs)


def _wait_port(port: int, proc: subprocess.Popen[bytes] | None, timeout: float, probe: Callable[[], bool] | None = None) -> None:
    """Return once 127.0.0.1:``port`` accepts (and ``probe()`` is true); raise RuntimeError otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited with status {proc.returncode} before listening")
        try:
            with socket.create_connection((HOST, port), timeout=1.0):
                if probe is None or probe():
                    return
        except OSError:
            pass
        time.sleep(0.1)  # polling a port from a plain thread; not test synchronisation
    raise RuntimeError(f"did not listen on {HOST}:{port} within {timeout:.0f}s")


def _http_ok(port: int, body: str) -> bool:
    """Return whether one POST of ``body`` to the chat endpoint answers 200 (a routed request works)."""
    data = body.encode()
    try:
        with socket.create_connection((HOST, port), timeout=10.0) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer bench\r\nConnection: close\r\n"
                      b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
            head = s.recv(64)
            return head.startswith(b"HTTP/1.1 200")
    except OSError:
        return False


class Fleet:
    """Every process the benchmark starts; :meth:`close` ends them all (by pid, never by name)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.sims: list[SimProcess] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``cmd`` in its own session with output to ``workdir/name.log``; return it."""
        out = (self.workdir / f"{name}.log").open("ab")
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, cwd=self.workdir)
        out.close()
        self.procs.append(proc)
        return proc

    def log_tail(self, name: str, lines: int = 5) -> str:
        """Return the last ``lines`` lines of a spawned process's log, for error reports."""
        path = self.workdir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])[-800:]

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM ``proc``'s process group (it was started in its own session), then SIGKILL after 5 s."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def close(self) -> None:
        """Stop every proxy and engine started so far."""
        for proc in reversed(self.procs):
            self.stop(proc)
        for sim in self.sims:
            sim.stop()


def start_replicas(fleet: Fleet, count: int, decode_us: float) -> list[tuple[str, int]]:
    """Start ``count`` simulated engines; return their (host, port)."""
    pending = [
        start_sim(["--model", MODEL, "--port", "0", "--prefill-us-per-token", "0", "--decode-us-per-token",
                   str(decode_us), "--max-tokens-default", str(NONSTREAM_MAX_TOKENS), "--max-num-seqs", "1024"],
                  wait=False)
        for _ in range(count)
    ]
    fleet.sims.extend(pending)
    for sim in pending:
        sim.wait_listening(60.0)
    return [(sim.host, sim.port) for sim in pending]


def start_llmgw(fleet: Fleet, replicas: Sequence[tuple[str, int]], workers: int) -> Proxy:
    """Start llmgw's gateway (router only) in its own process over ``replicas``."""
    port = free_tcp_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    # One process; with --workers N > 1 it runs llmgw's GatewayPool (the server's
    # gateway.workers): N worker processes on the port, fed over their channels.
    cmd = [sys.executable, "-m", "bench.gateway", "--serve-llmgw", str(port), "--workers", str(workers),
           *[f"http://{h}:{p}" for h, p in replicas]]
    procs = [fleet.spawn("llmgw", cmd, env)]
    for proc in procs:
        _wait_port(port, proc, START_TIMEOUT_S, lambda: _http_ok(port, CHAT_BODY))
    from importlib.metadata import version
    return Proxy("llmgw", [(HOST, port)], procs, version("llmgw") if _has_dist("llmgw") else "")


def _has_dist(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version
    try:
        version(name)
        return True
    except PackageNotFoundError:
        return False


NGINX_CONF = """
worker_processes {workers};
daemon off;
master_process on;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}/nginx-body;
  proxy_temp_path {dir}/nginx-proxy;
  fastcgi_temp_path {dir}/nginx-fastcgi;
  uwsgi_temp_path {dir}/nginx-uwsgi;
  scgi_temp_path {dir}/nginx-scgi;
  upstream engines {{
{servers}
    keepalive 256;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=1024;
    tcp_nodelay on;
    location / {{
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""

#: nginx workers. One, like llmgw's single gateway process; the issue's reference figures
#: for nginx (31-37k req/s) were with a worker per core, so the JSON says which.
NGINX_WORKERS = 1


def start_nginx(fleet: Fleet, replicas: Sequence[tuple[str, int]]) -> Proxy:
    """Start nginx in the foreground as a plain round-robin reverse proxy over ``replicas``."""
    exe = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if exe is None:
        raise RuntimeError("nginx is not installed (python -m bench.gateway_setup installs it)")
    port = free_tcp_port()
    conf = fleet.workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(
        workers=NGINX_WORKERS, dir=fleet.workdir, port=port,
        servers="\n".join(f"    server {h}:{p};" for h, p in replicas)))
    proc = fleet.spawn("nginx", [exe, "-c", str(conf), "-p", str(fleet.workdir), "-e", str(fleet.workdir / "nginx-error.log")])
    _wait_port(port, proc, START_TIMEOUT_S, lambda: _http_ok(port, CHAT_BODY))
    ver = subprocess.run([exe, "-v"], capture_output=True, text=True).stderr.strip().split("/")[-1]
    return Proxy("nginx", [(HOST, port)], [proc], ver)


def _venv_version(venv: Path, dist: str) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def start_rust_router(fleet: Fleet, name: str, replicas: Sequence[tuple[str, int]]) -> Proxy:
    """Start ``sglang-router`` or ``vllm-router`` from its venv with static worker URLs."""
    venv = gateway_setup.venv_dir(name)
    port, metrics_port = free_tcp_port(), free_tcp_port()
    common = ["--host", HOST, "--port", str(port), "--worker-urls", *[f"http://{h}:{p}" for h, p in replicas],
              "--policy", RUST_ROUTER_POLICY, "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
              "--log-level", "warn" if name == "sglang-router" else "warning"]
    if name == "sglang-router":
        cmd = [str(venv / "bin" / "sglang-router"), "launch", *common]
    else:
        cmd = [str(venv / "bin" / "vllm-router"), *common]
    env = {**os.environ, "NO_PROXY": "*", "no_proxy": "*"}
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(key, None)
    proc = fleet.spawn(name, cmd, env)
    _wait_port(port, proc, START_TIMEOUT_S, lambda: _http_ok(port, CHAT_BODY))
    return Proxy(name, [(HOST, port)], [proc], _venv_version(venv, name))


LITELLM_CONFIG = """
model_list:
{deployments}
litellm_settings:
  telemetry: false
  drop_params: true
  set_verbose: false
general_settings:
  disable_spend_logs: true
"""


def start_litellm(fleet: Fleet, replicas: Sequence[tuple[str, int]]) -> Proxy:
    """Start LiteLLM's proxy with the engines as one OpenAI-compatible model (four deployments)."""
    venv = gateway_setup.venv_dir("litellm")
    port = free_tcp_port()
    conf = fleet.workdir / "litellm.yaml"
    conf.write_text(LITELLM_CONFIG.format(deployments="\n".join(
        f"  - model_name: {MODEL}\n    litellm_params:\n      model: openai/{MODEL}\n"
        f"      api_base: http://{h}:{p}/v1\n      api_key: none" for h, p in replicas)))
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False",
           # No master key: a loopback-only benchmark (LiteLLM refuses to start without one otherwise).
           "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
           "LITELLM_LOG": "ERROR", "NO_PROXY": "*", "no_proxy": "*", "DISABLE_SCHEMA_UPDATE": "True"}
    proc = fleet.spawn("litellm", [str(venv / "bin" / "litellm"), "--config", str(conf), "--host", HOST,
                                   "--port", str(port), "--num_workers", "1"], env)
    _wait_port(port, proc, START_TIMEOUT_S, lambda: _http_ok(port, CHAT_BODY))
    return Proxy("litellm", [(HOST, port)], [proc], _venv_version(venv, "litellm"))


# -- load generators ----------------------------------------------------------------------------


def run_wrk(fleet: Fleet, targets: Sequence[tuple[str, int]], concurrency: int, duration: float) -> dict[str, float]:
    """Run ``wrk`` with ``concurrency`` connections split over ``targets``; return merged figures.

    One wrk process per target, all at once (for ``direct``); latency percentiles are
    the request-weighted mean of the per-target percentiles (the targets are alike).
    """
    script = fleet.workdir / "post.lua"
    if not script.exists():
        script.write_text(WRK_LUA % json.dumps(CHAT_BODY))
    used = targets[: max(1, min(len(targets), concurrency))]
    shares = [concurrency // len(used) + (1 if i < concurrency % len(used) else 0) for i in range(len(used))]
    procs = []
    for (host, port), conns in zip(used, shares):
        cmd = ["wrk", "-t1", f"-c{conns}", f"-d{max(1, round(duration))}s", "--timeout", "10s", "-s", str(script),
               f"http://{host}:{port}/v1/chat/completions"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=duration + 60)
        line = next((l for l in out.splitlines() if l.startswith("WRKJSON ")), None)
        if line is None:
            raise RuntimeError(f"wrk printed no result: {out[-500:]}")
        results.append(json.loads(line[len("WRKJSON "):]))
    requests = sum(r["requests"] for r in results)
    seconds = max(r["duration_us"] for r in results) / 1e6
    errors = sum(r[k] for r in results for k in ("connect", "read", "write", "status", "timeout"))
    weight = lambda key: sum(r[key] * r["requests"] for r in results) / max(1, requests) / 1000.0  # noqa: E731
    return {"requests": requests, "rps": requests / seconds if seconds else 0.0, "errors": errors,
            "p50_ms": weight("p50_us"), "p99_ms": weight("p99_us"), "mean_ms": weight("mean_us")}


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


async def _stream_worker(host: str, port: int, stop_at: float, record_from: float, out: dict[str, list[float]]) -> None:
    """Send streaming requests back to back on one keep-alive connection until ``stop_at``.

    Records, for requests started after ``record_from``: total latency, time to the first
    complete SSE event, and the gap between consecutive events (arrival time of the
    socket read that completed each event). Counts errors instead of raising.
    """
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer bench\r\nContent-Length: {len(STREAM_BODY)}\r\n\r\n").encode()
    request = head + STREAM_BODY
    stream: trio.SocketStream | None = None
    conn = h11.Connection(h11.CLIENT)
    while time.perf_counter() < stop_at:
        try:
            with trio.fail_after(30):
                if stream is None:
                    stream = await trio.open_tcp_stream(host, port)
                    conn = h11.Connection(h11.CLIENT)
                t0 = time.perf_counter()
                conn.send(h11.Request(method="POST", target="/v1/chat/completions",
                                      headers=[("host", host), ("content-length", str(len(STREAM_BODY)))]))
                conn.send(h11.Data(data=STREAM_BODY))
                conn.send(h11.EndOfMessage())
                await stream.send_all(request)
                events: list[float] = []
                tail = b""
                status = 0
                while True:
                    ev = conn.next_event()
                    if ev is h11.NEED_DATA:
                        data = await stream.receive_some(65536)
                        if not data:
                            raise ConnectionError("connection closed mid-response")
                        now = time.perf_counter()
                        conn.receive_data(data)
                        continue
                    if isinstance(ev, h11.Response):
                        status = ev.status_code
                    elif isinstance(ev, h11.Data):
                        data = bytes(ev.data)
                        # An event ends with a blank line; one may straddle two reads.
                        events.extend([now] * ((tail[-1:] + data).count(b"\n\n")))
                        tail = (tail + data)[-16:]
                    elif isinstance(ev, h11.EndOfMessage):
                        break
                end = time.perf_counter()
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    await stream.aclose()
                    stream = None
                else:
                    conn.start_next_cycle()
            if t0 < record_from:
                continue
            # The engine may stop before max_tokens (end of sentence); a complete stream ends in [DONE].
            if status != 200 or not tail.rstrip().endswith(b"data: [DONE]") or len(events) < 3:
                out["errors"].append(1.0)
                continue
            out["latency"].append(end - t0)
            out["ttft"].append(events[0] - t0)
            out["gaps"].extend(b - a for a, b in zip(events, events[1:]))
            out["events"].append(float(len(events)))
        except (OSError, ConnectionError, trio.TooSlowError, trio.BrokenResourceError, h11.ProtocolError):
            out["errors"].append(1.0)
            if stream is not None:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
            stream = None
    if stream is not None:
        await stream.aclose()


def run_streams(targets: Sequence[tuple[str, int]], concurrency: int, duration: float) -> dict[str, float]:
    """Run ``concurrency`` streaming clients split over ``targets`` for ``duration`` s; return the figures."""
    out: dict[str, list[float]] = {"latency": [], "ttft": [], "gaps": [], "errors": [], "events": []}

    async def main() -> None:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                host, port = targets[i % len(targets)]
                nursery.start_soon(_stream_worker, host, port, start + WARMUP_S + duration, start + WARMUP_S, out)

    trio.run(main)
    done = len(out["latency"])
    return {"requests": done, "rps": done / duration, "errors": len(out["errors"]),
            "p50_ms": _percentile(out["latency"], 50) * 1e3, "p99_ms": _percentile(out["latency"], 99) * 1e3,
            "ttft_p50_ms": _percentile(out["ttft"], 50) * 1e3, "ttft_p99_ms": _percentile(out["ttft"], 99) * 1e3,
            "chunk_gap_p50_ms": _percentile(out["gaps"], 50) * 1e3, "chunk_gap_p99_ms": _percentile(out["gaps"], 99) * 1e3,
            "events_per_stream": statistics.fmean(out["events"]) if out["events"] else float("nan")}


def measure(fleet: Fleet, proxy: Proxy, scenario: str, duration: float) -> dict[str, float]:
    """Run one scenario against ``proxy``; return its figures with CPU seconds per 1,000 requests."""
    if scenario == "stream":
        before = proxy.cpu_seconds() if proxy.procs else 0.0
        result = run_streams(proxy.targets, STREAM_CONCURRENCY, duration)
    else:
        concurrency = int(scenario[1:])
        # Short warm-up so connection setup is not billed to the measured run.
        run_wrk(fleet, proxy.targets, concurrency, 1) if duration >= 3 else None
        before = proxy.cpu_seconds() if proxy.procs else 0.0
        result = run_wrk(fleet, proxy.targets, concurrency, duration)
    if proxy.procs:
        spent = proxy.cpu_seconds() - before
        result["cpu_s_per_1k"] = spent / max(1, result["requests"]) * 1000.0
    return result


# -- the run ----------------------------------------------------------------------------------


PEER_STARTERS: dict[str, Callable[[Fleet, Sequence[tuple[str, int]]], Proxy]] = {
    "nginx": start_nginx,
    "sglang-router": lambda fleet, reps: start_rust_router(fleet, "sglang-router", reps),
    "vllm-router": lambda fleet, reps: start_rust_router(fleet, "vllm-router", reps),
    "litellm": start_litellm,
}


def _median(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = rows[0].keys()
    return {k: statistics.median(r[k] for r in rows if k in r and not math.isnan(r[k])) if any(
        k in r and not math.isnan(r[k]) for r in rows) else float("nan") for k in keys}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, 3)


def ratios(results: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Return the issue's target ratios from per-target medians (None where a peer is missing)."""
    def fig(target: str, scenario: str, key: str) -> float | None:
        return results.get(target, {}).get(scenario, {}).get(key)

    def added(target: str, scenario: str = "c1", key: str = "p50_ms") -> float | None:
        a, d = fig(target, scenario, key), fig("direct", scenario, key)
        return None if a is None or d is None else max(a - d, 0.001)

    out: dict[str, Any] = {}
    for peer in ("sglang-router", "vllm-router", "nginx"):
        out[f"llmgw_vs_{peer}_rps_c16"] = _ratio(fig("llmgw", "c16", "rps"), fig(peer, "c16", "rps"))
        out[f"llmgw_vs_{peer}_added_p50_c1"] = _ratio(added("llmgw"), added(peer))
    out["llmgw_vs_litellm_rps_c16"] = _ratio(fig("llmgw", "c16", "rps"), fig("litellm", "c16", "rps"))
    out["added_p50_ms_c1"] = {t: round(v, 4) for t in results if t != "direct" and (v := added(t)) is not None}
    out["added_ttft_p50_ms"] = {t: round(v, 4) for t in results if t != "direct"
                                and (v := added(t, "stream", "ttft_p50_ms")) is not None}
    targets = {
        "rps_c16_vs_sglang_router>=0.5": out["llmgw_vs_sglang-router_rps_c16"],
        "rps_c16_vs_vllm_router>=0.5": out["llmgw_vs_vllm-router_rps_c16"],
        "added_p50_c1_vs_sglang_router<=2": out["llmgw_vs_sglang-router_added_p50_c1"],
        "added_p50_c1_vs_vllm_router<=2": out["llmgw_vs_vllm-router_added_p50_c1"],
        "rps_c16_vs_litellm>20": out["llmgw_vs_litellm_rps_c16"],
    }
    limits = {">=0.5": lambda v: v >= 0.5, "<=2": lambda v: v <= 2, ">20": lambda v: v > 20}
    out["targets_met"] = {
        name: (None if value is None else next(check(value) for suffix, check in limits.items() if name.endswith(suffix)))
        for name, value in targets.items()
    }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start everything, run every round, stop everything; return the report."""
    peers = gateway_setup.install() if args.setup else gateway_setup.locate()
    if not peers["wrk"]["ok"]:
        raise SystemExit(f"wrk is required: {peers['wrk']['reason']}")
    scenarios = [f"c{c}" for c in CONCURRENCIES] + ["stream"]
    wanted = [p for p in ("nginx", "sglang-router", "vllm-router", "litellm") if p not in args.skip]
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()},
        "settings": {"replicas": args.replicas, "rounds": args.rounds, "duration_s": args.duration,
                     "nonstream_max_tokens": NONSTREAM_MAX_TOKENS, "stream_chunks": STREAM_CHUNKS,
                     "stream_concurrency": STREAM_CONCURRENCY, "nginx_workers": NGINX_WORKERS,
                     "llmgw_workers": args.workers, "rust_router_policy": RUST_ROUTER_POLICY,
                     "decode_us_per_token": args.decode_us},
        "peers": {}, "results": {}, "rounds": {},
    }
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        fleet = Fleet(Path(tmp))
        try:
            log(f"starting {args.replicas} simulated replicas")
            replicas = start_replicas(fleet, args.replicas, args.decode_us)
            proxies: list[Proxy] = [Proxy("direct", replicas, [])]
            log("starting llmgw")
            proxies.append(start_llmgw(fleet, replicas, args.workers))
            report["peers"]["llmgw"] = {"ok": True, "version": proxies[-1].version}
            slow: list[Proxy] = []
            for name in wanted:
                status = peers.get(name, {"ok": True})
                if not status["ok"]:
                    report["peers"][name] = {"ok": False, "reason": status["reason"]}
                    log(f"{name}: unavailable ({status['reason']})")
                    continue
                log(f"starting {name}")
                try:
                    proxy = PEER_STARTERS[name](fleet, replicas)
                except Exception as error:  # any failure to start a peer is a result, not a crash
                    reason = f"failed to start: {error}; log: {fleet.log_tail(name)}"
                    report["peers"][name] = {"ok": False, "reason": reason}
                    log(f"{name}: {reason}")
                    continue
                report["peers"][name] = {"ok": True, "version": proxy.version}
                (slow if name in SLOW_PEERS else proxies).append(proxy)
            rows: dict[str, dict[str, list[dict[str, float]]]] = {}
            for rnd in range(args.rounds):
                for scenario in scenarios:
                    for proxy in proxies:
                        if not proxy.alive():
                            continue
                        result = measure(fleet, proxy, scenario, args.duration)
                        rows.setdefault(proxy.name, {}).setdefault(scenario, []).append(result)
                        log(f"round {rnd + 1} {scenario:6} {proxy.name:14} " + " ".join(
                            f"{k}={v:.3f}" for k, v in result.items() if k != "requests"))
            for proxy in slow:  # one round, short, without c64: LiteLLM is ~500x slower
                for scenario in ("c1", "c16", "stream"):
                    result = measure(fleet, proxy, scenario, min(args.duration, 5.0))
                    rows.setdefault(proxy.name, {}).setdefault(scenario, []).append(result)
                    log(f"slow   {scenario:6} {proxy.name:14} " + " ".join(
                        f"{k}={v:.3f}" for k, v in result.items() if k != "requests"))
            for proxy in proxies + slow:
                if not proxy.alive():
                    report["peers"][proxy.name]["died"] = fleet.log_tail(proxy.name)
            report["results"] = {name: {s: _median(r) for s, r in per.items()} for name, per in rows.items()}
            report["rounds"] = rows
            report["ratios"] = ratios(report["results"])
            report["machine"]["load_avg_end"] = os.getloadavg()
        finally:
            fleet.close()
    return report


# -- llmgw's gateway process ----------------------------------------------------------------------


def serve_llmgw(port: int, urls: Sequence[str], workers: int) -> None:
    """Run llmgw's router alone on 127.0.0.1:``port`` over the engines at ``urls`` (until SIGTERM)."""
    from llmgw.router import Replica, ReplicaTable, create_app, serve_gateway

    table = ReplicaTable()
    table.set_model_replicas(MODEL, [Replica(id=f"r{i}", model=MODEL, endpoint=url) for i, url in enumerate(urls)])

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            if workers > 1:
                from llmgw.config import AuthConfig, GatewayConfig
                from llmgw.router.build import build_gateway
                from llmgw.router.replicas import ModelInfo
                from llmgw.router.settings import GatewaySettings

                pool = build_gateway(GatewaySettings(gateway=GatewayConfig(workers=workers),
                                                     auth=AuthConfig(enabled=False)))
                pool.replace_routes({MODEL: table.replicas(MODEL) or ()}, {MODEL: ModelInfo()})
                await nursery.start(pool.serve, HOST, port)
            else:
                await nursery.start(partial(serve_gateway, create_app(table), HOST, port))
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

    trio.run(main)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, run the benchmark, print the JSON report as the last stdout line."""
    p = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round of 2 s per scenario (under 3 minutes)")
    p.add_argument("--replicas", type=int, default=4, help="simulated engines (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians over rounds (default 3)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per scenario and target (default 5)")
    p.add_argument("--workers", type=int, default=1, help="llmgw gateway worker processes (default 1)")
    p.add_argument("--decode-us", type=float, default=0.0, help="simulated decode time per token (default 0)")
    p.add_argument("--skip", action="append", default=[], help="a peer to leave out (repeatable)")
    p.add_argument("--setup", action="store_true", help="install missing peers first (package registries)")
    p.add_argument("--serve-llmgw", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("urls", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_llmgw is not None:
        serve_llmgw(args.serve_llmgw, args.urls, args.workers)
        return
    if args.quick:
        args.rounds, args.duration = 1, 2.0
    started = time.monotonic()
    report = run(args)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(_clean(report), default=str))


def _clean(value: Any) -> Any:
    """Return ``value`` with NaN floats (no sample) replaced by None and floats rounded, for JSON."""
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 4)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


if __name__ == "__main__":
    main()
