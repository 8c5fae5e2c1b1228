"""Gateway overhead benchmark: llmgw against nginx, sglang-router, vllm-router and LiteLLM.

``python -m bench.gateway [--quick] [--replicas N] [--rounds R] [--duration S] [--engine fast|sim]``
starts, on this machine and on 127.0.0.1 only:

* N engines. ``--engine fast`` (default): ``bench/fastengine.c``, a single-threaded epoll
  HTTP/1.1 server in C that answers OpenAI chat/completions requests with no model behind
  them, built with ``gcc -O2`` on first use into ``~/.cache/llmgw-bench/fastengine-<source
  hash>``. Each costs ~10 us of CPU per request (wrk at c16 straight at them reaches
  ~100k req/s on 2 cores), far below any proxy, so the proxies are measured rather than
  capped by the engines; the ``direct`` row bills the engines' own CPU to show it. Streams
  send one token per SSE event, each its own write and HTTP chunk, on a step grid of
  ``--stream-token-us`` (default 1 ms; see :data:`STREAM_TOKEN_US`). Without a C compiler
  or when the build fails the run falls back to ``sim`` and says why in
  ``settings.engine_fallback_reason``. ``--engine sim``: ``python -m llmgw.sim`` (no prefill
  cost, ``--decode-us`` per token), about as slow per request as the proxies, which
  compresses every ratio; kept for comparison with earlier figures.
* the proxies under test, each pointed at all N: llmgw's gateway (the router alone,
  ``serve_gateway`` of a ``Gateway`` in its own process, routing ``least-load``), nginx as a
  plain reverse proxy, ``sglang-router`` and ``vllm-router`` (round robin), LiteLLM's proxy,
  ``trio-floor`` (``bench/trio_floor.py``: the least a trio proxy in Python does per
  request, the same socket calls as llmgw's hot path and none of its layers), and the
  cache-aware pair issue 13 compares: ``llmgw-kv`` (llmgw with the routing it ships with,
  ``kv``: with engines that publish no KV events it matches the prompt text) and
  ``sglang-router-ca`` (sglang-router's ``cache_aware`` policy),

and measures every target, plus the engines directly ("direct": one load generator per
engine, the load split evenly), round by round so that all targets see the same machine
state: non-streaming chat completions at concurrency 1, 16 and 64 with ``wrk``, and
64-chunk streams, 16 concurrent (the issue's figure), with a one-thread epoll client that
timestamps every SSE event. Figures per target and scenario: requests/s, p50/p99
latency, time to first token and inter-chunk p50/p99 (streams), and
``cpu_ms_per_request``: the proxy's CPU (psutil on the proxy and its children over the
measured run) per request, a stream counting as one, and ``sys_ms_per_request``, its kernel
part. ``ratios`` holds, beside the throughput and added-latency ratios,
``cpu_ms_per_request`` and ``sys_ms_per_request`` per target for c16, c64 and stream,
``added_ttft_p50_ms`` (stream TTFT p50 over direct's) per target, and
``targets_met`` for the issue's goals: CPU per request at c16 and c64 at most
sglang-router's (the cheapest paths, least-load against round robin, and the cache-aware
pair), added TTFT p50 at most 0.5 ms (both llmgw configurations), req/s at c16 at least half the Rust
routers', added p50 at c1 at most twice theirs, over 20x LiteLLM's req/s. The medians
over rounds, the settings (engine kind, stream concurrency and pacing) and the ratios are
printed as one JSON object on the last stdout line; progress goes to stderr.

Peers come from ``python -m bench.gateway_setup`` (``--setup`` runs it first). A peer
that is not installed or does not start is reported with the reason, never a crash.
The load generator, the proxies and the engines share the machine's cores: compare
ratios from one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import selectors
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
from typing import Any, Callable, Sequence

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
#: Concurrent streams in the streaming scenario (the issue's "64 chunks, 16 concurrent").
STREAM_CONCURRENCY = 16
#: Microseconds between two tokens of a fast engine's stream (``--stream-token-us``). With
#: back-to-back tokens (0) 16 closed-loop streams saturate whatever is slowest, and on a
#: 2-core machine that is the Python stream client itself: direct TTFT p50 rose from 0.12 ms
#: at 1 stream to ~5 ms at 16 (~12 ms with the former trio+h11 client), so "added TTFT" was
#: client queueing, not proxy latency. At 1 ms per token (a step grid per engine, like a batch
#: decoding one token per sequence per step; still faster than real engines) 16 streams are
#: 16,000 events/s through the proxy, the client uses under half a core, and direct TTFT p50
#: stays within ~0.1 ms of its 1-stream value.
STREAM_TOKEN_US = 1000.0
#: Seconds a proxy gets to start listening (LiteLLM imports for a long time).
START_TIMEOUT_S = 120.0
#: Seconds of load before measuring, per scenario (connection setup, JIT-less warm caches).
WARMUP_S = 0.5
#: LiteLLM manages ~50 req/s: it gets shorter runs and no c64/streaming rounds beyond one.
SLOW_PEERS = frozenset({"litellm"})
#: Routing policy given to the Rust routers: round robin is their cheapest path.
RUST_ROUTER_POLICY = "round_robin"
#: The cache-aware pair, run beside the cheapest paths: llmgw with the routing it ships with
#: (``routing.policy: kv``; the fast engines publish no KV events, so it matches the prompt
#: text, approximately) against sglang-router's cache-aware policy (a radix tree of the prompt
#: text), the pair issue 13's CPU goal compares (its sglang-router was "cache-aware").
LLMGW_KV_POLICY = "kv"
#: llmgw's routing in the cheapest-path comparison (``llmgw``): fewest requests in flight.
LLMGW_POLICY = "least-load"
SGLANG_CACHE_AWARE_POLICY = "cache_aware"

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

    def cpu_split(self) -> tuple[float, float]:
        """Return (user, system) CPU seconds of the proxy processes and all their children so far."""
        user = system = 0.0
        for proc in self.procs:
            try:
                root = psutil.Process(proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        t = p.cpu_times()
                        user += t.user
                        system += t.system
            except psutil.Error:
                pass
        return user, system

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


#: The C engine's source, next to this file; built once per source hash under the bench cache.
FASTENGINE_SRC = Path(__file__).resolve().with_name("fastengine.c")


def build_fastengine() -> Path:
    """Return the path of the compiled fast engine, building it with ``gcc -O2`` if needed.

    The binary lives in ``~/.cache/llmgw-bench/fastengine-<sha256 of the source>`` (the
    cache of :mod:`bench.gateway_setup`) and is reused while the source is unchanged.
    Raises RuntimeError with the reason when there is no compiler or the build fails.
    """
    source = FASTENGINE_SRC.read_bytes()
    exe = gateway_setup.CACHE_DIR / f"fastengine-{hashlib.sha256(source).hexdigest()[:16]}"
    if exe.exists():
        return exe
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    exe.parent.mkdir(parents=True, exist_ok=True)
    tmp = exe.with_name(f"{exe.name}.{os.getpid()}.tmp")
    try:
        built = subprocess.run([cc, "-O2", "-o", str(tmp), str(FASTENGINE_SRC)], capture_output=True, text=True,
                               timeout=120)
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"{cc} failed to run: {error}") from None
    if built.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cc} exited with {built.returncode}: {built.stderr.strip()[-500:]}")
    tmp.replace(exe)  # atomic: a concurrent run sees the old state or a complete binary
    for stale in exe.parent.glob("fastengine-*"):  # builds of earlier sources
        if stale != exe and not stale.name.endswith(".tmp"):
            stale.unlink(missing_ok=True)
    return exe


def start_fast_replicas(fleet: Fleet, count: int, exe: Path, token_us: float
                        ) -> tuple[list[tuple[str, int]], list[subprocess.Popen[bytes]]]:
    """Start ``count`` C fast engines (stream tokens ``token_us`` apart); return their (host, port) and
    processes (the Fleet stops them)."""
    started = []
    for i in range(count):
        port = free_tcp_port()
        proc = fleet.spawn(f"engine{i}", [str(exe), "--host", HOST, "--port", str(port), "--model", MODEL,
                                          "--chunks", str(STREAM_CHUNKS), "--max-tokens", str(NONSTREAM_MAX_TOKENS),
                                          "--token-us", str(token_us)])
        started.append((port, proc))
    for port, proc in started:
        _wait_port(port, proc, 10.0, lambda: _http_ok(port, CHAT_BODY))  # noqa: B023 (called at once)
    return [(HOST, port) for port, _ in started], [proc for _, proc in started]


def start_replicas(fleet: Fleet, count: int, decode_us: float) -> tuple[list[tuple[str, int]], list[subprocess.Popen[str]]]:
    """Start ``count`` simulated engines; return their (host, port) and processes."""
    pending = [
        start_sim(["--model", MODEL, "--port", "0", "--prefill-us-per-token", "0", "--decode-us-per-token",
                   str(decode_us), "--max-tokens-default", str(NONSTREAM_MAX_TOKENS), "--max-num-seqs", "1024"],
                  wait=False)
        for _ in range(count)
    ]
    fleet.sims.extend(pending)
    for sim in pending:
        sim.wait_listening(60.0)
    return [(sim.host, sim.port) for sim in pending], [sim.proc for sim in pending]


def start_llmgw(fleet: Fleet, replicas: Sequence[tuple[str, int]], workers: int, default_gc: bool = False,
                routing: str = LLMGW_POLICY, name: str = "llmgw") -> Proxy:
    """Start llmgw's gateway (router only) in its own process over ``replicas``, routing by the
    policy ``routing`` names (``default_gc``: with CPython's garbage-collector settings instead
    of the server's); the proxy is called ``name``."""
    port = free_tcp_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    # One process; with --workers N > 1 it runs llmgw's GatewayPool (the server's
    # gateway.workers): N worker processes on the port, fed over their channels.
    cmd = [sys.executable, "-m", "bench.gateway", "--serve-llmgw", str(port), "--workers", str(workers),
           "--routing", routing, *(["--default-gc"] if default_gc else []),
           *[f"http://{h}:{p}" for h, p in replicas]]
    procs = [fleet.spawn(name, cmd, env)]
    for proc in procs:
        _wait_port(port, proc, START_TIMEOUT_S, lambda: _http_ok(port, CHAT_BODY))
    from importlib.metadata import version
    return Proxy(name, [(HOST, port)], procs, version("llmgw") if _has_dist("llmgw") else "")


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


def start_trio_floor(fleet: Fleet, replicas: Sequence[tuple[str, int]]) -> Proxy:
    """Start ``bench/trio_floor.py``, the least a trio proxy in Python does, over ``replicas``."""
    port = free_tcp_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = fleet.spawn("trio-floor", [sys.executable, "-m", "bench.trio_floor", str(port),
                                      *[f"{h}:{p}" for h, p in replicas]], env)
    _wait_port(port, proc, START_TIMEOUT_S, lambda: _http_ok(port, CHAT_BODY))
    return Proxy("trio-floor", [(HOST, port)], [proc], f"trio {trio.__version__}")


def _venv_version(venv: Path, dist: str) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def start_rust_router(fleet: Fleet, name: str, replicas: Sequence[tuple[str, int]],
                      policy: str = RUST_ROUTER_POLICY, label: str = "") -> Proxy:
    """Start ``sglang-router`` or ``vllm-router`` from its venv with static worker URLs, routing
    by ``policy``; the proxy is called ``label`` (default ``name``)."""
    venv = gateway_setup.venv_dir(name)
    label = label or name
    port, metrics_port = free_tcp_port(), free_tcp_port()
    common = ["--host", HOST, "--port", str(port), "--worker-urls", *[f"http://{h}:{p}" for h, p in replicas],
              "--policy", policy, "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
              "--log-level", "warn" if name == "sglang-router" else "warning"]
    if name == "sglang-router":
        cmd = [str(venv / "bin" / "sglang-router"), "launch", *common]
    else:
        cmd = [str(venv / "bin" / "vllm-router"), *common]
    env = {**os.environ, "NO_PROXY": "*", "no_proxy": "*"}
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(key, None)
    proc = fleet.spawn(label, cmd, env)
    _wait_port(port, proc, START_TIMEOUT_S, lambda: _http_ok(port, CHAT_BODY))
    return Proxy(label, [(HOST, port)], [proc], _venv_version(venv, name))


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


class _StreamConn:
    """One keep-alive connection of the stream client and the parser of its current answer.

    A minimal HTTP/1.1 response parser (status line, then a Content-Length or chunked body)
    that timestamps every complete SSE event (a blank line) by the socket read that
    completed it. Chunk framing never holds a blank line, and an event split over two HTTP
    chunks still counts once (the previous body byte is kept).
    """

    def __init__(self, host: str, port: int) -> None:
        self.addr = (host, port)
        self.request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                        f"Authorization: Bearer bench\r\nContent-Length: {len(STREAM_BODY)}\r\n\r\n").encode() + STREAM_BODY
        self.sock: socket.socket | None = None
        self.busy = False
        self.retry_at = 0.0
        self.t0 = self.deadline = 0.0

    def start(self, now: float) -> socket.socket | None:
        """Send the next request, connecting first if needed; return a newly opened socket (to register)."""
        opened = None
        if self.sock is None:
            opened = self.sock = socket.create_connection(self.addr, timeout=10.0)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.state = "head"
        self.status = 0
        self.remaining = 0
        self.close_after = False
        self.events: list[float] = []
        self.last = b""  # the previous body byte, so an event split over two chunks counts once
        self.tail = b""  # the last body bytes, to check that the stream ended in [DONE]
        self.busy = True
        self.t0 = time.perf_counter()
        self.deadline = now + 30.0
        self.sock.sendall(self.request)
        return opened

    def _body(self, data: bytes, now: float) -> None:
        self.events.extend([now] * (self.last + data).count(b"\n\n"))
        self.last = data[-1:]
        self.tail = (self.tail + data)[-16:]

    def feed(self, data: bytes, now: float) -> bool:
        """Consume bytes read at ``now``; return True once the answer is complete (raises ValueError if malformed)."""
        buf = self.buf
        buf += data
        while True:
            if self.state == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return False
                lines = bytes(buf[:end]).split(b"\r\n")
                self.status = int(lines[0].split(b" ", 2)[1])
                chunked, length = False, 0
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name, value = name.strip().lower(), value.strip().lower()
                    if name == b"transfer-encoding":
                        chunked = b"chunked" in value
                    elif name == b"content-length":
                        length = int(value)
                    elif name == b"connection":
                        self.close_after = value == b"close"
                del buf[: end + 4]
                self.state, self.remaining = ("size", 0) if chunked else ("body", length)
            elif self.state in ("body", "data"):
                if self.remaining == 0:
                    if self.state == "body":
                        return True
                    self.state = "crlf"
                    continue
                if not buf:
                    return False
                take = min(len(buf), self.remaining)
                self._body(bytes(buf[:take]), now)
                del buf[:take]
                self.remaining -= take
            elif self.state == "crlf":
                if len(buf) < 2:
                    return False
                del buf[:2]
                self.state = "size"
            else:  # "size" (a chunk-size line) or "trailer" (after the last chunk, up to an empty line)
                eol = buf.find(b"\r\n")
                if eol < 0:
                    return False
                line = bytes(buf[:eol])
                del buf[: eol + 2]
                if self.state == "trailer":
                    if not line:
                        return True
                    continue
                size = int(line.split(b";")[0], 16)
                self.state, self.remaining = ("trailer", 0) if size == 0 else ("data", size)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None
        self.busy = False


def run_streams(targets: Sequence[tuple[str, int]], concurrency: int, duration: float,
                at_record: Callable[[], None] | None = None) -> dict[str, float]:
    """Run ``concurrency`` streaming clients split over ``targets`` for ``duration`` s; return the figures.

    ``at_record`` is called once when the warm-up ends (to read the proxy's CPU there).

    Each client sends streaming requests back to back on one keep-alive connection and
    records, for requests started after the warm-up: total latency, time to the first
    complete SSE event, and the gap between consecutive events (arrival time of the
    socket read that completed each event). Errors are counted, never raised.

    One thread over an epoll selector with plain sockets: it costs about half of what the
    former trio+h11 client did per stream, so that at STREAM_CONCURRENCY paced streams the
    client stays under half a core and direct TTFT p50 stays within ~0.1 ms of its
    1-stream value ("added TTFT" is only honest while the client is not the bottleneck).
    """
    out: dict[str, list[float]] = {"latency": [], "ttft": [], "gaps": [], "errors": [], "events": []}
    conns = [_StreamConn(*targets[i % len(targets)]) for i in range(concurrency)]
    start = time.perf_counter()
    record_from, stop_at = start + WARMUP_S, start + WARMUP_S + duration
    with selectors.DefaultSelector() as sel:

        def fail(conn: _StreamConn, now: float) -> None:
            out["errors"].append(1.0)
            if conn.sock is not None:
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(conn.sock)
            conn.close()
            conn.retry_at = now + 0.05  # a refused connection is not retried in a busy loop

        def begin(conn: _StreamConn, now: float) -> None:
            try:
                opened = conn.start(now)
                if opened is not None:
                    sel.register(opened, selectors.EVENT_READ, conn)
            except OSError:
                fail(conn, now)

        def finish(conn: _StreamConn, end: float) -> None:
            conn.busy = False
            if conn.t0 >= record_from:
                # A complete stream ends in [DONE] after the role event and some tokens.
                if conn.status != 200 or not conn.tail.rstrip().endswith(b"data: [DONE]") or len(conn.events) < 3:
                    out["errors"].append(1.0)
                else:
                    out["latency"].append(end - conn.t0)
                    out["ttft"].append(conn.events[0] - conn.t0)
                    out["gaps"].extend(b - a for a, b in zip(conn.events, conn.events[1:]))
                    out["events"].append(float(len(conn.events)))
            if conn.close_after:
                sel.unregister(conn.sock)
                conn.close()
            if end < stop_at:
                begin(conn, end)

        now = time.perf_counter()
        for conn in conns:
            begin(conn, now)
        while True:
            now = time.perf_counter()
            if at_record is not None and now >= record_from:
                at_record()
                at_record = None
            busy = [c for c in conns if c.busy]
            if now >= stop_at and not busy:
                break
            for conn in conns:
                if not conn.busy and now < stop_at and conn.retry_at <= now:
                    begin(conn, now)
            waits = [c.deadline - now for c in busy] + [c.retry_at - now for c in conns if not c.busy and now < stop_at]
            if at_record is not None:
                waits.append(record_from - now)
            for key, _ in sel.select(max(0.0, min([0.1, *waits]))):
                conn = key.data
                try:
                    data = conn.sock.recv(262144)
                except OSError:
                    fail(conn, time.perf_counter())
                    continue
                now = time.perf_counter()
                if not data or not conn.busy:
                    fail(conn, now)  # closed mid-answer, or bytes nobody asked for
                    continue
                try:
                    complete = conn.feed(data, now)
                except (ValueError, IndexError):
                    fail(conn, now)
                    continue
                if complete:
                    finish(conn, now)
            now = time.perf_counter()
            for conn in conns:
                if conn.busy and now > conn.deadline:
                    fail(conn, now)
        for conn in conns:
            conn.close()
    done = len(out["latency"])
    return {"requests": done, "rps": done / duration, "errors": len(out["errors"]),
            "p50_ms": _percentile(out["latency"], 50) * 1e3, "p99_ms": _percentile(out["latency"], 99) * 1e3,
            "ttft_p50_ms": _percentile(out["ttft"], 50) * 1e3, "ttft_p99_ms": _percentile(out["ttft"], 99) * 1e3,
            "chunk_gap_p50_ms": _percentile(out["gaps"], 50) * 1e3, "chunk_gap_p99_ms": _percentile(out["gaps"], 99) * 1e3,
            "events_per_stream": statistics.fmean(out["events"]) if out["events"] else float("nan")}


def measure(fleet: Fleet, proxy: Proxy, scenario: str, duration: float) -> dict[str, float]:
    """Run one scenario against ``proxy``; return its figures with its CPU milliseconds per request.

    ``cpu_ms_per_request`` (the former ``cpu_s_per_1k``, same number) is the user+system CPU
    of the proxy's processes over the measured run divided by the requests completed in it,
    a stream counting as one request; for ``direct`` it is the engines' own CPU.
    ``sys_ms_per_request`` is the system (kernel) part of it: the socket calls and the
    waits, which no proxy avoids; the rest is the proxy's own code.
    """
    if scenario == "stream":
        marks: list[tuple[float, float]] = []
        # CPU from the end of the warm-up; streams in flight then balance those still open at the end.
        result = run_streams(proxy.targets, STREAM_CONCURRENCY, duration,
                             lambda: marks.append(proxy.cpu_split() if proxy.procs else (0.0, 0.0)))
        before = marks[0] if marks else (0.0, 0.0)
    else:
        concurrency = int(scenario[1:])
        # Short warm-up so connection setup is not billed to the measured run.
        run_wrk(fleet, proxy.targets, concurrency, 1) if duration >= 3 else None
        before = proxy.cpu_split() if proxy.procs else (0.0, 0.0)
        result = run_wrk(fleet, proxy.targets, concurrency, duration)
    if proxy.procs:
        user_before, system_before = before
        user, system = proxy.cpu_split()
        ms_per_request = 1000.0 / max(1, result["requests"])
        result["cpu_ms_per_request"] = (user - user_before + system - system_before) * ms_per_request
        result["sys_ms_per_request"] = (system - system_before) * ms_per_request
    return result


# -- the run ----------------------------------------------------------------------------------


PEER_STARTERS: dict[str, Callable[[Fleet, Sequence[tuple[str, int]]], Proxy]] = {
    "nginx": start_nginx,
    "sglang-router": lambda fleet, reps: start_rust_router(fleet, "sglang-router", reps),
    "sglang-router-ca": lambda fleet, reps: start_rust_router(fleet, "sglang-router", reps,
                                                              SGLANG_CACHE_AWARE_POLICY, "sglang-router-ca"),
    "vllm-router": lambda fleet, reps: start_rust_router(fleet, "vllm-router", reps),
    "litellm": start_litellm,
    "trio-floor": start_trio_floor,
}

#: Peers that are another configuration of an installed one: its install status is theirs.
PEER_INSTALLS = {"sglang-router-ca": "sglang-router"}


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
    # CPU per request (per stream for "stream") of each proxy's processes; "direct" is the engines'.
    # All CPU, and its kernel part (system CPU): what is left of the first is the proxy's own code.
    for figure in ("cpu_ms_per_request", "sys_ms_per_request"):
        out[figure] = {
            t: {s: round(v, 4) for s in ("c16", "c64", "stream") if (v := fig(t, s, figure)) is not None}
            for t in results}
    for peer in ("sglang-router", "vllm-router", "nginx", "trio-floor"):
        for scenario in ("c16", "c64", "stream"):
            out[f"llmgw_vs_{peer}_cpu_per_request_{scenario}"] = _ratio(
                fig("llmgw", scenario, "cpu_ms_per_request"), fig(peer, scenario, "cpu_ms_per_request"))
    # The cache-aware pair (LLMGW_KV_POLICY against SGLANG_CACHE_AWARE_POLICY), the issue's own.
    for scenario in ("c16", "c64", "stream"):
        out[f"llmgw-kv_vs_sglang-router-ca_cpu_per_request_{scenario}"] = _ratio(
            fig("llmgw-kv", scenario, "cpu_ms_per_request"), fig("sglang-router-ca", scenario, "cpu_ms_per_request"))
    targets = {
        "cpu_per_request_c64_vs_sglang_router<=1": out["llmgw_vs_sglang-router_cpu_per_request_c64"],
        "cpu_per_request_c16_vs_sglang_router<=1": out["llmgw_vs_sglang-router_cpu_per_request_c16"],
        "cache_aware_cpu_per_request_c64_vs_sglang_router<=1": out["llmgw-kv_vs_sglang-router-ca_cpu_per_request_c64"],
        "cache_aware_cpu_per_request_c16_vs_sglang_router<=1": out["llmgw-kv_vs_sglang-router-ca_cpu_per_request_c16"],
        "added_ttft_p50_ms<=0.5": out["added_ttft_p50_ms"].get("llmgw"),
        "cache_aware_added_ttft_p50_ms<=0.5": out["added_ttft_p50_ms"].get("llmgw-kv"),
        "rps_c16_vs_sglang_router>=0.5": out["llmgw_vs_sglang-router_rps_c16"],
        "rps_c16_vs_vllm_router>=0.5": out["llmgw_vs_vllm-router_rps_c16"],
        "added_p50_c1_vs_sglang_router<=2": out["llmgw_vs_sglang-router_added_p50_c1"],
        "added_p50_c1_vs_vllm_router<=2": out["llmgw_vs_vllm-router_added_p50_c1"],
        "rps_c16_vs_litellm>20": out["llmgw_vs_litellm_rps_c16"],
    }
    limits = {">=0.5": lambda v: v >= 0.5, "<=0.5": lambda v: v <= 0.5, "<=1": lambda v: v <= 1,
              "<=2": lambda v: v <= 2, ">20": lambda v: v > 20}
    out["targets_met"] = {
        name: (None if value is None else next(check(value) for suffix, check in limits.items() if name.endswith(suffix)))
        for name, value in targets.items()
    }
    return out


def start_engines(fleet: Fleet, args: argparse.Namespace, settings: dict[str, Any]
                  ) -> tuple[list[tuple[str, int]], list[subprocess.Popen[Any]]]:
    """Start the engines ``args.engine`` asks for; fall back from ``fast`` to ``sim`` with the reason.

    Records the engine kind used and its pacing in ``settings``.
    """
    if args.engine == "fast":
        try:
            exe = build_fastengine()
            log(f"starting {args.replicas} fast engines ({exe.name}, {args.stream_token_us:g} us per stream token)")
            replicas, procs = start_fast_replicas(fleet, args.replicas, exe, args.stream_token_us)
            settings.update(engine="fast", stream_token_us=args.stream_token_us)
            return replicas, list(procs)
        except RuntimeError as error:  # no compiler, a failed build or an engine that does not answer
            reason = f"fast engine unavailable: {error}; {fleet.log_tail('engine0')}".rstrip("; ")
            log(f"{reason}; falling back to --engine sim")
            settings["engine_fallback_reason"] = reason
            for proc in fleet.procs:
                fleet.stop(proc)
            fleet.procs.clear()
    log(f"starting {args.replicas} simulated replicas ({args.decode_us:g} us decode per token)")
    replicas, sims = start_replicas(fleet, args.replicas, args.decode_us)
    settings.update(engine="sim", decode_us_per_token=args.decode_us)
    return replicas, list(sims)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start everything, run every round, stop everything; return the report."""
    peers = gateway_setup.install() if args.setup else gateway_setup.locate()
    if not peers["wrk"]["ok"]:
        raise SystemExit(f"wrk is required: {peers['wrk']['reason']}")
    scenarios = [f"c{c}" for c in CONCURRENCIES] + ["stream"]
    wanted = [p for p in ("llmgw-kv", "trio-floor", "nginx", "sglang-router", "sglang-router-ca", "vllm-router", "litellm")
              if p not in args.skip]
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg(),
                    # llmgw and the trio floor run on this interpreter; its build matters
                    # (bench/README.md, "The interpreter").
                    "python": {"executable": sys.executable, "version": sys.version.split()[0],
                               "base": sys.base_prefix}},
        "settings": {"replicas": args.replicas, "rounds": args.rounds, "duration_s": args.duration,
                     "nonstream_max_tokens": NONSTREAM_MAX_TOKENS, "stream_chunks": STREAM_CHUNKS,
                     "stream_concurrency": STREAM_CONCURRENCY, "nginx_workers": NGINX_WORKERS,
                     "llmgw_workers": args.workers, "llmgw_default_gc": args.default_gc, "rust_router_policy": RUST_ROUTER_POLICY,
                     "llmgw_routing": LLMGW_POLICY, "cache_aware_pair": {
                         "llmgw-kv": LLMGW_KV_POLICY, "sglang-router-ca": SGLANG_CACHE_AWARE_POLICY},
                     "engine": args.engine, "engine_requested": args.engine},
        "peers": {}, "results": {}, "rounds": {},
    }
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        fleet = Fleet(Path(tmp))
        try:
            replicas, engines = start_engines(fleet, args, report["settings"])
            # "direct" bills the engines' own CPU: the yardstick that they cost far less than a proxy.
            proxies: list[Proxy] = [Proxy("direct", replicas, engines)]
            log("starting llmgw")
            proxies.append(start_llmgw(fleet, replicas, args.workers, args.default_gc))
            report["peers"]["llmgw"] = {"ok": True, "version": proxies[-1].version}
            slow: list[Proxy] = []
            starters = {**PEER_STARTERS, "llmgw-kv": partial(  # llmgw again, with the routing it ships with
                start_llmgw, workers=args.workers, default_gc=args.default_gc, routing=LLMGW_KV_POLICY, name="llmgw-kv")}
            for name in wanted:
                status = peers.get(PEER_INSTALLS.get(name, name), {"ok": True})
                if not status["ok"]:
                    report["peers"][name] = {"ok": False, "reason": status["reason"]}
                    log(f"{name}: unavailable ({status['reason']})")
                    continue
                log(f"starting {name}")
                try:
                    proxy = starters[name](fleet, replicas)
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


def serve_llmgw(port: int, urls: Sequence[str], workers: int, default_gc: bool = False,
                routing: str = LLMGW_POLICY) -> None:
    """Run llmgw's router alone on 127.0.0.1:``port`` over the engines at ``urls`` (until SIGTERM),
    routing by the policy ``routing`` names, with the garbage-collector settings ``llmgw
    server`` uses unless ``default_gc``."""
    from llmgw.config import RoutingConfig
    from llmgw.router import Replica, ReplicaTable, serve_gateway
    from llmgw.router.app import Gateway

    table = ReplicaTable()
    table.set_model_replicas(MODEL, [Replica(id=f"r{i}", model=MODEL, endpoint=url) for i, url in enumerate(urls)])
    if not default_gc:
        from llmgw.gctune import tune_for_serving

        tune_for_serving()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            if workers > 1:
                from llmgw.config import AuthConfig, GatewayConfig
                from llmgw.router.build import build_gateway
                from llmgw.router.replicas import ModelInfo
                from llmgw.router.settings import GatewaySettings

                pool = build_gateway(GatewaySettings(gateway=GatewayConfig(workers=workers),
                                                     auth=AuthConfig(enabled=False),
                                                     routing=RoutingConfig(policy=routing)))
                pool.replace_routes({MODEL: table.replicas(MODEL) or ()}, {MODEL: ModelInfo()})
                await nursery.start(pool.serve, HOST, port)
            else:
                app = Gateway(table, routing=RoutingConfig(policy=routing)).app
                await nursery.start(partial(serve_gateway, app, HOST, port))
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

    trio.run(main)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, run the benchmark, print the JSON report as the last stdout line."""
    p = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round of 2 s per scenario (under 3 minutes)")
    p.add_argument("--replicas", type=int, default=4, help="engines (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians over rounds (default 3)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per scenario and target (default 5)")
    p.add_argument("--workers", type=int, default=1, help="llmgw gateway worker processes (default 1)")
    p.add_argument("--engine", choices=("fast", "sim"), default="fast",
                   help="engines behind the proxies: fast = the C server bench/fastengine.c (default; falls back "
                        "to sim if it cannot be built), sim = python -m llmgw.sim")
    p.add_argument("--stream-token-us", type=float, default=STREAM_TOKEN_US,
                   help=f"fast engine: microseconds between stream tokens (default {STREAM_TOKEN_US:g}; 0 = back to back)")
    p.add_argument("--decode-us", type=float, default=0.0, help="sim engine: decode time per token (default 0)")
    p.add_argument("--default-gc", action="store_true",
                   help="run llmgw with CPython's garbage-collector settings, not the server's (llmgw/gctune.py)")
    p.add_argument("--skip", action="append", default=[], help="a peer to leave out (repeatable)")
    p.add_argument("--setup", action="store_true", help="install missing peers first (package registries)")
    p.add_argument("--serve-llmgw", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--routing", default=LLMGW_POLICY, help=argparse.SUPPRESS)  # with --serve-llmgw
    p.add_argument("urls", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_llmgw is not None:
        serve_llmgw(args.serve_llmgw, args.urls, args.workers, args.default_gc, args.routing)
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
