"""Leader failover: how long a cluster of three control planes is without a leader, what it costs the clients.

``python -m bench.failover [--kills K] [--clients N] [--lease S] [--pg DSN] [--keep]``
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
Timings are polled every :data:`POLL_S`. Progress goes to stderr; the last stdout line is
one JSON object. Nothing here asserts a timing (tests/system/test_ha.py asserts the counts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import trio  # noqa: E402

from bench.drills import (  # noqa: E402
    CONNECT_TIMEOUT_S, DECODE_US_PER_TOKEN, FAILURE_PAUSE_S, HTTP_TIMEOUT_S, MODEL, STREAM_EVERY, Load, Workload,
    fresh_database, one_request,
)
from llmgw.client import connect  # noqa: E402
from llmgw.control.store import redact_dsn  # noqa: E402
from llmgw.rpc.kjtrio import capnp_runtime  # noqa: E402
from tests.system.harness import WAIT, Cluster, ControlPlaneProc, engines_under, eventually, ready_replicas  # noqa: E402

#: Replicas of m1, one per node.
NODES = ("node-a", "node-b")
#: Resolution of failover_s: /leader is polled on every surviving gateway this often.
POLL_S = 0.02
#: Answers the clients must get after each failover before the next kill (per client).
AFTER_PER_CLIENT = 5


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


async def bench(root: Path, store_url: str, args: argparse.Namespace) -> dict[str, Any]:
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


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="llmgw-failover-"))
    started = trio.current_time()
    report: dict[str, Any] = {"bench": "failover"}
    try:
        with fresh_database(args.pg) as store_url:
            async with capnp_runtime():
                report.update(await bench(root, store_url, args))
    except Exception as exc:  # noqa: BLE001 - reported, with the logs kept
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        args.keep = True
    report["config"] = {
        "kills": args.kills, "clients": args.clients, "streaming_clients": len(range(0, args.clients, STREAM_EVERY)),
        "control_planes": 3, "nodes": len(NODES), "replicas": len(NODES), "engine": "sim",
        "leader_lease_s": args.lease, "store": f"postgresql ({redact_dsn(args.pg)})", "poll_s": POLL_S,
        "python": sys.version.split()[0], "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
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
    p.add_argument("--pg", default=os.environ.get("LLMGW_TEST_PG") or None,
                   help="PostgreSQL server DSN: the store is a fresh database there (default $LLMGW_TEST_PG)")
    p.add_argument("--keep", action="store_true", help="keep the cluster's directory (logs); kept anyway on error")
    args = p.parse_args(argv)
    if not args.pg:
        p.error("several control planes need PostgreSQL: give --pg DSN or set LLMGW_TEST_PG "
                "(scripts/ensure-postgres.sh prints one)")
    report = trio.run(main_async, args)
    print(json.dumps(report))
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
