"""Fault drills: what agent and control-plane restarts cost the clients, counted, and how long recovery takes.

``python -m bench.drills [--quick] [--clients N] [--rounds R] [--pg DSN | --sqlite] [--only NAME]``
runs each drill on a fresh cluster of real processes on 127.0.0.1, built with the system
tests' harness (``tests/system/harness.py``: ``llmgw server``, one ``llmgw agent``, model
``m1`` on the simulated engine with 2 replicas), its store a SQLite file or, with ``--pg``
(default: ``$LLMGW_TEST_PG``), a fresh database on that PostgreSQL server. N concurrent
clients (every fourth one streaming) send chat completions in a loop through the gateway
while the fault happens, and every request's end is counted by kind.

Drills (``drills.<name>``):

* ``agent_kill``, ``agent_sigterm``: the agent is killed (SIGKILL) or stopped (SIGTERM) and
  started again at once. ``join_s``: signal to the new agent's join; ``recovery_s``: signal
  to the node ONLINE with both replicas READY; ``engines_restarted``: replicas whose engine
  pid changed (the agent adopts running engines: 0 expected).
* ``server_drain``: the server gets SIGTERM while short requests and long streams (longer
  than the shutdown grace) are in flight. Streams completed, ended by an SSE error event,
  or cut bare; ``exit_status``; ``drain_s``; the usage a server started again on the same
  store reports against what the clients were answered.
* ``server_kill``: the server is killed (SIGKILL) and started again on the same ports and
  store. Requests failed during the outage; ``ready_s``: kill to ``/readyz`` ready again;
  ``usage_lost_requests`` (answered minus reported) against ``in_flight_at_kill``.
* ``control_plane_restart``: SIGTERM, then a start on the same ports. ``rejoin_s``: signal to
  the node ONLINE with both replicas READY again; ``ready_s``: to ``/readyz`` ready.

Every timing is measured from the fault (``trio.current_time()``) to the first poll that saw
the condition; conditions are polled every :data:`POLL_S`, cluster state through the admin
client library (``llmgw.client``). Each drill is independent: one that fails reports its error
and the others still run. Progress goes to stderr; the last stdout line is one JSON object.
These are measurements: nothing here asserts a timing (tests/system/ asserts the counts).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attrs  # noqa: E402
import httpx  # noqa: E402
import psycopg  # noqa: E402
import psycopg.sql  # noqa: E402
import trio  # noqa: E402

from llmgw.client import ReplicaRow, connect  # noqa: E402
from llmgw.control.store import redact_dsn  # noqa: E402
from llmgw.rpc.kjtrio import capnp_runtime  # noqa: E402
from tests.pg import with_database  # noqa: E402
from tests.system.harness import LLMGW, POLL, WAIT, Cluster, Proc, eventually, serve_sim_model, sse_events  # noqa: E402

MODEL = "m1"
NODE = "node-a"
REPLICAS = 2
DRILLS = ("agent_kill", "agent_sigterm", "server_drain", "server_kill", "control_plane_restart")
#: Every STREAM_EVERY-th client streams (a quarter of them).
STREAM_EVERY = 4
#: Tokens per answer in the load loop, and the simulated engine's time per token: about
#: 80 ms an answer, so 16 clients send at most ~200 requests/s, which the gateway, the two
#: engines and the clients can carry on a 2-core machine without starving the processes
#: whose recovery is measured.
MAX_TOKENS = 4
DECODE_US_PER_TOKEN = 20_000
#: Answers the load loop gets before the fault, and again after recovery (the proof that
#: the cluster serves again), per client.
WARMUP_PER_CLIENT = {True: 2, False: 5}  # by --quick
AFTER_PER_CLIENT = {True: 2, False: 5}
#: How often a condition (cluster state, /readyz, a log line) is checked: the harness's
#: ``eventually`` interval, the resolution of every recovery time (each cluster poll is
#: one TLS connection to the control plane).
POLL_S = POLL
#: A client that failed waits this long before its next request (a client backs off; it
#: keeps refused connections during an outage from spinning the CPU).
FAILURE_PAUSE_S = 0.05
#: Seconds allowed for one request (answers take well under a second; a hung one shows).
HTTP_TIMEOUT_S = 30.0
#: Bound on one drill: a cluster that does not recover is reported, not waited for forever.
DRILL_TIMEOUT_S = 240.0
#: Drain drill, as in tests/system/test_drain.py: a grace the short answers (2 tokens at
#: 200 ms) finish within, and long streams (the engine's natural length, 24 to 88 tokens,
#: 4.8 s or more) cannot, so those end with an error event.
DRAIN_GRACE = "1.5s"
DRAIN_DECODE_US_PER_TOKEN = 200_000
DRAIN_SHORT_TOKENS = 2
DRAIN_LONG_TOKENS = 8_000  # under the engine's 8,192-token context: the natural length ends it
DRAIN_LONG_STREAMS = 2
#: What the server logs when its shutdown grace ran out with requests still open
#: (llmgw/router/http/serve.py).
GRACE_OVER = re.compile(r"shutdown grace \(\S+\) over")
#: How many messages are kept per failure kind (the counts are exact; these say why).
SAMPLES_PER_KIND = 2
#: Seconds for one /readyz probe or PostgreSQL connection (both local: longer means not there).
CONNECT_TIMEOUT_S = 3.0


def log(message: str) -> None:
    """Print a progress line on stderr."""
    print(f"[bench.drills {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the load loop ------------------------------------------------------------------


@attrs.define
class Workload:
    """What the clients send: ``clients`` loops of short requests (every STREAM_EVERY-th
    streaming), plus ``long_streams`` single long streams sent once ``warmup`` answers came."""

    clients: int
    max_tokens: int = MAX_TOKENS
    long_streams: int = 0
    long_tokens: int = DRAIN_LONG_TOKENS
    warmup: int = 0


@attrs.define
class Load:
    """How every request of the load loop ended, counted by kind.

    Kinds: ``ok`` (a 200 with its usage; a stream ended by ``[DONE]``), ``stream_error``
    (a stream whose last event was an SSE error), ``status_<code>``, ``cut_bare`` (a stream
    or body that ended without its end), ``refused`` (no connection), ``no_response`` (the
    connection broke before a status line), ``timeout``.
    """

    kinds: collections.Counter[str] = attrs.field(factory=collections.Counter)
    by_request: dict[str, collections.Counter[str]] = attrs.field(factory=dict)  # plain/stream/long -> kinds
    samples: dict[str, list[str]] = attrs.field(factory=dict)
    prompt_tokens: int = 0  # of the ok answers
    completion_tokens: int = 0
    in_flight: int = 0
    long_streaming: int = 0  # long streams that got their first event
    first_failure: float | None = None
    last_failure: float | None = None
    longest_failure: float = 0.0  # seconds the slowest failed request took to fail
    stopping: bool = False  # no new request once set
    changed: trio.Event = attrs.field(factory=trio.Event)

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    @property
    def answered(self) -> int:
        """Requests the gateway answered: ok ones and streams it ended with an error event."""
        return self.kinds["ok"] + self.kinds["stream_error"]

    @property
    def failed(self) -> int:
        return self.total - self.kinds["ok"]

    def record(self, request: str, kind: str, message: str = "", usage: dict[str, int] | None = None,
               started: float = 0.0) -> None:
        """Count one request of type ``request`` (plain, stream, long), sent at ``started``, that ended as ``kind``."""
        self.kinds[kind] += 1
        self.by_request.setdefault(request, collections.Counter())[kind] += 1
        if kind == "ok" and usage:
            self.prompt_tokens += usage["prompt_tokens"]
            self.completion_tokens += usage["completion_tokens"]
        if kind != "ok":
            now = trio.current_time()
            self.first_failure = self.first_failure or now
            self.last_failure = now
            self.longest_failure = max(self.longest_failure, now - started)
            kept = self.samples.setdefault(kind, [])
            if len(kept) < SAMPLES_PER_KIND:
                kept.append(f"{request} after {now - started:.2f} s: {message[:200]}")
        self.note()

    def note(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
        """Return once ``condition()`` holds; raises AssertionError after ``timeout`` s."""
        with trio.move_on_after(timeout):
            while not condition():
                await self.changed.wait()
            return
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (load: {dict(self.kinds)})")

    def figures(self) -> dict[str, Any]:
        """Return the counts for the report: total, ok, failed, failed by kind, samples."""
        return {"total": self.total, "ok": self.kinds["ok"], "failed": self.failed,
                "failed_by": {k: v for k, v in sorted(self.kinds.items()) if k != "ok"},
                "by_request": {r: dict(sorted(c.items())) for r, c in sorted(self.by_request.items())},
                "longest_failure_s": round(self.longest_failure, 3),
                "failure_samples": self.samples}


def request_body(kind: str, workload: Workload) -> dict[str, Any]:
    tokens = workload.long_tokens if kind == "long" else workload.max_tokens
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": f"drill {kind}"}],
                            "max_tokens": tokens}
    if kind != "plain":
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def one_request(http: httpx.AsyncClient, kind: str, workload: Workload, load: Load) -> str:
    """Send one chat completion (``kind``: plain, stream or long), record how it ended; return the kind recorded."""
    events: list[Any] = []
    status: int | None = None
    started = trio.current_time()
    load.in_flight += 1
    try:
        async with http.stream("POST", "/v1/chat/completions", json=request_body(kind, workload)) as response:
            status = response.status_code
            if status != 200:
                return _record(load, started, kind, f"status_{status}", (await response.aread()).decode(errors="replace"))
            if kind == "plain":
                return _record(load, started, kind, "ok", usage=json.loads(await response.aread())["usage"])
            async for event in sse_events(response):
                events.append(event)
                if kind == "long" and len(events) == 1:
                    load.long_streaming += 1
                    load.note()
    except httpx.ConnectError as exc:
        return _record(load, started, kind, "refused", repr(exc))
    except httpx.TimeoutException as exc:
        return _record(load, started, kind, "timeout", repr(exc))
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return _record(load, started, kind, "no_response" if status is None else "cut_bare", f"{exc!r} after {len(events)} events")
    finally:
        load.in_flight -= 1
    if events and events[-1] == "[DONE]":
        usage = [e["usage"] for e in events[:-1] if isinstance(e, dict) and e.get("usage")]
        return _record(load, started, kind, "ok", usage=usage[-1] if usage else None)
    if events and isinstance(events[-1], dict) and "error" in events[-1]:
        return _record(load, started, kind, "stream_error", json.dumps(events[-1]["error"]))
    return _record(load, started, kind, "cut_bare", f"ended without [DONE] or an error event after {len(events)} events")


def _record(load: Load, started: float, request: str, kind: str, message: str = "",
            usage: dict[str, int] | None = None) -> str:
    load.record(request, kind, message, usage, started)
    return kind


async def run_load(gateway: str, workload: Workload, load: Load) -> None:
    """Run the clients until ``load.stopping`` is set and their last requests ended."""

    async def client(index: int) -> None:
        async with httpx.AsyncClient(base_url=gateway, timeout=HTTP_TIMEOUT_S) as http:
            kind = "stream" if index % STREAM_EVERY == 0 else "plain"
            while not load.stopping:
                if await one_request(http, kind, workload, load) != "ok":
                    await trio.sleep(FAILURE_PAUSE_S)

    async def long_stream() -> None:
        async with httpx.AsyncClient(base_url=gateway, timeout=HTTP_TIMEOUT_S) as http:
            await load.wait_for(lambda: load.answered >= workload.warmup, "answers before the long streams")
            await one_request(http, "long", workload, load)

    async with trio.open_nursery() as nursery:
        for index in range(workload.clients):
            nursery.start_soon(client, index)
        for _ in range(workload.long_streams):
            nursery.start_soon(long_stream)


# -- the cluster --------------------------------------------------------------------


@attrs.define
class Options:
    clients: int
    quick: bool
    pg: str | None  # the PostgreSQL server's DSN, or None: SQLite

    @property
    def warmup(self) -> int:
        return WARMUP_PER_CLIENT[self.quick] * self.clients

    @property
    def after(self) -> int:
        return AFTER_PER_CLIENT[self.quick] * self.clients


@contextlib.contextmanager
def fresh_database(server_dsn: str) -> Iterator[str]:
    """Create a database on the PostgreSQL server ``server_dsn``; yield its URL; drop it after."""
    name = f"llmgw_drill_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S) as db:
        db.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    try:
        yield with_database(server_dsn, name)
    finally:
        with psycopg.connect(server_dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S) as db:
            db.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(psycopg.sql.Identifier(name)))


@contextlib.asynccontextmanager
async def drill_cluster(root: Path, opts: Options, *, extra: dict[str, Any] | None = None,
                        decode_us: int = DECODE_US_PER_TOKEN) -> AsyncIterator[Cluster]:
    """A running cluster with model ``m1`` READY on two simulated engines of agent ``node-a``;
    every process and engine is killed on exit (and the PostgreSQL database dropped)."""
    with contextlib.ExitStack() as stack:
        store_url = stack.enter_context(fresh_database(opts.pg)) if opts.pg else None
        # lost_after and replace_grace well above any drill: nothing is re-placed behind its back.
        async with Cluster(root, store_url=store_url, lost_after="60s", replace_grace="120s", extra=extra) as cluster:
            await serve_sim_model(cluster, MODEL, REPLICAS, f"--arg=--decode-us-per-token={decode_us}")
            yield cluster


async def cluster_view(cluster: Cluster) -> tuple[dict[str, str], list[ReplicaRow]]:
    """Return the node states by id and the replicas of ``m1``, asked of the control plane now."""
    async with connect(cluster.rpc, tls_dir=cluster.admin_dir) as admin:
        nodes = {n.id: n.state for n in await admin.nodes()}
        replicas, _ = await admin.replicas()
    return nodes, [r for r in replicas if r.model == MODEL]


async def node_serving(cluster: Cluster) -> list[ReplicaRow] | None:
    """Return the READY replicas once the node is ONLINE with all of them READY, else None."""
    nodes, replicas = await cluster_view(cluster)
    ready = [r for r in replicas if r.state == "ready"]
    return ready if nodes.get(NODE) == "online" and len(ready) == REPLICAS else None


async def stored_usage(cluster: Cluster) -> dict[str, int]:
    """Return the requests and tokens the control plane reports for ``m1`` (stored plus not yet flushed)."""
    async with connect(cluster.rpc, tls_dir=cluster.admin_dir) as admin:
        rows = [u for u in await admin.usage() if u.model == MODEL]
    return {"requests": sum(u.requests for u in rows), "prompt_tokens": sum(u.prompt_tokens for u in rows),
            "completion_tokens": sum(u.completion_tokens for u in rows)}


async def gateway_ready(gateway: str) -> bool:
    async with httpx.AsyncClient(timeout=CONNECT_TIMEOUT_S) as http:
        return (await http.get(f"{gateway}/readyz")).status_code == 200


async def seconds_until(check: Callable[[], Awaitable[Any]], what: str, since: float) -> tuple[float, Any]:
    """Wait for ``check()`` to return something truthy (polled every POLL_S); return the seconds from
    ``since`` to then, and that value."""
    value = await eventually(check, what, timeout=WAIT)
    return round(trio.current_time() - since, 3), value


async def ready_and_rejoined(cluster: Cluster, since: float) -> dict[str, float]:
    """Wait, both at once, for ``/readyz`` ready and for the node serving again; return
    ``ready_s`` and ``rejoin_s``, each in seconds from ``since``."""
    times: dict[str, float] = {}

    async def ready() -> None:
        times["ready_s"], _ = await seconds_until(lambda: gateway_ready(cluster.gateway), "/readyz ready", since)

    async def rejoined() -> None:
        times["rejoin_s"], _ = await seconds_until(lambda: node_serving(cluster), "the node serving again", since)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ready)
        nursery.start_soon(rejoined)
    return times


def usage_answered(load: Load) -> dict[str, int]:
    return {"requests": load.answered, "prompt_tokens": load.prompt_tokens, "completion_tokens": load.completion_tokens}


def outage_s(load: Load) -> float | None:
    """Seconds from the first failed request's end to the last's (None: nothing failed)."""
    if load.first_failure is None or load.last_failure is None:
        return None
    return round(load.last_failure - load.first_failure, 3)


# -- the drills -----------------------------------------------------------------------


async def drill_agent(root: Path, opts: Options, how: signal.Signals) -> dict[str, Any]:
    """Agent killed or stopped with ``how`` and started again at once, under load."""
    async with drill_cluster(root, opts) as cluster:
        agent = cluster.agents[NODE]
        before = {r.id: r.pid for r in await eventually(lambda: node_serving(cluster), "the node serving")}
        load, workload = Load(), Workload(opts.clients)
        result: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_load, cluster.gateway, workload, load)
            await load.wait_for(lambda: load.answered >= opts.warmup, "the load loop under way")
            t0 = trio.current_time()
            agent.signal(how)
            result["exit_status"] = await agent.wait_exit()
            result["exit_s"] = round(trio.current_time() - t0, 3)
            again = Proc([*LLMGW, "agent", "-c", str(cluster.root / NODE / "agent.yaml")],
                         cluster.root / f"agent-{NODE}-again.log")
            cluster.agents[f"{NODE}#again"] = again
            await again.wait_for_line(rf"agent: joined \S+ as node '{NODE}'")
            result["join_s"] = round(trio.current_time() - t0, 3)
            result["recovery_s"], rows = await seconds_until(lambda: node_serving(cluster), "the node serving again", t0)
            result["engines_restarted"] = sum(before.get(r.id) != r.pid for r in rows)
            mark = load.answered
            await load.wait_for(lambda: load.answered >= mark + opts.after, "answers after the recovery")
            load.stopping = True
        result["requests"] = load.figures()
        result["outage_s"] = outage_s(load)
        return result


async def drill_server_drain(root: Path, opts: Options) -> dict[str, Any]:
    """Server SIGTERM with short requests and long streams in flight; usage read after a restart."""
    extra = {"gateway": {"shutdown_grace": DRAIN_GRACE}}
    async with drill_cluster(root, opts, extra=extra, decode_us=DRAIN_DECODE_US_PER_TOKEN) as cluster:
        assert cluster.server is not None
        server = cluster.server
        load = Load()
        workload = Workload(opts.clients, max_tokens=DRAIN_SHORT_TOKENS, long_streams=DRAIN_LONG_STREAMS,
                            warmup=opts.warmup)
        result: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_load, cluster.gateway, workload, load)
            await load.wait_for(lambda: load.answered >= opts.warmup and load.long_streaming == DRAIN_LONG_STREAMS,
                                "answers and the long streams in flight")
            result["in_flight_at_signal"] = load.in_flight
            load.stopping = True  # no new request after the signal: what is counted is what was in flight
            t0 = trio.current_time()
            server.signal(signal.SIGTERM)
            result["exit_status"] = await server.wait_exit()
            result["drain_s"] = round(trio.current_time() - t0, 3)
        result["traceback_in_log"] = "Traceback" in server.output()
        result["grace_ran_out"] = bool(GRACE_OVER.search(server.output()))
        result["requests"] = load.figures()
        streams = load.by_request.get("stream", collections.Counter()) + load.by_request.get("long", collections.Counter())
        result["streams"] = {"completed": streams["ok"], "error_event": streams["stream_error"],
                             "cut_bare": streams.total() - streams["ok"] - streams["stream_error"],
                             "long_error_event": load.by_request.get("long", collections.Counter())["stream_error"]}
        await cluster.start_server()  # the same store: what did the drained server keep?
        result["usage_answered"] = usage_answered(load)
        result["usage_stored"] = await stored_usage(cluster)
        result["usage_exact"] = result["usage_answered"] == result["usage_stored"]
        return result


async def drill_server_restart(root: Path, opts: Options, *, kill: bool) -> dict[str, Any]:
    """Server SIGKILL (``kill``) or SIGTERM, then a start on the same ports and store, under load."""
    async with drill_cluster(root, opts) as cluster:
        assert cluster.server is not None
        server = cluster.server
        cluster.pin_ports()
        load, workload = Load(), Workload(opts.clients)
        result: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_load, cluster.gateway, workload, load)
            await load.wait_for(lambda: load.answered >= opts.warmup, "the load loop under way")
            if kill:
                result["in_flight_at_kill"] = load.in_flight
                result["answered_before_kill"] = load.answered
            t0 = trio.current_time()
            if kill:
                server.kill()
            else:
                server.signal(signal.SIGTERM)
                result["exit_status"] = await server.wait_exit()
                result["stop_s"] = round(trio.current_time() - t0, 3)
                result["grace_ran_out"] = bool(GRACE_OVER.search(server.output()))
            await cluster.start_server()
            result["listening_s"] = round(trio.current_time() - t0, 3)
            result.update(await ready_and_rejoined(cluster, t0))
            mark = load.answered
            await load.wait_for(lambda: load.answered >= mark + opts.after, "answers after the restart")
            load.stopping = True
        result["requests"] = load.figures()
        result["outage_s"] = outage_s(load)
        if kill:
            result["usage_answered"] = usage_answered(load)
            result["usage_stored"] = await stored_usage(cluster)
            result["usage_lost_requests"] = result["usage_answered"]["requests"] - result["usage_stored"]["requests"]
        return result


def drill_function(name: str) -> Callable[[Path, Options], Awaitable[dict[str, Any]]]:
    """Return the coroutine function running drill ``name`` (one of :data:`DRILLS`)."""
    return {
        "agent_kill": lambda root, opts: drill_agent(root, opts, signal.SIGKILL),
        "agent_sigterm": lambda root, opts: drill_agent(root, opts, signal.SIGTERM),
        "server_drain": drill_server_drain,
        "server_kill": lambda root, opts: drill_server_restart(root, opts, kill=True),
        "control_plane_restart": lambda root, opts: drill_server_restart(root, opts, kill=False),
    }[name]


async def run_drill(name: str, opts: Options, keep: bool) -> dict[str, Any]:
    """Run drill ``name`` once in a fresh directory; return its figures, or ``{"error": ...}``."""
    root = Path(tempfile.mkdtemp(prefix=f"llmgw-drill-{name}-"))
    started = trio.current_time()
    try:
        with trio.fail_after(DRILL_TIMEOUT_S):
            result = await drill_function(name)(root, opts)
    except Exception as exc:  # noqa: BLE001 - one drill's failure is its result; the others still run
        result = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        keep = True
    result["elapsed_s"] = round(trio.current_time() - started, 1)
    if keep:
        result["logs"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return result


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One drill's report: every round, the median of each timing (keys ending ``_s``), and
    the requests and failures summed over rounds."""
    timings: dict[str, list[float]] = collections.defaultdict(list)
    for r in rounds:
        for key, value in r.items():
            if key.endswith("_s") and isinstance(value, (int, float)) and key != "elapsed_s":
                timings[key].append(value)
    done = [r for r in rounds if "error" not in r]
    return {
        "median_s": {k: round(statistics.median(v), 3) for k, v in sorted(timings.items())},
        "requests_total": sum(r["requests"]["total"] for r in done),
        "requests_failed": sum(r["requests"]["failed"] for r in done),
        "errors": [r["error"] for r in rounds if "error" in r],
        "rounds": rounds,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    opts = Options(clients=args.clients, quick=args.quick, pg=None if args.sqlite else args.pg)
    report: dict[str, Any] = {"bench": "drills", "drills": {}}
    async with capnp_runtime():
        for name in args.only or DRILLS:
            rounds = []
            for n in range(args.rounds):
                log(f"{name}: round {n + 1}/{args.rounds}")
                rounds.append(await run_drill(name, opts, args.keep))
                log(f"{name}: {json.dumps({k: v for k, v in rounds[-1].items() if k != 'requests'})[:400]}")
            report["drills"][name] = summarize(rounds)
    report["config"] = {
        "quick": args.quick, "rounds": args.rounds, "clients": args.clients, "streaming_clients":
        len(range(0, args.clients, STREAM_EVERY)), "replicas": REPLICAS, "engine": "sim",
        "store": f"postgresql ({redact_dsn(opts.pg)})" if opts.pg else "sqlite",
        "max_tokens": MAX_TOKENS, "decode_us_per_token": DECODE_US_PER_TOKEN,
        "warmup_answers": opts.warmup, "after_answers": opts.after, "poll_s": POLL_S,
        "drain": {"shutdown_grace": DRAIN_GRACE, "decode_us_per_token": DRAIN_DECODE_US_PER_TOKEN,
                  "short_tokens": DRAIN_SHORT_TOKENS, "long_streams": DRAIN_LONG_STREAMS},
        "python": sys.version.split()[0], "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, run the drills, print the JSON report as the last stdout line.

    Returns 1 when a drill failed (its error is in the report), else 0."""
    p = argparse.ArgumentParser(prog="python -m bench.drills", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round, fewer answers before and after each fault")
    p.add_argument("--rounds", type=int, default=None, help="runs of each drill (default 3; quick 1)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients, every fourth streaming (default 16)")
    p.add_argument("--pg", default=os.environ.get("LLMGW_TEST_PG") or None,
                   help="PostgreSQL server DSN: each drill's store is a fresh database there (default $LLMGW_TEST_PG)")
    p.add_argument("--sqlite", action="store_true", help="a SQLite store even when $LLMGW_TEST_PG is set")
    p.add_argument("--only", action="append", choices=DRILLS, help="run only this drill (repeatable)")
    p.add_argument("--keep", action="store_true", help="keep each drill's directory (logs); kept anyway on failure")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    started = time.monotonic()
    report = trio.run(main_async, args)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report))
    return 1 if any(d["errors"] for d in report["drills"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
