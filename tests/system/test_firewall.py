"""llmgw's firewall for real: Debian's nft loads llmgw's table inside a network namespace
this test makes, and real connections probe it from allowed and disallowed addresses.

Two namespaces joined by a veth pair: "server" (10.203.0.1, where the table goes and a
listener holds a protected and an open port) and "clients" (10.203.0.2 and 10.203.0.3, the
source addresses of the probes). The control plane's path runs ``llmgw firewall sync`` on
a firewall.json; the agent's path runs :class:`llmgw.node.firewall.NodeFirewall` with nft in
the namespace. Needs root and nft (``make test`` installs nftables); skips saying which is
missing where the machine cannot have them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import trio

from llmgw.nftables import FirewallPlan, parse_networks
from llmgw.node.firewall import NodeFirewall, read_setting
from tests.system.harness import LLMGW, WAIT, Cluster, Proc, engines_under, eventually
from tests.system.test_service import STAND_IN

SERVER, ALLOWED, OTHER = "10.203.0.1", "10.203.0.2", "10.203.0.3"
PROTECTED, OPEN = 18001, 18002
LISTENER = (
    "import socket, sys, threading\n"
    "def serve(port):\n"
    "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "    s.bind(('0.0.0.0', port)); s.listen(64)\n"
    "    while True:\n"
    "        c, _ = s.accept(); c.close()\n"
    "for p in sys.argv[1:]:\n"
    "    threading.Thread(target=serve, args=(int(p),), daemon=True).start()\n"
    "print('listening', flush=True)\n"
    "threading.Event().wait()\n"
)
PROBE = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10, source_address=(sys.argv[3], 0)).close()\n"
    "    print('connected')\n"
    "except ConnectionRefusedError:\n"
    "    print('refused')\n"
)


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=WAIT)


@contextlib.contextmanager
def namespaces() -> Iterator[tuple[str, str]]:
    """Make the two namespaces and the veth pair; yield (server ns, clients ns); remove them."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make network namespaces and load nft rules")
    if shutil.which("nft") is None:
        pytest.skip("nft is not installed (make test installs Debian's nftables as root)")
    tag = uuid.uuid4().hex[:6]
    server, clients = f"llmgw-fw-s-{tag}", f"llmgw-fw-c-{tag}"
    made = _run("ip", "netns", "add", server)
    if made.returncode != 0:
        pytest.skip(f"this machine cannot make network namespaces: {made.stderr.strip()}")
    try:
        _run("ip", "netns", "add", clients)
        for step in (
            ("ip", "link", "add", f"v{tag}s", "netns", server, "type", "veth", "peer", "name", f"v{tag}c",
             "netns", clients),
            ("ip", "-n", server, "addr", "add", f"{SERVER}/24", "dev", f"v{tag}s"),
            ("ip", "-n", clients, "addr", "add", f"{ALLOWED}/24", "dev", f"v{tag}c"),
            ("ip", "-n", clients, "addr", "add", f"{OTHER}/24", "dev", f"v{tag}c"),
            ("ip", "-n", server, "link", "set", f"v{tag}s", "up"),
            ("ip", "-n", clients, "link", "set", f"v{tag}c", "up"),
            ("ip", "-n", server, "link", "set", "lo", "up"),
            ("ip", "-n", clients, "link", "set", "lo", "up"),
        ):
            done = _run(*step)
            assert done.returncode == 0, f"{' '.join(step)}: {done.stderr}"
        yield server, clients
    finally:
        _run("ip", "netns", "del", clients)
        _run("ip", "netns", "del", server)


@contextlib.contextmanager
def listener(tmp_path: Path, ns: str) -> Iterator[Proc]:
    proc = Proc(["ip", "netns", "exec", ns, sys.executable, "-c", LISTENER, str(PROTECTED), str(OPEN)],
                tmp_path / "listener.log")
    try:
        yield proc
    finally:
        proc.kill()


def probe(ns: str, port: int, source: str, target: str = SERVER) -> str:
    done = _run("ip", "netns", "exec", ns, sys.executable, "-c", PROBE, target, str(port), source)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def reach(clients: str) -> dict[str, str]:
    return {f"{source}:{port}": probe(clients, port, source)
            for source in (ALLOWED, OTHER) for port in (PROTECTED, OPEN)}


def sync(tmp_path: Path, server: str, plan: FirewallPlan) -> subprocess.CompletedProcess[str]:
    plan_file = tmp_path / "firewall.json"
    plan_file.write_text(json.dumps(plan.to_json()))
    return _run("ip", "netns", "exec", server, *LLMGW, "firewall", "sync", "--file", str(plan_file))


async def test_firewall_sync_applies_a_control_planes_file(tmp_path: Path) -> None:
    with namespaces() as (server, clients), listener(tmp_path, server) as proc:
        await proc.wait_for_line("listening")
        everything = {f"{s}:{p}": "connected" for s in (ALLOWED, OTHER) for p in (PROTECTED, OPEN)}
        assert reach(clients) == everything

        done = sync(tmp_path, server, FirewallPlan(True, (PROTECTED,), parse_networks([ALLOWED])))
        assert done.returncode == 0, done.stderr
        assert f"ports {PROTECTED} reachable from this machine and {ALLOWED}/32" in done.stdout
        assert reach(clients) == {**everything, f"{OTHER}:{PROTECTED}": "refused"}
        assert probe(server, PROTECTED, SERVER) == "connected"  # the machine itself, by its own address

        again = sync(tmp_path, server, FirewallPlan(True, (PROTECTED,), parse_networks([ALLOWED])))
        assert again.returncode == 0  # applying the same file twice is safe
        assert _run("ip", "netns", "exec", server, "nft", "list", "tables").stdout.count("llmgw") == 1

        off = sync(tmp_path, server, FirewallPlan(False))
        assert off.returncode == 0 and "removed" in off.stdout
        assert reach(clients) == everything
        assert "llmgw" not in _run("ip", "netns", "exec", server, "nft", "list", "tables").stdout

        bad = tmp_path / "firewall.json"
        bad.write_text('{"enabled": true, "ports": ["x"]}')
        refused = _run("ip", "netns", "exec", server, *LLMGW, "firewall", "sync", "--file", str(bad))
        assert refused.returncode == 1 and "firewall not applied" in refused.stderr and "ports" in refused.stderr


async def test_an_agent_keeps_its_engine_ports_to_the_control_planes_and_listed_networks(tmp_path: Path) -> None:
    with namespaces() as (server, clients), listener(tmp_path, server) as proc:
        await proc.wait_for_line("listening")
        state = tmp_path / "agent-state"
        firewall = NodeFirewall(state, ports=lambda: [PROTECTED], planes=lambda: [f"{ALLOWED}:7070"],
                                prefix=("ip", "netns", "exec", server))
        async with trio.open_nursery() as nursery:
            await nursery.start(firewall.run)
            assert firewall.applied is None  # no setting from the leader yet: nothing applied
            firewall.set({"enabled": True, "networks": []})

            async def applied(want: FirewallPlan) -> bool:
                return firewall.applied == want

            only_planes = FirewallPlan(True, (PROTECTED,), parse_networks([ALLOWED]))
            await eventually(lambda: applied(only_planes), "the control planes-only table", timeout=WAIT)
            assert probe(clients, PROTECTED, ALLOWED) == "connected"  # the control plane
            assert probe(clients, PROTECTED, OTHER) == "refused"
            assert probe(clients, OPEN, OTHER) == "connected"  # not an engine port

            firewall.set({"enabled": True, "networks": [f"{OTHER}/32"]})
            both = FirewallPlan(True, (PROTECTED,), parse_networks([ALLOWED, f"{OTHER}/32"]))
            await eventually(lambda: applied(both), "the listed network allowed", timeout=WAIT)
            assert probe(clients, PROTECTED, OTHER) == "connected"

            firewall.set({"enabled": False})
            await eventually(lambda: applied(FirewallPlan(False)), "the table removed", timeout=WAIT)
            assert "llmgw" not in _run("ip", "netns", "exec", server, "nft", "list", "tables").stdout
            nursery.cancel_scope.cancel()
        assert read_setting(state) == {"enabled": False, "networks": []}  # the next agent starts from it


async def test_the_cluster_setting_reaches_the_agents_table_live(tmp_path: Path) -> None:
    """A whole cluster (SQLite store) inside the server namespace: the leader pushes the
    setting ``firewall`` to the agent, which keeps its engine's port to the control plane and
    the listed networks; the control plane writes its own firewall.json."""
    with namespaces() as (server, clients):
        inside = ["ip", "netns", "exec", server]
        cluster = Cluster(tmp_path)
        procs: list[Proc] = []
        try:
            await cluster.init()
            cluster.server = Proc([*inside, *LLMGW, "server", "-c", str(cluster.server_yaml)], tmp_path / "server.log")
            procs.append(cluster.server)
            m = await cluster.server.wait_for_line(r"llmgw server: rpc (\S+), gateway (\S+)/v1")
            cluster.rpc, cluster.gateway = m.group(1), m.group(2)

            def ctl(*args: str) -> subprocess.CompletedProcess[str]:
                return _run(*inside, *LLMGW, "ctl", "--server", cluster.rpc, "--tls-dir", str(cluster.admin_dir), *args)

            config = cluster.node_config("node-a", extra={"engine_host": SERVER, "firewall": True})
            agent = Proc([*inside, *LLMGW, "agent", "-c", str(config)], tmp_path / "agent.log")
            procs.append(agent)
            await agent.wait_for_line(r"agent: joined \S+ as node 'node-a'")
            assert ctl("models", "add", "m1", "--engine", "sim", "--replicas", "1").returncode == 0

            async def engine_port() -> int | None:
                rows = json.loads(ctl("replicas", "--json").stdout)["replicas"]
                ready = [r for r in rows if r["state"] == "ready"]
                return int(ready[0]["endpoint"].rsplit(":", 1)[1]) if ready else None

            port = await eventually(engine_port, "the replica ready", timeout=WAIT)

            async def reached(want: dict[str, str]) -> bool:
                return {s: probe(clients, port, s) for s in (ALLOWED, OTHER)} == want

            # Joined with no setting stored: the defaults (enabled, no networks): the control plane only.
            await eventually(lambda: reached({ALLOWED: "refused", OTHER: "refused"}), "the engine port closed",
                             timeout=WAIT)
            answer = _run(*inside, sys.executable, "-c", "import urllib.request, sys; print(urllib.request.urlopen("
                          "urllib.request.Request(sys.argv[1] + '/v1/completions', data=b'{\"model\": \"m1\", "
                          "\"prompt\": \"hi\", \"max_tokens\": 2}', headers={'content-type': 'application/json'}), "
                          "timeout=30).status)", cluster.gateway)
            assert answer.stdout.strip() == "200", answer.stderr  # the gateway still reaches its engine

            assert ctl("config", "set", "firewall.networks", f"[{ALLOWED}]").returncode == 0
            await eventually(lambda: reached({ALLOWED: "connected", OTHER: "refused"}), "the listed network let in",
                             timeout=WAIT)

            async def plane_file() -> dict | None:
                path = cluster.server_dir / "firewall.json"
                data = json.loads(path.read_text()) if path.exists() else {}
                return data if f"{ALLOWED}/32" in data.get("peers", []) else None

            written = await eventually(plane_file, "the control plane's firewall.json", timeout=WAIT)
            assert written["enabled"] is True and int(cluster.rpc.rsplit(":", 1)[1]) in written["ports"]

            assert ctl("config", "set", "firewall.enabled", "false").returncode == 0
            await eventually(lambda: reached({ALLOWED: "connected", OTHER: "connected"}), "the table removed",
                             timeout=WAIT)
            refused = ctl("config", "set", "firewall.networks", "[not-a-network]")
            assert refused.returncode == 1 and "firewall.networks" in refused.stderr
        finally:
            for proc in procs:
                proc.kill()
            for p in engines_under(tmp_path):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)


def test_firewall_sync_install_sets_up_the_path_unit(tmp_path: Path) -> None:
    """`llmgw firewall sync --install`, through a stand-in systemctl (systemd cannot run here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(STAND_IN)
    (bin_dir / "systemctl").chmod(0o755)
    calls, units, plan_file = tmp_path / "calls", tmp_path / "units", tmp_path / "state" / "firewall.json"
    done = subprocess.run([*LLMGW, "firewall", "sync", "--install", "--unit-dir", str(units), "--file", str(plan_file)],
                          capture_output=True, text=True, timeout=WAIT,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls)})
    assert done.returncode == 0, done.stderr
    assert "nothing to apply yet" in done.stdout  # the control plane has not written it yet
    assert f"PathChanged={plan_file}" in (units / "llmgw-firewall-sync.path").read_text()
    assert f"firewall sync --file {plan_file}" in (units / "llmgw-firewall-sync.service").read_text()
    assert calls.read_text().splitlines()[-2:] == ["daemon-reload", "enable --now llmgw-firewall-sync.path"]
