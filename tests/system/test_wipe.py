"""``llmgw wipe`` on a scratch root: it lists exactly what goes, asks for the machine's name,
removes that and nothing else, keeps the store and the weights unless asked, and stops the
engines the agent supervises (a real process recorded as a shard's engine)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.node import process, shard_state
from llmgw.spec import ShardSpec
from tests.system.harness import LLMGW, WAIT, alive

OURS = [
    "etc/llmgw/server.yaml", "etc/llmgw/agent.yaml",
    "var/lib/llmgw/ca/ca.pem", "var/lib/llmgw/server/key.pem",
    "var/lib/llmgw-agent/tls/key.pem", "var/lib/llmgw-agent/cluster_settings.json",
    "etc/systemd/system/llmgw-agent.service", "etc/systemd/system/llmgw-server.service",
    "usr/local/share/ca-certificates/llmgw-cluster.crt",
]
STORE = ["var/lib/llmgw/llmgw.db", "var/lib/llmgw/llmgw.db-wal"]
WEIGHTS = ["var/lib/llmgw-agent/weights/qwen/model.gguf"]
THEIRS = [
    "etc/other.conf", "etc/systemd/system/postgresql.service", "var/lib/other/data",
    "usr/local/share/ca-certificates/corp-root.crt", "etc/keepalived/notes.txt",
]


def scratch(root: Path, *, keepalived_ours: bool) -> None:
    for rel in OURS + STORE + WEIGHTS + THEIRS:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{rel}\n")
    mark = "# Written by `llmgw server join --vip`: 10.0.0.9/32 follows the leader.\n" if keepalived_ours else ""
    (root / "etc/keepalived/keepalived.conf").write_text(mark + "vrrp_instance x {}\n")


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def wipe(root: Path, *args: str, answer: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMGW, "wipe", "--root", str(root), *args], input=answer, capture_output=True, text=True,
                          timeout=WAIT)


@pytest.fixture
def engine(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A process in its own group, recorded as the agent's shard m1-1, as a started engine is."""
    # It says "ready" once it runs its own command line: recorded before its exec, the identity
    # would carry the forking interpreter's command line and never match again.
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                            start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def record_engine(root: Path, pid: int) -> None:
    identity = process.identity_of(pid)
    assert identity is not None
    spec = ShardSpec(id="m1-1", model="m1", engine="llama.cpp", source="/models/x.gguf")
    record = shard_state.ShardRecord(spec=spec, port=1, identity=identity)
    shard_state.save(root / "var/lib/llmgw-agent" / "shards", record)


def test_wipe_removes_what_it_lists_and_nothing_else(tmp_path: Path, engine: subprocess.Popen[bytes]) -> None:
    root = tmp_path / "root"
    scratch(root, keepalived_ours=True)
    record_engine(root, engine.pid)
    before = files(root)

    refused = wipe(root, answer="not-this-machine\n")
    assert refused.returncode != 0 and "nothing was removed" in refused.stderr
    assert files(root) == before and engine.poll() is None

    out = wipe(root, answer=f"{socket.gethostname()}\n")
    assert out.returncode == 0, out.stderr + out.stdout
    listed = out.stdout.split("Type this machine's name")[0]
    for rel in ("etc/llmgw", "etc/systemd/system/llmgw-agent.service", "etc/keepalived/keepalived.conf",
                "usr/local/share/ca-certificates/llmgw-cluster.crt", "var/lib/llmgw-agent/tls"):
        assert str(root / rel) in listed, listed
    assert f"stop engine m1-1 (llama.cpp) (pid {engine.pid}" in listed
    assert f"keeps {root / STORE[0]}: the store" in listed
    assert f"keeps {root / 'var/lib/llmgw-agent/weights'}: model weights" in listed
    engine.wait(timeout=WAIT)  # stopped: SIGTERM to its group
    assert not alive(engine.pid)
    assert files(root) == set(THEIRS + STORE + WEIGHTS) | {"etc/keepalived/notes.txt"}

    again = wipe(root, "--all", "--yes")
    assert again.returncode == 0, again.stderr
    assert files(root) == set(THEIRS) | {"etc/keepalived/notes.txt"}
    assert wipe(root, "--all", "--yes").stdout.startswith("nothing of llmgw under")


def test_a_keepalived_configuration_llmgw_did_not_write_stays_and_moved_state_is_found(tmp_path: Path) -> None:
    root = tmp_path / "root"
    scratch(root, keepalived_ours=False)
    (root / "srv/agent/weights").mkdir(parents=True)
    (root / "srv/agent/weights/w.gguf").write_text("w")
    (root / "srv/agent/tls").mkdir(parents=True)
    (root / "srv/agent/tls/key.pem").write_text("k")
    (root / "etc/llmgw/agent.yaml").write_text("state_dir: /srv/agent\n")
    out = wipe(root, "--yes")
    assert out.returncode == 0, out.stderr
    assert "keeps " + str(root / "etc/keepalived/keepalived.conf") + ": not written by llmgw" in out.stdout
    assert (root / "etc/keepalived/keepalived.conf").exists()
    assert not (root / "srv/agent/tls").exists() and (root / "srv/agent/weights/w.gguf").exists()


@pytest.mark.skipif(shutil.which("userdel") is None, reason="userdel (Debian's passwd package) is not installed")
@pytest.mark.skipif(os.geteuid() != 0, reason="userdel --root chroots into the scratch root: root only")
def test_wipe_removes_the_users_llmgw_created_and_no_other(tmp_path: Path) -> None:
    root = tmp_path / "root"
    etc = root / "etc"
    (etc / "llmgw").mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n"
                                "llmgw-engine:x:998:998:llmgw engines:/nonexistent:/usr/sbin/nologin\n"
                                "postgres:x:105:110::/var/lib/postgresql:/bin/bash\n")
    (etc / "group").write_text("root:x:0:\nllmgw-engine:x:998:\npostgres:x:110:\n")
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\nllmgw-engine:!:19000::::::\npostgres:!:19000::::::\n")
    (etc / "gshadow").write_text("root:*::\nllmgw-engine:!::\npostgres:!::\n")
    (etc / "login.defs").write_text("USERGROUPS_ENAB yes\n")  # as Debian's: a user's own group goes with it
    (etc / "llmgw" / "created-users").write_text("llmgw-engine\n")

    out = wipe(root, "--yes")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "remove user llmgw-engine (created by llmgw agent join)" in out.stdout
    assert [line.split(":")[0] for line in (etc / "passwd").read_text().splitlines()] == ["root", "postgres"]
    assert [line.split(":")[0] for line in (etc / "group").read_text().splitlines()] == ["root", "postgres"]
    assert not (etc / "llmgw").exists()
