"""Real llmgw processes on loopback for system tests: a server, agents, the ctl command.

Each process writes its output to a file in the test's directory (no pipes to
fill up); readiness is a line in that file or a condition on the cluster,
waited for with a deadline, never a sleep.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, TypeVar

import psutil
import trio
import yaml

from llmgw.cli.pki import ensure_cluster_pki, issue_to
from llmgw.rpc.tls import ClusterCA

T = TypeVar("T")

#: Bounds every wait in system tests: generous for a loaded 2-core CI machine, and a
#: broken cluster fails the test instead of hanging the suite.
WAIT = 60.0
#: How often a condition on the cluster is re-checked while waiting for it.
POLL = 0.05

LLMGW = [sys.executable, "-m", "llmgw"]


class Fatal(AssertionError):
    """Raised by a check when waiting longer cannot help (the process died)."""


async def eventually(check: Callable[[], Awaitable[T | None] | T | None], what: str, timeout: float = WAIT) -> T:
    """Re-run ``check`` (a coroutine function, or a plain one) until it returns something
    truthy; return that. Fails after ``timeout``."""
    last: BaseException | None = None
    with trio.move_on_after(timeout):
        while True:
            try:
                result = check()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return result
            except Fatal:
                raise
            except Exception as exc:  # noqa: BLE001 - remembered for the failure message
                last = exc
            await trio.sleep(POLL)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}" + (f" (last error: {last!r})" if last else ""))


class Proc:
    """A child process whose output goes to ``log``; killed (with its group) by :meth:`kill`."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log = log
        self._out = open(log, "ab")
        self.popen = subprocess.Popen(
            args, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_for_line(self, pattern: str, timeout: float = WAIT) -> re.Match[str]:
        regex = re.compile(pattern)

        async def check() -> re.Match[str] | None:
            if self.popen.poll() is not None:
                raise Fatal(f"{self.args} exited with {self.popen.returncode}:\n{self.output()[-3000:]}")
            return regex.search(self.output())

        try:
            return await eventually(check, f"{pattern!r} in {self.log.name}", timeout)
        except AssertionError as exc:
            raise Fatal(f"{exc}\n--- {self.log.name} ---\n{self.output()[-3000:]}") from None

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL the process (only it: engines it started live in their own sessions)."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        self._out.close()

    async def wait_exit(self, timeout: float = WAIT) -> int:
        with trio.fail_after(timeout):
            while self.popen.poll() is None:
                await trio.sleep(POLL)
        return self.popen.returncode


async def start_server(config: Path, log: Path) -> tuple[Proc, str, str]:
    """Start ``llmgw server -c config`` (output into ``log``) and wait until it listens;
    returns the process, its RPC address and its gateway's base URL."""
    proc = Proc([*LLMGW, "server", "-c", str(config)], log)
    m = await proc.wait_for_line(r"llmgw server: rpc (\S+), gateway (\S+)/v1")
    return proc, m.group(1), m.group(2)


def pin_ports(config: Path, rpc: str, gateway: str) -> None:
    """Make the server of ``config`` listen on ``rpc`` and ``gateway``'s address at its next start."""
    raw = yaml.safe_load(config.read_text())
    raw["rpc_listen"], raw["http_listen"] = rpc, gateway.removeprefix("http://")
    config.write_text(yaml.safe_dump(raw))


class Cluster:
    """A control plane with its CA in ``root``/server, plus agents, all real processes."""

    def __init__(self, root: Path, *, store_url: str | None = None, lost_after: str = "10s",
                 replace_grace: str = "30s", heartbeat: str = "0.5s", auth: bool = False,
                 extra: dict[str, Any] | None = None) -> None:
        self.root = root
        self.server_dir = root / "server"
        self.server_dir.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "state_dir": str(self.server_dir),
            "rpc_listen": "127.0.0.1:0",
            "http_listen": "127.0.0.1:0",
            "heartbeat_interval": heartbeat,
            "node_lost_after": lost_after,
            "replace_grace": replace_grace,
            "log_level": "info",
            # API keys off unless a test is about them: the gateway listens on loopback only.
            "auth": {"enabled": auth},
        }
        if store_url:
            config["store"] = {"url": store_url}  # a SQLite file or a PostgreSQL DSN
        self.server_yaml = root / "server.yaml"
        config.update(extra or {})
        self.server_yaml.write_text(yaml.safe_dump(config))
        self.server: Proc | None = None
        self.server_starts = 0
        self.agents: dict[str, Proc] = {}
        self.rpc = ""
        self.gateway = ""
        self.admin_dir = self.server_dir / "admin"

    async def __aenter__(self) -> Cluster:
        """``async with Cluster(...) as c``: :meth:`init` and :meth:`start_server`; :meth:`stop` on exit."""
        try:
            await self.init()
            await self.start_server()
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(self, *_: object) -> None:
        self.stop()

    # -- processes ------------------------------------------------------------------

    async def init(self) -> None:
        """`llmgw server init` through the CLI."""
        out = subprocess.run([*LLMGW, "server", "-c", str(self.server_yaml), "init"],
                             capture_output=True, text=True, timeout=WAIT)
        assert out.returncode == 0, out.stderr + out.stdout

    async def start_server(self) -> None:
        self.server_starts += 1
        self.server, self.rpc, self.gateway = await start_server(
            self.server_yaml, self.root / f"server-{self.server_starts}.log")

    def pin_ports(self) -> None:
        """Make the server's next start listen on the addresses it has now (agents dial that RPC port)."""
        pin_ports(self.server_yaml, self.rpc, self.gateway)

    def ca(self) -> ClusterCA:
        return ClusterCA.load(self.server_dir / "ca")

    def node_config(self, node_id: str, *, cert_name: str | None = None, extra: dict[str, Any] | None = None) -> Path:
        """Writes ``node_id``'s agent.yaml (``extra``: more keys, e.g. ``engines``); returns its path."""
        node_dir = self.root / node_id
        tls = node_dir / "state" / "tls"
        if not (tls / "cert.pem").exists():
            issue_to(self.ca(), "node", cert_name or node_id, tls)
        path = node_dir / "agent.yaml"
        path.write_text(yaml.safe_dump({
            "node_id": node_id,
            "control_planes": [self.rpc],
            "state_dir": str(node_dir / "state"),
            "engine_host": "127.0.0.1",
            "log_level": "info",
            # Tests run as root: an agent keeping its nft table would change this machine's
            # firewall. tests/system/test_firewall.py runs one inside a network namespace.
            "firewall": False,
            # As root, engines would run as llmgw-engine, which this machine need not have (and
            # which could not run the interpreter under /root): tests/system/test_least_privilege.py
            # runs them as an engines' user of its own.
            "engine_user": "",
            **(extra or {}),
        }))
        return path

    async def start_agent(self, node_id: str, *, extra: dict[str, Any] | None = None) -> Proc:
        """Starts ``node_id``'s agent (``extra``: more agent.yaml keys) and waits until it joined."""
        config = self.node_config(node_id, extra=extra)
        proc = Proc([*LLMGW, "agent", "-c", str(config)], self.root / f"agent-{node_id}.log")
        self.agents[node_id] = proc
        await proc.wait_for_line(rf"agent: joined \S+ as node '{node_id}'")
        return proc

    def ctl(self, *args: str, tls_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*LLMGW, "ctl", "--server", self.rpc, "--tls-dir", str(tls_dir or self.admin_dir), *args],
            capture_output=True, text=True, timeout=WAIT,
        )

    def ctl_json(self, *args: str) -> Any:
        out = self.ctl(*args, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def stop(self) -> None:
        """Kill every llmgw process and every engine they started."""
        engines = engines_under(self.root)
        for proc in [*self.agents.values(), *([self.server] if self.server else [])]:
            proc.signal(signal.SIGCONT)
            proc.kill()
        for p in engines + engines_under(self.root):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class ControlPlaneProc:
    """One more control plane of ``cluster`` (several control planes on one PostgreSQL
    store): its own state directory, a control-plane certificate of the cluster CA named
    ``name``, the cluster's server.yaml otherwise."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.name = name
        self.root = cluster.root
        self.dir = cluster.root / name
        config = yaml.safe_load(cluster.server_yaml.read_text())
        config["state_dir"] = str(self.dir)
        self.yaml = cluster.root / f"{name}.yaml"
        self.yaml.write_text(yaml.safe_dump(config))
        issue_to(cluster.ca(), "control", name, self.dir / "server", sans=["127.0.0.1"])
        self.proc: Proc | None = None
        self.starts = 0
        self.rpc = ""
        self.gateway = ""

    async def start(self) -> None:
        """Start it and wait until it listens (``rpc``, ``gateway`` are its addresses)."""
        self.starts += 1
        self.proc, self.rpc, self.gateway = await start_server(self.yaml, self.root / f"{self.name}-{self.starts}.log")

    def pin_ports(self) -> None:
        """Make the next start listen on the addresses it has now."""
        pin_ports(self.yaml, self.rpc, self.gateway)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.signal(signal.SIGCONT)
            self.proc.kill()


def engines_under(root: Path) -> list[psutil.Process]:
    """Engines (any engine: sim, llama-server, vLLM) whose working directory is under ``root``.

    The supervisor starts every engine in its shard's state directory, so this finds
    exactly the engines of a cluster whose state lives under ``root``.
    """
    found = []
    me = os.getpid()
    for p in psutil.process_iter(["cwd"]):
        cwd = p.info.get("cwd")
        if p.pid != me and cwd and Path(cwd).is_relative_to(root):
            found.append(p)
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def iter_replicas(cluster: Cluster, model: str | None = None) -> Iterator[dict[str, Any]]:
    for r in cluster.ctl_json("replicas")["replicas"]:
        if model is None or r["model"] == model:
            yield r


async def ready_replicas(cluster: Cluster, model: str, count: int = 1, timeout: float = WAIT) -> list[dict[str, Any]]:
    """Return the READY replicas of ``model`` once there are exactly ``count``.

    Fails at once (:class:`Fatal`) when a replica of ``model`` is FAILED, with its row.
    """
    async def check() -> list[dict[str, Any]] | None:
        rows = list(iter_replicas(cluster, model))
        failed = [r for r in rows if r["state"] == "failed"]
        if failed:
            raise Fatal(f"a replica of {model} failed: {failed[0]}")
        ready = [r for r in rows if r["state"] == "ready"]
        return ready if len(ready) == count else None

    return await eventually(check, f"{count} ready replica(s) of {model}", timeout=timeout)


async def serve_sim_model(cluster: Cluster, model: str = "m1", replicas: int = 2, *args: str) -> Proc:
    """Start agent ``node-a``, add ``model`` on the simulated engine (``args``: more
    ``ctl models add`` options) and wait for its ``replicas`` to be ready; return the server."""
    await cluster.start_agent("node-a")
    out = cluster.ctl("models", "add", model, "--engine", "sim", "--replicas", str(replicas), *args)
    assert out.returncode == 0, out.stderr
    await ready_replicas(cluster, model, replicas)
    assert cluster.server is not None
    return cluster.server


def engine_secret(cluster: Cluster, replica: dict[str, Any]) -> str:
    """Return ``replica``'s engine secret (a ``ctl replicas --json`` row), read from the
    agent's shard state as the agent's own user can."""
    [state] = (cluster.root / replica["node_id"] / "state").rglob(f"{replica['id']}/state.json")
    return str(json.loads(state.read_text())["spec"]["api_key"])


def engine_auth(cluster: Cluster, replica: dict[str, Any]) -> dict[str, str]:
    """Return the header that lets a test talk to ``replica``'s engine directly: its secret
    as Bearer token (the engine answers nobody without it)."""
    return {"Authorization": f"Bearer {engine_secret(cluster, replica)}"}


async def sse_events(response: Any) -> AsyncIterator[Any]:
    """Yield each ``data:`` event of a gateway's SSE stream (an httpx streaming response):
    ``"[DONE]"`` as it is, any other decoded from JSON."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Return the sum of every sample of ``name`` in a Prometheus scrape ``text`` whose
    labels include ``labels`` (0 when there is none)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", text, re.MULTILINE):
        if all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def standalone_pki(root: Path) -> ClusterCA:
    """Another cluster's CA, for refusal tests."""
    ca, _ = ensure_cluster_pki(root, server_name="other")
    return ca
