"""``llmgw ctl servers add|list|remove`` and ``llmgw server join``, as an operator runs them.

A first control plane on the test PostgreSQL mints a token; ``llmgw server join`` (a real
process, no certificate) checks the cluster against the token's CA pin, redeems the token
with a key that never leaves its state directory, and writes server.yaml and a keepalived
configuration; the control plane started from what it wrote becomes a standby. The token
works once; removing the control plane revokes its certificate.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import yaml

from llmgw.cli.keepalived import check_interface

from tests.system.harness import LLMGW, WAIT, Cluster, eventually, start_server
from tests.system.test_service import STAND_IN

pytestmark = pytest.mark.postgres


def join(tmp_path: Path, name: str, token: str, server: str, *extra: str) -> subprocess.CompletedProcess[str]:
    state = tmp_path / name
    return subprocess.run(
        [*LLMGW, "server", "--config", str(tmp_path / f"{name}.yaml"), "join", "--server", server, "--token", token,
         "--advertise", "127.0.0.1", "--rpc-port", "0", "--http-port", "0", "--state-dir", str(state),
         "--no-start", *extra],
        capture_output=True, text=True, timeout=WAIT,
    )


def shared_interface() -> str | None:
    """Returns an interface of this machine keepalived could float an address on (None: only loopback)."""
    for name in sorted(psutil.net_if_stats()):
        try:
            check_interface(name)
            return name
        except ValueError:
            continue
    return None


def roles(cluster: Cluster) -> dict[str, str]:
    return {p["name"]: p["role"] for p in cluster.ctl_json("servers", "list")["control_planes"]}


async def test_a_control_plane_joins_with_a_token_once_and_is_refused_once_removed(
    tmp_path: Path, pg_dsn: str,
) -> None:
    cluster = Cluster(tmp_path, store_url=pg_dsn)
    joined = None
    try:
        await cluster.init()
        await cluster.start_server()
        leader = cluster.ctl_json("status")["leader"]
        added = cluster.ctl_json("servers", "add", "cp-2", "--ttl", "10m")
        token = added["token"]
        assert added["control_planes"] == [cluster.rpc] and "llmgw server join" in added["command"]
        assert [(t["name"], t["state"]) for t in cluster.ctl_json("servers", "list")["join_tokens"]] == [
            ("cp-2", "pending")]

        # A token pinning another CA: refused before the token is sent, so it stays usable.
        pinned_elsewhere = token[:-64] + "0" * 64
        out = join(tmp_path, "cp-x", pinned_elsewhere, cluster.rpc)
        assert out.returncode != 0 and "not the one the join token names" in out.stderr, out.stderr
        out = join(tmp_path, "cp-x", "not-a-token", cluster.rpc)
        assert out.returncode != 0 and "not an llmgw join token" in out.stderr, out.stderr

        # keepalived runs no VRRP on a loopback: refused before the token is spent.
        out = join(tmp_path, "cp-x", token, cluster.rpc, "--vip", "198.51.100.9/32")  # reached at 127.0.0.1: lo
        assert out.returncode != 0 and "lo is a loopback interface" in out.stderr, out.stderr

        keepalived = tmp_path / "keepalived.conf"
        interface = shared_interface()
        floating = ("--vip", "198.51.100.9/32", "--vip-interface", interface, "--keepalived-config",
                    str(keepalived)) if interface else ()
        out = join(tmp_path, "cp-2", token, cluster.rpc, *floating)
        assert out.returncode == 0, out.stderr + out.stdout
        assert "control plane cp-2" in out.stdout
        state = tmp_path / "cp-2"
        assert (state / "server" / "key.pem").stat().st_mode & 0o777 == 0o600
        assert (state / "ca" / "ca.pem").read_bytes() == (cluster.server_dir / "ca" / "ca.pem").read_bytes()
        written = yaml.safe_load((tmp_path / "cp-2.yaml").read_text())
        assert written["store"]["url"] == pg_dsn and written["advertise_hosts"] == ["127.0.0.1"]
        if interface:  # keepalived's own check of what was written (scripts/ensure-test-tools.sh installs it)
            conf = keepalived.read_text()
            assert f"198.51.100.9/32 dev {interface}" in conf and "/leader" in conf
            if shutil.which("keepalived"):
                check = subprocess.run(["keepalived", "-t", "-f", str(keepalived)], capture_output=True, text=True,
                                       timeout=WAIT)
                # keepalived 2.2.7 (Debian 12) ends a passing check of a configuration with scripts by
                # SIGTERM to itself (acassen/keepalived#2587, fixed in 2.2.8): no output means it passed.
                assert check.returncode == 0 or (check.returncode == -signal.SIGTERM and not check.stderr.strip()), \
                    check.stderr

        # Safe to run twice; the token works once.
        again = join(tmp_path, "cp-2", token, cluster.rpc)
        assert again.returncode == 0 and "joined this cluster already" in again.stdout, again.stderr
        reused = join(tmp_path, "cp-3", token, cluster.rpc)
        assert reused.returncode != 0 and "used already" in reused.stderr, reused.stderr

        joined, _, _ = await start_server(tmp_path / "cp-2.yaml", tmp_path / "cp-2.log")
        await eventually(lambda: roles(cluster).get("cp-2") == "standby", "cp-2 streams from the leader")
        # The joined control plane holds the CA's key: it answers joins too, and signs nothing wrong.
        assert [t["state"] for t in cluster.ctl_json("servers", "list", "--all")["join_tokens"]] == ["used"]

        refused = cluster.ctl("servers", "remove", leader)
        assert refused.returncode != 0 and "leads: stop it first" in refused.stderr, refused.stderr
        removed = cluster.ctl_json("servers", "remove", "cp-2")
        assert removed == {"name": "cp-2", "removed": True}
        await eventually(lambda: "cp-2" not in roles(cluster), "cp-2 is gone from the list")
        assert cluster.server is not None
        await cluster.server.wait_for_line(r"refused connect from control 'cp-2': .*certificate was revoked")
        joined.kill()
        # Started again, it is refused: its certificate was revoked.
        restarted = subprocess.run([*LLMGW, "server", "-c", str(tmp_path / "cp-2.yaml")], capture_output=True,
                                   text=True, timeout=WAIT)
        assert restarted.returncode != 0 and "was revoked" in restarted.stderr, restarted.stderr
        assert "cp-2" not in roles(cluster)

        # Without --no-start the join installs its unit and starts it through systemctl (a
        # stand-in here: systemd cannot run in this machine; tests/system/test_service.py).
        token = cluster.ctl_json("servers", "add", "cp-4")["token"]
        bin_dir, units = tmp_path / "bin", tmp_path / "units"
        bin_dir.mkdir()
        (bin_dir / "systemctl").write_text(STAND_IN)
        (bin_dir / "systemctl").chmod(0o755)
        calls = tmp_path / "systemctl-calls"
        out = subprocess.run(
            [*LLMGW, "server", "--config", str(tmp_path / "cp-4.yaml"), "join", "--server", cluster.rpc,
             "--token", token, "--advertise", "127.0.0.1", "--rpc-port", "0", "--http-port", "0",
             "--state-dir", str(tmp_path / "cp-4"), "--unit-dir", str(units), "--user", "nobody"],
            capture_output=True, text=True, timeout=WAIT,
            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls)},
        )
        assert out.returncode == 0, out.stderr + out.stdout
        unit = (units / "llmgw-server.service").read_text()
        assert f" server --config {tmp_path / 'cp-4.yaml'}\n" in unit and "User=nobody\n" in unit
        assert f"ReadWritePaths={tmp_path / 'cp-4'}\n" in unit
        assert calls.read_text().splitlines() == ["is-system-running", "daemon-reload",
                                                  "enable --now llmgw-server.service"]
    finally:
        if joined is not None:
            joined.kill()
        cluster.stop()
