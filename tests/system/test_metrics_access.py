"""`llmgw server` with ``metrics.listen`` and ``metrics.token_file``: /metrics moves to its
own address behind the token, and the gateway port no longer serves it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.system.harness import Cluster

pytestmark = pytest.mark.system

TOKEN = "f" * 64


async def test_server_serves_metrics_on_its_own_address_behind_the_token(tmp_path: Path) -> None:
    token_file = tmp_path / "metrics.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    extra = {"metrics": {"listen": "127.0.0.1:0", "token_file": str(token_file)}}
    async with Cluster(tmp_path, auth=True, extra=extra) as cluster:
        assert cluster.server is not None
        m = await cluster.server.wait_for_line(r"metrics on (127\.0\.0\.1:\d+) \(token required\)")
        metrics_url = f"http://{m.group(1)}/metrics"
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await http.get(metrics_url)).status_code == 401
            assert (await http.get(metrics_url, headers={"Authorization": "Bearer " + "e" * 64})).status_code == 401
            ok = await http.get(metrics_url, headers={"Authorization": f"Bearer {TOKEN}"})
            assert ok.status_code == 200 and "llmgw_gateway_requests_total" in ok.text
            moved = await http.get(f"{cluster.gateway}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            assert moved.status_code == 404
        assert TOKEN not in cluster.server.output()
