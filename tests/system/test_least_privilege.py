"""Engines run as the engines' user, not root (issue 18), with a real agent, real engines and a real user.

As root (CI runs so): ``llmgw agent join --engine-user`` creates the user and notes it for
``llmgw wipe``; the agent started from that agent.yaml runs two simulated engines. From /proc:
each engine's uids and gids are the engines' user's. As that user: the agent's private key,
the shard records (which hold every shard's secret) and the other engine's environment are
unreadable (a plain process of the same user, for contrast, has its environment read). After an
agent restart the engines are adopted with their pids; a shard whose engines' user does not
exist fails with that reason.

The engines' user must be able to run the agent's Python: this one lives under /root, so the
agent here runs on the system's interpreter of the same version, with this environment's
packages (skipped, saying so, where there is none).

The agent runs with only the capabilities its unit leaves it (llmgw-agent.service's
``CapabilityBoundingSet=``, applied with setpriv as systemd would): starting, adopting and
installing all work with those. llama.cpp is installed from a release archive served here
(a stand-in llama-server built with gcc that prints who runs it): its files belong to the
engines' user, and ``ctl engine-check`` runs it as that user.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import pytest
import yaml

from llmgw.node.engine_user import UNDUMPABLE_ENV
from llmgw.node.install.llamacpp import DEFAULT_VERSION, _asset_name
from tests.component.test_install_llamacpp import Served
from tests.system.harness import LLMGW, WAIT, Cluster, Proc, eventually, iter_replicas, ready_replicas

USER = "llmgw-test-engine"
NODE = "lp-1"
REPO = Path(__file__).resolve().parents[2]
SITE = Path(sysconfig.get_paths()["purelib"])
UNIT = REPO / "systemd" / "llmgw-agent.service"
#: Capability numbers (linux/capability.h) of those the agent's unit may name.
CAPABILITY_BITS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3, "CAP_FSETID": 4,
                   "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_ADMIN": 12,
                   "CAP_IPC_LOCK": 14, "CAP_SYS_CHROOT": 18, "CAP_SYS_PTRACE": 19, "CAP_SYS_RESOURCE": 24,
                   "CAP_MKNOD": 27, "CAP_AUDIT_WRITE": 29, "CAP_SETFCAP": 31, "CAP_SYSLOG": 34}
#: The stand-in llama-server: a llama.cpp-style version line; its device listing says who runs it.
STAND_IN_C = r"""
#include <stdio.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        fprintf(stderr, "version: 9.9.9-test (build 11312, commit 0c1e570)\nbuilt with test\n");
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "--list-devices") == 0) { printf("Available devices: none; run by uid=%d\n", (int)getuid()); }
    return 0;
}
"""


def reachable_by_others(path: Path) -> bool:
    """Whether a user other than the owner can reach ``path`` (every directory above it searchable)."""
    real = path.resolve()
    return all(parent.stat().st_mode & 0o001 for parent in real.parents) and real.exists()


def engine_python() -> str | None:
    """An interpreter of this Python version that the engines' user can run, or None."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (Path(sys.executable), Path(f"/usr/bin/python{version}")):
        if candidate.exists() and reachable_by_others(candidate) and reachable_by_others(candidate.resolve().parent):
            out = subprocess.run([str(candidate), "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=WAIT)
            if out.stdout.strip() == str(sys.version_info[:2]):
                return str(candidate)
    return None


PYTHON = engine_python()

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="starting engines as another user needs root (CI runs as root)"),
    pytest.mark.skipif(shutil.which("useradd") is None or shutil.which("userdel") is None,
                       reason="useradd/userdel (Debian's passwd package) are not installed"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed"),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc (to build the stand-in llama-server) is not installed"),
    pytest.mark.skipif(PYTHON is None, reason=f"no Python {sys.version_info[0]}.{sys.version_info[1]} that another user "
                                              "can run (this one is under a private directory)"),
    pytest.mark.skipif(not (reachable_by_others(REPO) and reachable_by_others(SITE)),
                       reason="this checkout or its environment is not reachable by another user"),
]

#: Run by the engines' user: tries to read each path and prints {path: "read" | "denied" | "missing"}.
PROBE = """
import json, sys
seen = {}
for path in sys.argv[1:]:
    try:
        open(path, "rb").read()
        seen[path] = "read"
    except PermissionError:
        seen[path] = "denied"
    except FileNotFoundError:
        seen[path] = "missing"
print(json.dumps(seen))
"""


def unit_capabilities() -> list[str]:
    """The capabilities llmgw-agent.service bounds the agent to (its ``CapabilityBoundingSet=``)."""
    for line in UNIT.read_text().splitlines():
        if line.startswith("CapabilityBoundingSet="):
            return line.split("=", 1)[1].split()
    raise AssertionError(f"{UNIT} has no CapabilityBoundingSet=")


#: Runs llmgw's command line on the system interpreter with this environment's packages.
BOOT = (f"import runpy, site, sys; site.addsitedir({str(SITE)!r}); sys.argv = ['llmgw'] + sys.argv[1:]; "
        "runpy.run_module('llmgw', run_name='__main__')")


def agent_proc(config: Path, log: Path, cache: Path, env: dict[str, str] | None = None) -> Proc:
    """The agent on the system interpreter with this environment's packages (its engines inherit
    both), bounded to its unit's capabilities (setpriv, as systemd's CapabilityBoundingSet=
    does), with ``cache`` as its XDG cache (so root's own engine builds are not found) and
    ``env`` added to its environment."""
    bound = ",".join(["-all", *("+" + name.removeprefix("CAP_").lower() for name in unit_capabilities())])
    return Proc(["setpriv", f"--bounding-set={bound}", "--", str(PYTHON), "-c", BOOT, "agent", "-c", str(config)], log,
                env={"PYTHONPATH": str(SITE), "XDG_CACHE_HOME": str(cache), **(env or {})})


def capabilities(pid: int) -> dict[str, int]:
    """The capability sets of ``pid`` (CapBnd, CapEff, ...) from /proc, as numbers."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(value, 16) for key, value in fields.items() if key.startswith("Cap")}


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[Served]:
    """A llama.cpp release mirror holding this machine's archive of the pinned version (its
    llama-server the stand-in) and its .sha256 file; ``{tag}/{asset}`` under its base."""
    asset = _asset_name(DEFAULT_VERSION)
    if asset is None:
        pytest.skip("llama.cpp publishes no release archive for this CPU")
    source = tmp_path / "stand-in.c"
    source.write_text(STAND_IN_C)
    binary = tmp_path / "llama-server"
    subprocess.run(["gcc", "-o", str(binary), str(source)], check=True, capture_output=True, timeout=WAIT)
    www = tmp_path / "www" / DEFAULT_VERSION
    www.mkdir(parents=True)
    with tarfile.open(www / asset, "w:gz") as tar:
        info = tarfile.TarInfo("build/bin/llama-server")
        info.mode, data = 0o755, binary.read_bytes()
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    (www / f"{asset}.sha256").write_text(f"{hashlib.sha256((www / asset).read_bytes()).hexdigest()}  {asset}\n")
    served = Served(tmp_path / "www")
    try:
        yield served
    finally:
        served.close()


def ids_of(pid: int) -> tuple[list[int], list[int]]:
    """The real, effective, saved and filesystem uids and gids of ``pid``, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return [int(x) for x in fields["Uid"].split()], [int(x) for x in fields["Gid"].split()]


def as_engine_user(*paths: str) -> dict[str, str]:
    entry = pwd.getpwnam(USER)
    out = subprocess.run([str(PYTHON), "-c", PROBE, *paths], capture_output=True, text=True, timeout=WAIT,
                         user=entry.pw_uid, group=entry.pw_gid, extra_groups=[], cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.fixture
async def root() -> AsyncIterator[Path]:
    """A cluster root other users can enter (pytest's own tmp_path is private to root); the
    engines' user is removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="llmgw-least-privilege-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        subprocess.run(["userdel", USER], capture_output=True, timeout=WAIT)
        shutil.rmtree(path, ignore_errors=True)


def join(cluster: Cluster, root: Path, **settings: Any) -> Path:
    """Joins node :data:`NODE` to ``cluster`` with ``llmgw agent join --engine-user`` (which
    creates the engines' user and notes it for ``llmgw wipe``); returns its agent.yaml, with
    engines on loopback, no firewall and ``settings`` added."""
    subprocess.run(["userdel", USER], capture_output=True, timeout=WAIT)  # a leftover of a killed run
    token = cluster.ctl_json("nodes", "add", NODE)["token"]
    config = root / f"{NODE}.yaml"
    joined = subprocess.run(
        [*LLMGW, "agent", "--config", str(config), "join", "--server", cluster.rpc, "--token", token,
         "--state-dir", str(root / NODE), "--engine-user", USER, "--no-start"],
        capture_output=True, text=True, timeout=WAIT)
    assert joined.returncode == 0, joined.stderr + joined.stdout
    assert f"created the engines' user {USER}" in joined.stdout
    assert (root / "created-users").read_text() == f"{USER}\n"  # beside agent.yaml: what `llmgw wipe` removes
    written = yaml.safe_load(config.read_text())
    assert written["engine_user"] == USER
    config.write_text(yaml.safe_dump({**written, "engine_host": "127.0.0.1", "firewall": False, **settings}))
    return config


async def test_engines_run_as_the_engines_user_and_cannot_read_the_agents_secrets(root: Path, mirror: Served) -> None:
    async with Cluster(root, extra={"engines": {"llama.cpp": DEFAULT_VERSION}}) as cluster:
        config = join(cluster, root, engine_urls={"llama.cpp": mirror.base + "/{tag}/{asset}"})
        engine_uid = pwd.getpwnam(USER).pw_uid
        engine_gid = pwd.getpwnam(USER).pw_gid

        agent = agent_proc(config, root / "agent-1.log", root / "agent-cache")
        cluster.agents[NODE] = agent
        await agent.wait_for_line(rf"agent: joined \S+ as node '{NODE}'")
        # `llmgw doctor` (on the same interpreter) finds the engines' user and that it runs llmgw's Python.
        doctor = subprocess.run([str(PYTHON), "-c", BOOT, "doctor", "-c", str(config), "--no-engine-checks", "--json"],
                                capture_output=True, text=True, timeout=WAIT, env={**os.environ, "PYTHONPATH": str(SITE)})
        about_user = [f for f in json.loads(doctor.stdout)["findings"] if f["topic"] == "engine-user"]
        assert about_user == [{"severity": "ok", "topic": "engine-user", "fix": "",
                               "message": f"engines run as {USER} (uid {engine_uid})"}], about_user
        # The unit's set, and nothing more (less where this machine's own bounding set lacks one: a container's).
        bound = sum(1 << CAPABILITY_BITS[name] for name in unit_capabilities()) & capabilities(os.getpid())["CapBnd"]
        caps = capabilities(agent.pid)
        assert caps["CapBnd"] == bound and caps["CapEff"] == bound, caps

        # llama.cpp, wanted by server.yaml, is installed from the mirror by the engines' user: its
        # files are that user's, and the engine check runs it as that user.
        async def llama_installed() -> dict | None:
            [node] = cluster.ctl_json("nodes")
            llama = {e["name"]: e for e in node["engines"]}.get("llama.cpp")
            return llama if llama and llama["installed"] else None

        llama = await eventually(llama_installed, "llama.cpp installed on the node")
        installed = Path(llama["path"])
        assert installed.is_relative_to(root / NODE / "engines"), installed
        assert {p.lstat().st_uid for p in (root / NODE / "engines").rglob("*")} == {engine_uid}  # all it wrote
        check = cluster.ctl("engine-check", NODE, "llama.cpp")
        assert check.returncode == 0 and f"run by uid={engine_uid}" in check.stdout, check.stdout + check.stderr

        assert cluster.ctl("models", "add", "m1", "--engine", "sim", "--replicas", "2").returncode == 0
        replicas = await ready_replicas(cluster, "m1", 2)
        pids = sorted(r["pid"] for r in replicas)
        for pid in pids:
            uids, gids = ids_of(pid)
            assert uids == [engine_uid] * 4 and gids == [engine_gid] * 4, (pid, uids, gids)
            assert f"{UNDUMPABLE_ENV}=1".encode() in Path(f"/proc/{pid}/environ").read_bytes()  # root reads it
            assert capabilities(pid)["CapEff"] == capabilities(pid)["CapPrm"] == 0  # an engine holds no capability

        # A plain process of the engines' user: its environment is readable to that user, so a
        # denial below is the engines' own doing, not a check that cannot succeed.
        entry = pwd.getpwnam(USER)
        plain = subprocess.Popen([str(PYTHON), "-c", "import time; time.sleep(600)"], user=entry.pw_uid,
                                 group=entry.pw_gid, extra_groups=[], cwd="/", env={"PLAIN": "1"})
        try:
            key = root / NODE / "tls" / "key.pem"
            records = sorted(str(p) for p in (root / NODE / "shards").rglob("state.json"))
            assert len(records) == 2
            seen = as_engine_user(str(key), *records, f"/proc/{pids[0]}/environ", f"/proc/{pids[1]}/environ",
                                  f"/proc/{plain.pid}/environ", f"/proc/{pids[0]}/cmdline")
        finally:
            plain.kill()
            plain.wait()
        assert seen[str(key)] == "denied" and all(seen[r] == "denied" for r in records), seen
        assert seen[f"/proc/{pids[0]}/environ"] == seen[f"/proc/{pids[1]}/environ"] == "denied", seen
        assert seen[f"/proc/{plain.pid}/environ"] == "read" and seen[f"/proc/{pids[0]}/cmdline"] == "read", seen

        # The agent restarts: it adopts the engines, which kept their pids and their user.
        agent.signal(signal.SIGTERM)
        await agent.wait_exit()
        agent = agent_proc(config, root / "agent-2.log", root / "agent-cache")
        cluster.agents[NODE] = agent
        await agent.wait_for_line(rf"agent: joined \S+ as node '{NODE}'")
        again = await ready_replicas(cluster, "m1", 2)
        assert sorted(r["pid"] for r in again) == pids

        # An engines' user that does not exist: the new shard fails, saying so; nothing runs as root.
        agent.signal(signal.SIGTERM)
        await agent.wait_exit()
        config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "engine_user": "llmgw-nobody-here"}))
        agent = agent_proc(config, root / "agent-3.log", root / "agent-cache")
        cluster.agents[NODE] = agent
        await agent.wait_for_line(rf"agent: joined \S+ as node '{NODE}'")
        assert cluster.ctl("models", "add", "m2", "--engine", "sim").returncode == 0
        # The shard's FAILED report, as the agent sends it (placement then retries it under backoff).
        await agent.wait_for_line(r"shard m2-\S+: .*the engines' user 'llmgw-nobody-here' does not exist on this node")
        assert not [r for r in iter_replicas(cluster, "m2") if r["pid"]]  # nothing of m2 runs, as root or otherwise
        assert sorted(r["pid"] for r in await ready_replicas(cluster, "m1", 2)) == pids
