"""Tenant limits hold for the whole cluster with two control planes (docs/ha.md).

cp-1 (the leader) and cp-2 (a standby) serve ``/v1/*`` on one PostgreSQL store; tenant
acme may have 4 requests in flight. Held streams (the simulated engine decodes slowly, the
test closes them) count what each gateway admits at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
import trio

from tests.system.harness import Cluster, ControlPlaneProc, eventually, ready_replicas

pytestmark = pytest.mark.postgres

LIMIT = 4
#: What rounding may add cluster-wide: gateways x workers - 1 (docs/ha.md).
ROUNDING = 2 * 1 - 1
#: 0.1 s per token and 2,000 tokens: a stream outlasts any test; the test closes it.
SLOW = "--arg=--decode-us-per-token=100000"
BODY = {"model": "m1", "prompt": "hold", "max_tokens": 2000, "stream": True}


@pytest.fixture
async def pair(tmp_path: Path, pg_dsn: str) -> AsyncIterator[tuple[Cluster, ControlPlaneProc, dict[str, str]]]:
    """cp-1 (leads) and cp-2 with API keys on, m1 on one slow replica, tenant acme
    (max_concurrency 4) and its key's header."""
    cluster = Cluster(tmp_path, store_url=pg_dsn, auth=True, extra={"leader_lease": "2s"})
    standby: ControlPlaneProc | None = None
    try:
        await cluster.init()
        await cluster.start_server()
        standby = ControlPlaneProc(cluster, "cp-2")
        await standby.start()
        await cluster.start_agent("node-a", extra={"control_planes": [cluster.rpc, standby.rpc]})
        assert cluster.ctl("models", "add", "m1", "--engine", "sim", SLOW).returncode == 0
        await ready_replicas(cluster, "m1")
        cluster.ctl_json("tenants", "add", "acme", "--max-concurrency", str(LIMIT))
        key = cluster.ctl_json("keys", "create", "--tenant", "acme", "--name", "ci")["key"]
        yield cluster, standby, {"authorization": f"Bearer {key}"}
    finally:
        if standby is not None:
            standby.stop()
        cluster.stop()


class Burst:
    """``n`` streams sent at once to one gateway; the admitted ones stay open until :meth:`close`."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.refusals: list[dict[str, Any]] = []
        self._close = trio.Event()

    @property
    def admitted(self) -> int:
        return self.statuses.count(200)

    def close(self) -> None:
        self._close.set()

    async def open(self, nursery: trio.Nursery, http: httpx.AsyncClient, gateway: str, headers: dict[str, str],
                   n: int) -> Burst:
        """Send the ``n`` streams; return once each has its answer's status."""
        answered = trio.Event()

        async def one() -> None:
            async with http.stream("POST", f"{gateway}/v1/completions", json=BODY, headers=headers) as response:
                self.statuses.append(response.status_code)
                if response.status_code != 200:
                    await response.aread()
                    self.refusals.append(response.json())
                if len(self.statuses) == n:
                    answered.set()
                if response.status_code == 200:
                    await self._close.wait()  # leaving closes it: the gateway frees the slot

        for _ in range(n):
            nursery.start_soon(one)
        await answered.wait()
        return self


async def acme_served(http: httpx.AsyncClient, gateway: str, headers: dict[str, str]) -> bool:
    """The gateway knows acme's key (a standby reloads keys when the leader says so)."""
    response = await http.post(f"{gateway}/v1/completions", headers=headers,
                               json={"model": "m1", "prompt": "hi", "max_tokens": 1})
    return response.status_code == 200


async def test_a_tenant_concurrency_limit_holds_across_two_gateways_and_follows_its_traffic(
    pair: tuple[Cluster, ControlPlaneProc, dict[str, str]],
) -> None:
    cluster, standby, acme = pair
    gateways = [cluster.gateway, standby.gateway]
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as http:
        for gateway in gateways:
            await eventually(lambda g=gateway: acme_served(http, g, acme), f"{gateway} knows acme's key")

        # Spread over both gateways: each enforces its share, together at most the limit
        # plus rounding (no demand yet: 1/2 each, 2 requests each).
        async with trio.open_nursery() as nursery:
            bursts = [Burst(), Burst()]
            async with trio.open_nursery() as sending:
                for burst, gateway in zip(bursts, gateways):
                    sending.start_soon(burst.open, nursery, http, gateway, acme, LIMIT + 2)
            assert sum(b.admitted for b in bursts) <= LIMIT + ROUNDING, [b.statuses for b in bursts]
            assert all(b.admitted >= 1 for b in bursts)
            refused = [r for b in bursts for r in b.refusals]
            assert refused and all(r["error"]["code"] == "concurrency_limit_exceeded" for r in refused)
            assert any("this gateway's share of its concurrency limit of 4" in r["error"]["message"] for r in refused)
            for burst in bursts:
                burst.close()

        # All of acme's traffic through the standby: its share grows (the leader hears of
        # the demand, shrinks its own share, then grows cp-2's) until it admits all 4.
        async def all_four_through_the_standby() -> bool:
            async with trio.open_nursery() as nursery:
                burst = await Burst().open(nursery, http, standby.gateway, acme, LIMIT + 1)
                burst.close()
            assert burst.admitted <= LIMIT, burst.statuses  # never more than the limit on one gateway
            return burst.admitted == LIMIT

        await eventually(all_four_through_the_standby, "cp-2 admits acme's whole limit")

        # ctl status (the leader's gateway) shows its own share, now shrunk for acme.
        def leader_share() -> float | None:
            rows = [a for a in cluster.ctl_json("status")["admission"] if a["tenant"] == "acme"]
            return rows[0]["share"] if rows and rows[0]["share"] < 0.5 else None

        await eventually(leader_share, "ctl status shows the leader's shrunk share of acme's limit")
