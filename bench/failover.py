"""Leader failover: how long a cluster of three control planes is without a leader, what it costs the clients;
and how long a settings push takes to reach 100 agents.

``python -m bench.failover [--kills K] [--clients N] [--lease S] [--agents N] [--changes C]
[--only failover|settings] [--pg DSN] [--keep]``
builds a cluster of real processes on 127.0.0.1 with the system tests' harness: three
``llmgw server`` processes on one fresh PostgreSQL database (``--pg``, default
``$LLMGW_TEST_PG``), two agents that list all three, and model ``m1`` on two simulated
engines (one per node). N clients (every fourth streaming) send chat completions in a loop,
round-robin over the gateways that are up, as a load balancer would. Then K times: the
leader is killed (SIGKILL) and taken out of the rotation at once, and the bench measures

* ``failover_s``: kill to the first poll at which another control plane's ``GET /leader``
  answers 200;
* ``adopted_s``: kill to the new leader reporting both replicas READY (the agents found it
  and it adopted their engines);
* ``failed``: requests that failed from the kill until the killed control plane is back as
  a standby (requests in flight at the killed process, and anything the failover broke);

and the killed control plane is started again on its ports before the next kill.
``engines_restarted`` counts engines whose pid changed over the whole run (0 expected).
Timings are polled every :data:`POLL_S`.

``settings_push`` (``--agents N``, default 100; ``--changes C``, default 3): one more
``llmgw server`` on a fresh database of its own, and N simulated agents in this process.
Each has its own node certificate from the cluster CA, opens a real mutual-TLS Cap'n Proto
session, joins as its own node (no engines, no GPUs, no shards), heartbeats as the agent
does and serves the ``Agent`` calls the leader makes at join (``controlPlanes``,
``settings``; ``ping``, ``wantEngines`` answered too), noting the time of every
``Agent.settings`` call it gets. Then C times: ``agents.default.`` :data:`SETTING_KEY` is
set to a new value through the admin RPC (what ``llmgw ctl config set`` calls), and the
bench waits until every agent got a layer holding it. Each arrival is timed from the
moment the set call returned, so the figures include the leader's deliberate
:data:`~llmgw.control.settings_push.PUSH_DELAY_S` (one push per burst of changes).
Simulated agents only record what they get (a real one restarts on it, engines kept).

``--only failover`` or ``--only settings`` runs one part. Progress goes to stderr; the
last stdout line is one JSON object. Nothing here asserts a timing
(tests/system/test_ha.py asserts the counts).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import capnp  # noqa: E402
import httpx  # noqa: E402
import trio  # noqa: E402

from bench.drills import (  # noqa: E402
    CONNECT_TIMEOUT_S, DECODE_US_PER_TOKEN, FAILURE_PAUSE_S, HTTP_TIMEOUT_S, MODEL, STREAM_EVERY, Load, Workload,
    fresh_database, one_request,
)
from llmgw import __version__  # noqa: E402
from llmgw.cli.pki import issue_to  # noqa: E402
from llmgw.client import connect  # noqa: E402
from llmgw.control.settings_push import PUSH_DELAY_S  # noqa: E402
from llmgw.control.store import redact_dsn  # noqa: E402
from llmgw.node.agent import HEARTBEAT_MISSES, JOIN_TIMEOUT  # noqa: E402
from llmgw.rpc import net, schema  # noqa: E402
from llmgw.rpc.connection import open_client  # noqa: E402
from llmgw.rpc.kjtrio import capnp_runtime  # noqa: E402
from llmgw.rpc.tls import client_ssl_context  # noqa: E402
from tests.system.harness import WAIT, Cluster, ControlPlaneProc, engines_under, eventually, ready_replicas  # noqa: E402

#: Replicas of m1, one per node.
NODES = ("node-a", "node-b")
#: Resolution of failover_s: /leader is polled on every surviving gateway this often.
POLL_S = 0.02
#: Answers the clients must get after each failover before the next kill (per client).
AFTER_PER_CLIENT = 5

#: The bench's parts (``--only``).
PARTS = ("failover", "settings")
#: The agent.yaml key each settings change sets in ``agents.default`` (a new value each time).
SETTING_KEY = "reconnect_backoff_max"
#: The settings part's server.yaml heartbeat_interval and node_lost_after: llmgw's defaults,
#: as a fleet of 100 nodes would run.
SETTINGS_HEARTBEAT = "2s"
SETTINGS_LOST_AFTER = "10s"
#: Simulated agents connect and join at most this many at a time (a fleet coming up staggered;
#: the join time is reported, not what is measured).
JOINING_AT_ONCE = 20
#: Bound on all agents joining, and on one change reaching every agent.
SETTINGS_WAIT_S = 120.0
#: A simulated node's registration hardware: no GPUs.
SIM_HARDWARE = {"cpuCount": 1, "memoryTotalMb": 1024, "memoryAvailableMb": 1024, "gpus": [],
                "gpuNote": "no GPUs: simulated agent", "diskFreeMb": 0, "diskTotalMb": 0}


def log(message: str) -> None:
    print(f"[bench.failover {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Plane:
    """One control plane of the bench: the harness's first server or a ControlPlaneProc."""

    def __init__(self, cluster: Cluster, proc: ControlPlaneProc | None) -> None:
        self.cluster = cluster
        self.extra = proc

    @property
    def rpc(self) -> str:
        return self.extra.rpc if self.extra else self.cluster.rpc

    @property
    def gateway(self) -> str:
        return self.extra.gateway if self.extra else self.cluster.gateway

    def kill(self) -> None:
        if self.extra:
            self.extra.stop()
        else:
            assert self.cluster.server is not None
            self.cluster.server.kill()

    async def restart(self) -> None:
        """Start it again on the same ports."""
        if self.extra:
            self.extra.pin_ports()
            await self.extra.start()
        else:
            self.cluster.pin_ports()
            await self.cluster.start_server()


async def leader_of(http: httpx.AsyncClient, planes: list[Plane]) -> Plane | None:
    """Returns the plane whose /leader answers 200 (None: none does now)."""
    for plane in planes:
        try:
            if (await http.get(f"{plane.gateway}/leader")).status_code == 200:
                return plane
        except httpx.HTTPError:
            continue
    return None


async def replicas_ready(plane: Plane) -> int:
    async with connect(plane.rpc, tls_dir=plane.cluster.admin_dir) as admin:
        return (await admin.status()).replicas_ready


async def run_load(live: list[Plane], clients: int, load: Load) -> None:
    """Clients round-robin over ``live`` (changed by the caller as planes die and return)."""
    workload = Workload(clients=clients)

    async def client(index: int) -> None:
        kind = "stream" if index % STREAM_EVERY == 0 else "plain"
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
            turn = index
            while not load.stopping:
                turn += 1
                plane = live[turn % len(live)]
                http.base_url = httpx.URL(plane.gateway)
                if await one_request(http, kind, workload, load) != "ok":
                    await trio.sleep(FAILURE_PAUSE_S)

    async with trio.open_nursery() as nursery:
        for index in range(clients):
            nursery.start_soon(client, index)


async def bench_failover(root: Path, store_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The failover part: three control planes, two agents, K kills (see the module docstring)."""
    cluster = Cluster(root, store_url=store_url, lost_after="60s", replace_grace="120s",
                      extra={"leader_lease": f"{args.lease}s"})
    extras: list[ControlPlaneProc] = []
    try:
        await cluster.init()
        await cluster.start_server()
        for name in ("cp-2", "cp-3"):
            extras.append(ControlPlaneProc(cluster, name))
            await extras[-1].start()
        planes = [Plane(cluster, None), *(Plane(cluster, e) for e in extras)]
        for node in NODES:
            await cluster.start_agent(node, extra={"control_planes": [p.rpc for p in planes]})
        out = cluster.ctl("models", "add", MODEL, "--engine", "sim", "--replicas", str(len(NODES)),
                          f"--arg=--decode-us-per-token={DECODE_US_PER_TOKEN}")
        assert out.returncode == 0, out.stderr
        await ready_replicas(cluster, MODEL, len(NODES))
        engines = {p.pid: p.create_time() for p in engines_under(root)}
        live = list(planes)
        load = Load()
        kills: list[dict[str, Any]] = []
        async with httpx.AsyncClient(timeout=CONNECT_TIMEOUT_S) as http, trio.open_nursery() as nursery:
            for plane in planes:
                await eventually(lambda p=plane: _ready(http, p), f"{plane.gateway} ready")
            nursery.start_soon(run_load, live, args.clients, load)
            await load.wait_for(lambda: load.kinds["ok"] >= args.clients * AFTER_PER_CLIENT, "answers before the first kill")
            for k in range(args.kills):
                victim = await eventually(lambda: leader_of(http, planes), "a leader")
                failed_before = load.failed
                live.remove(victim)
                killed_at = trio.current_time()
                victim.kill()
                survivors = [p for p in planes if p is not victim]
                new = await eventually(lambda: leader_of(http, survivors), "a new leader", timeout=WAIT)
                failover_s = trio.current_time() - killed_at
                await eventually(lambda: _all_ready(new), "the new leader has both replicas")
                adopted_s = trio.current_time() - killed_at
                ok = load.kinds["ok"]
                await load.wait_for(lambda: load.kinds["ok"] >= ok + args.clients * AFTER_PER_CLIENT,
                                    "answers after the failover")
                await victim.restart()
                await eventually(lambda: _standby(http, victim), f"{victim.gateway} back as a standby")
                live.append(victim)
                kills.append({"failover_s": round(failover_s, 3), "adopted_s": round(adopted_s, 3),
                              "failed": load.failed - failed_before})
                log(f"kill {k + 1}/{args.kills}: {kills[-1]}")
            load.stopping = True
        now = {p.pid: p.create_time() for p in engines_under(root)}
        restarted = sum(1 for pid, started in engines.items() if now.get(pid) != started) + max(0, len(now) - len(engines))
        failovers = [k["failover_s"] for k in kills]
        adopted = [k["adopted_s"] for k in kills]
        return {
            "failover_s": {"median": round(statistics.median(failovers), 3), "max": max(failovers)},
            "adopted_s": {"median": round(statistics.median(adopted), 3), "max": max(adopted)},
            "failed_per_kill": [k["failed"] for k in kills],
            "requests": load.figures(),
            "engines_restarted": restarted,
            "kills": kills,
        }
    finally:
        for extra in extras:
            extra.stop()
        cluster.stop()


async def _ready(http: httpx.AsyncClient, plane: Plane) -> bool:
    return (await http.get(f"{plane.gateway}/readyz")).status_code == 200


async def _standby(http: httpx.AsyncClient, plane: Plane) -> bool:
    leader = await http.get(f"{plane.gateway}/leader")
    return leader.status_code == 503 and bool(leader.json()["leader"]) and await _ready(http, plane)


async def _all_ready(plane: Plane) -> bool:
    return await replicas_ready(plane) == len(NODES)


class SimFleet:
    """What the simulated agents of the settings part have seen: joins, ``Agent.settings``
    calls (the time of the first layer holding the value waited for), ended sessions."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.joined: dict[str, float] = {}
        self.calls: collections.Counter[str] = collections.Counter()  # Agent.settings calls per node
        self.want: str | None = None  # the value of SETTING_KEY being waited for
        self.arrived: dict[str, float] = {}  # node -> when its first layer with ``want`` came
        self.ended: list[str] = []  # "node: why", for every session that ended before the bench did
        self.heartbeats = 0  # answered
        self.changed = trio.Event()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def join(self, node_id: str) -> None:
        self.joined[node_id] = trio.current_time()
        self._notify()

    def settings(self, node_id: str, at: float, layer: Any) -> None:
        self.calls[node_id] += 1
        if (self.want is not None and node_id not in self.arrived and isinstance(layer, dict)
                and layer.get(SETTING_KEY) == self.want):
            self.arrived[node_id] = at
        self._notify()

    def end(self, node_id: str, why: str) -> None:
        self.ended.append(f"{node_id}: {why}"[:300])
        self._notify()

    def expect(self, value: str) -> None:
        """Wait for ``value`` from now on (arrivals of an earlier one are forgotten)."""
        self.want = value
        self.arrived = {}

    async def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = SETTINGS_WAIT_S) -> None:
        """Return once ``condition()`` holds; raises when a session ended or after ``timeout`` s."""
        with trio.move_on_after(timeout):
            while not condition():
                if self.ended:
                    raise RuntimeError(f"{len(self.ended)} simulated agent session(s) ended while waiting for "
                                       f"{what}: {'; '.join(self.ended[:3])}")
                await self.changed.wait()
            return
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (joined {len(self.joined)}, "
                             f"arrived {len(self.arrived)} of {self.size})")


def _sim_agent_server(fleet: SimFleet, node_id: str) -> Any:
    """The ``Agent`` capability of one simulated node: answers what the leader calls at join
    and after a settings change; runs no engines."""
    decode = json.loads  # the handler's parameter is named json

    class SimAgentServer(schema.load().Agent.Server):  # type: ignore[misc]
        async def ping(self, **_: Any) -> None:
            return None

        async def wantEngines(self, engines: Any, **_: Any) -> None:
            return None

        async def controlPlanes(self, addresses: Any, **_: Any) -> None:
            return None

        async def settings(self, json: str, **_: Any) -> None:
            at = trio.current_time()
            fleet.settings(node_id, at, decode(str(json)))

        async def startShard(self, **_: Any) -> None:
            raise RuntimeError("a simulated agent runs no engines")

        async def adopt(self, **_: Any) -> None:
            raise RuntimeError("a simulated agent runs no engines")

        async def checkEngine(self, **_: Any) -> None:
            raise RuntimeError("a simulated agent runs no engines")

        async def restart(self, **_: Any) -> None:
            raise RuntimeError("a simulated agent does not restart")

    return SimAgentServer()


async def sim_agent(fleet: SimFleet, node_id: str, rpc: str, context: ssl.SSLContext,
                    joining: trio.CapacityLimiter) -> None:
    """One simulated agent: connects and joins as ``node_id`` (at most ``joining``'s number
    at a time), then heartbeats as the agent does until cancelled. A session that ends is
    noted in ``fleet`` and not started again."""
    registration = {"nodeId": node_id, "address": "127.0.0.1", "hardware": SIM_HARDWARE, "shards": [],
                    "engines": [], "features": ["adopt", "stop-grace"],
                    "agent": _sim_agent_server(fleet, node_id), "version": __version__}
    try:
        async with contextlib.AsyncExitStack() as stack:
            async with joining:
                stream = await net.connect(rpc, context)
                stack.push_async_callback(trio.aclose_forcefully, stream)
                client = await stack.enter_async_context(open_client(stream))
                cluster = client.bootstrap().cast_as(schema.load().Cluster)
                with trio.fail_after(JOIN_TIMEOUT):
                    result = await cluster.join(registration)
            desk = result.desk
            interval = max(result.heartbeatIntervalMs, 100) / 1000
            fleet.join(node_id)
            while True:
                await trio.sleep(interval)  # the agent's heartbeat period, as llmgw.node.agent
                with trio.fail_after(interval * HEARTBEAT_MISSES):
                    await desk.heartbeat(SIM_HARDWARE)
                fleet.heartbeats += 1
    except (net.ConnectError, trio.TooSlowError, capnp.KjException, OSError, trio.BrokenResourceError) as exc:
        fleet.end(node_id, f"{type(exc).__name__}: {exc}")


def percentile(ascending: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of an ascending, non-empty sequence."""
    rank = max(1, min(len(ascending), round(q * len(ascending) + 0.5 - 1e-9)))
    return ascending[rank - 1]


#: Server log lines about node sessions and pushes going wrong (counted in the report).
TROUBLE = re.compile(r"did not (take|answer) its cluster settings|sent no heartbeat|could not read the cluster "
                     r"settings|closing its (previous )?session|refused a join|connection from .* failed")


async def bench_settings(root: Path, store_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The settings part: one control plane, ``args.agents`` simulated agents, ``args.changes``
    changes of ``agents.default.SETTING_KEY`` (see the module docstring)."""
    cluster = Cluster(root, store_url=store_url, heartbeat=SETTINGS_HEARTBEAT, lost_after=SETTINGS_LOST_AFTER)
    fleet = SimFleet(args.agents)
    try:
        await cluster.init()
        await cluster.start_server()
        ca = cluster.ca()
        nodes = [f"sim-{i:03d}" for i in range(args.agents)]
        contexts = {}
        for node in nodes:
            creds = issue_to(ca, "node", node, root / "sim-agents" / node / "tls")
            contexts[node] = client_ssl_context(creds.ca_pem, creds.cert_pem, creds.key_pem)
        log(f"settings: {args.agents} node certificates issued; joining")
        async with trio.open_nursery() as nursery, connect(cluster.rpc, tls_dir=cluster.admin_dir) as admin:
            joining = trio.CapacityLimiter(JOINING_AT_ONCE)
            started = trio.current_time()
            for node in nodes:
                nursery.start_soon(sim_agent, fleet, node, cluster.rpc, contexts[node], joining)
            await fleet.wait_for(lambda: len(fleet.joined) == args.agents, f"{args.agents} agents joined")
            join_s = trio.current_time() - started
            await fleet.wait_for(lambda: all(fleet.calls[n] >= 1 for n in nodes), "the settings sent at join")
            online = (await admin.status()).nodes_online
            log(f"settings: {args.agents} agents joined in {join_s:.2f}s ({online} online)")
            changes: list[dict[str, Any]] = []
            for c in range(args.changes):
                value = f"{31 + c}s"
                calls_before = sum(fleet.calls.values())
                fleet.expect(value)
                asked = trio.current_time()
                await admin.set_setting(f"agents.default.{SETTING_KEY}", value)
                returned = trio.current_time()
                await fleet.wait_for(lambda: len(fleet.arrived) == args.agents, f"{value} at every agent")
                everyone = trio.current_time() - returned
                after = sorted(t - returned for t in fleet.arrived.values())
                changes.append({
                    "set_call_s": round(returned - asked, 3),
                    "first_s": round(after[0], 3),
                    "median_s": round(statistics.median(after), 3),
                    "p95_s": round(percentile(after, 0.95), 3),
                    "max_s": round(after[-1], 3),
                    "all_s": round(everyone, 3),
                    "spread_s": round(after[-1] - after[0], 3),
                    "calls": sum(fleet.calls.values()) - calls_before,
                })
                log(f"settings change {c + 1}/{args.changes}: {changes[-1]}")
            online_after = (await admin.status()).nodes_online
            nursery.cancel_scope.cancel()
        server_log = cluster.server.output() if cluster.server else ""
        trouble = [line for line in server_log.splitlines() if TROUBLE.search(line)]
        return {
            "agents": args.agents,
            "changes": changes,
            "median": {k: round(statistics.median(ch[k] for ch in changes), 3)
                       for k in ("set_call_s", "first_s", "median_s", "p95_s", "max_s", "all_s", "spread_s")},
            "includes_push_delay_s": PUSH_DELAY_S,
            "join_all_s": round(join_s, 3),
            "nodes_online": {"after_join": online, "at_end": online_after},
            "sessions_ended": len(fleet.ended),
            "heartbeats": fleet.heartbeats,
            "settings_calls": {"total": sum(fleet.calls.values()), "expected": args.agents * (1 + args.changes)},
            "server_trouble_lines": len(trouble),
            "server_trouble_samples": trouble[:5],
            "setting": f"agents.default.{SETTING_KEY}",
            "heartbeat": SETTINGS_HEARTBEAT,
        }
    finally:
        cluster.stop()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="llmgw-failover-"))
    started = trio.current_time()
    parts = [args.only] if args.only else list(PARTS)
    report: dict[str, Any] = {"bench": "failover"}
    try:
        async with capnp_runtime():
            if "failover" in parts:
                with fresh_database(args.pg) as store_url:
                    report.update(await bench_failover(root / "failover", store_url, args))
            if "settings" in parts:
                with fresh_database(args.pg) as store_url:
                    report["settings_push"] = await bench_settings(root / "settings", store_url, args)
    except Exception as exc:  # noqa: BLE001 - reported, with the logs kept
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        args.keep = True
    config: dict[str, Any] = {"parts": parts}
    if "failover" in parts:
        config.update({
            "kills": args.kills, "clients": args.clients,
            "streaming_clients": len(range(0, args.clients, STREAM_EVERY)),
            "control_planes": 3, "nodes": len(NODES), "replicas": len(NODES), "engine": "sim",
            "leader_lease_s": args.lease, "poll_s": POLL_S,
        })
    if "settings" in parts:
        config.update({"agents": args.agents, "changes": args.changes, "push_delay_s": PUSH_DELAY_S,
                       "joining_at_once": JOINING_AT_ONCE})
    config.update({
        "store": f"postgresql ({redact_dsn(args.pg)})",
        "python": sys.version.split()[0], "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    })
    report["config"] = config
    report["elapsed_s"] = round(trio.current_time() - started, 1)
    if args.keep:
        report["logs"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; print the JSON report as the last stdout line. Returns 1 on error."""
    p = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=5, help="leaders killed, one after another (default 5)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients, every fourth streaming (default 8)")
    p.add_argument("--lease", type=float, default=10.0, help="server.yaml leader_lease in seconds (default 10)")
    p.add_argument("--agents", type=int, default=100,
                   help="simulated agents a settings push must reach (default 100)")
    p.add_argument("--changes", type=int, default=3, help="settings changes pushed to them (default 3)")
    p.add_argument("--only", choices=PARTS, help="run one part: failover or settings (default: both)")
    p.add_argument("--pg", default=os.environ.get("LLMGW_TEST_PG") or None,
                   help="PostgreSQL server DSN: the store is a fresh database there (default $LLMGW_TEST_PG)")
    p.add_argument("--keep", action="store_true", help="keep the cluster's directory (logs); kept anyway on error")
    args = p.parse_args(argv)
    if not args.pg:
        p.error("the bench runs on PostgreSQL (several control planes need it): give --pg DSN or set "
                "LLMGW_TEST_PG (scripts/ensure-postgres.sh prints one)")
    if args.agents < 1 or args.changes < 1:
        p.error("--agents and --changes must be at least 1")
    report = trio.run(main_async, args)
    print(json.dumps(report))
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
