"""`llmgw server` and its store location: a PostgreSQL DSN in either form is PostgreSQL or a
refusal with the reason, never a SQLite file named after it, and no password is ever printed."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import httpx
import psycopg
import pytest
import yaml

from tests.pg import as_conninfo
from tests.system.harness import LLMGW, WAIT, Cluster, eventually

pytestmark = pytest.mark.system

SECRET = "s3cretPW"
#: How long pg_terminate_backend waits for the backend to exit (it is local: far less).
TERMINATE_WAIT_MS = 5000


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_server(cluster: Cluster, store: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run `llmgw server` in ``cwd`` with ``store`` as its store section; return when it exits."""
    raw = yaml.safe_load(cluster.server_yaml.read_text())
    raw["store"] = store
    cluster.server_yaml.write_text(yaml.safe_dump(raw))
    return subprocess.run([*LLMGW, "server", "-c", str(cluster.server_yaml)], cwd=cwd,
                          capture_output=True, text=True, timeout=WAIT)


@pytest.mark.parametrize(
    ("store", "reason"),
    [
        # The tester's drill: libpq's key=value form, which docs/config.md shows.
        ({"dsn": f"host=127.0.0.1 port={{port}} dbname=x user=postgres password={SECRET}"},
         "cannot connect to PostgreSQL database host=127.0.0.1 port={port} dbname=x user=postgres"),
        ({"url": f"host=127.0.0.1 port={{port}} dbname=x user=postgres password={SECRET}"},
         "cannot connect to PostgreSQL database host=127.0.0.1 port={port} dbname=x user=postgres"),
        ({"url": f"postgresql://postgres:{SECRET}@127.0.0.1:{{port}}/x"},
         "cannot connect to PostgreSQL database postgresql://postgres@127.0.0.1:{port}/x"),
        ({"dsn": f"host=127.0.0.1 password='{SECRET}"},
         "server.yaml: store.dsn: looks like a libpq key=value DSN but is not one"),
        ({"dsn": "/srv/llmgw.db"}, "server.yaml: store.dsn: is for PostgreSQL"),
    ],
)
async def test_a_dsn_that_cannot_connect_is_refused_with_its_reason(
    tmp_path: Path, store: dict[str, str], reason: str
) -> None:
    cluster = Cluster(tmp_path)
    await cluster.init()
    port = _closed_port()
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    out = _run_server(cluster, {k: v.format(port=port) for k, v in store.items()}, workdir)
    printed = out.stdout + out.stderr
    assert out.returncode != 0, printed
    assert reason.format(port=port) in printed
    assert SECRET not in printed
    assert list(workdir.iterdir()) == []  # no SQLite file named after the DSN
    assert not list(cluster.server_dir.glob("*.db*"))


@pytest.mark.postgres
async def test_server_on_a_key_value_dsn_uses_postgresql_and_survives_a_terminated_connection(
    tmp_path: Path, pg_dsn: str
) -> None:
    cluster = Cluster(tmp_path, extra={"store": {"dsn": as_conninfo(pg_dsn)}})
    try:
        await cluster.init()
        await cluster.start_server()
        assert cluster.ctl("models", "add", "m1", "--engine", "sim").returncode == 0
        epoch = _leader(cluster)["epoch"]
        # A DBA (or a failover) ends the store's connections: the next admin calls, a write
        # that is not safe to repeat among them, each succeed once on a new connection.
        with psycopg.connect(pg_dsn, autocommit=True, connect_timeout=3) as admin:
            killed = admin.execute(
                "SELECT pg_terminate_backend(pid, %s) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = 'llmgw'", (TERMINATE_WAIT_MS,),
            ).fetchall()
        assert killed and all(ok for (ok,) in killed)
        # The election's connection went too, and with it the session's advisory lock: the
        # control plane steps down at its next renewal and leads again on a new connection.
        # Admin calls in between are refused (a standby's); the calls below come after.
        await eventually(lambda: (state := _leader(cluster))["leading"] and state["epoch"] > epoch,
                         "the control plane to lead again at a new epoch")
        added = cluster.ctl("models", "add", "m2", "--engine", "sim")
        assert added.returncode == 0, added.stderr
        assert [m["name"] for m in cluster.ctl_json("models", "list")] == ["m1", "m2"]
    finally:
        cluster.stop()
    with psycopg.connect(pg_dsn, connect_timeout=3) as conn:
        assert conn.execute("SELECT name FROM models ORDER BY name").fetchall() == [("m1",), ("m2",)]
    assert not list(cluster.server_dir.glob("*.db*"))
    assert "the connection was lost" in (tmp_path / "server-1.log").read_text()


def _leader(cluster: Cluster) -> dict[str, object]:
    """Returns the control plane's ``GET /leader`` (leading, leader, epoch)."""
    return httpx.get(cluster.gateway + "/leader", timeout=5).json()
