"""Who may read /metrics (tenant names are in it): the token, its own address, loopback by default.

Real gateways on loopback sockets, scraped over HTTP; the loopback-only rule for other
clients is checked on the rule itself (every test client is on loopback).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

import attrs
import httpx
import pytest
import trio

from llmgw.config import Address, AuthConfig, GatewayConfig, MetricsConfig
from llmgw.router import ReplicaTable, serve_gateway
from llmgw.router.app import Gateway
from llmgw.router.auth import AuthTable
from llmgw.router.build import build_gateway
from llmgw.router.metrics_access import MetricsAccess, metrics_listener
from llmgw.router.settings import GatewaySettings

TOKEN = "0123456789abcdef0123456789abcdef"
DEADLINE_S = 30
#: A family every gateway exposes, present in any scrape.
FAMILY = "llmgw_gateway_requests_total"


@attrs.frozen
class Served:
    gateway: httpx.AsyncClient
    metrics: httpx.AsyncClient | None


@asynccontextmanager
async def serving(config: MetricsConfig, *, auth: bool = True) -> AsyncIterator[Served]:
    """A single-process gateway on a free port with ``metrics:`` ``config`` (its listen port
    replaced by a free one), and a client for each listener."""
    if config.listen is not None:
        config = attrs.evolve(config, listen=Address("127.0.0.1", 0))
    gateway = Gateway(ReplicaTable(), auth=AuthTable(enabled=auth), metrics_config=config)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(DEADLINE_S):
            port = await nursery.start(serve_gateway, gateway.app, "127.0.0.1", 0)
            metrics_port = await nursery.start(metrics_listener, _scrape_of(gateway), config)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as client:
            if metrics_port is None:
                yield Served(client, None)
            else:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_port}", timeout=DEADLINE_S) as m:
                    yield Served(client, m)
        nursery.cancel_scope.cancel()


def _scrape_of(gateway: Gateway) -> Callable[[], Awaitable[bytes]]:
    async def scrape() -> bytes:
        return gateway.metrics.render()[0]

    return scrape


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_with_a_token_metrics_are_refused_without_it_and_served_with_it() -> None:
    async with serving(MetricsConfig(token=TOKEN)) as served:
        for headers in ({}, bearer("wrong-token-of-the-same-length!!"), bearer(TOKEN[:-1]), {"Authorization": TOKEN}):
            refused = await served.gateway.get("/metrics", headers=headers)
            assert refused.status_code == 401, headers
            assert refused.json()["error"]["code"] == "invalid_metrics_token"
            assert refused.headers["www-authenticate"].startswith("Bearer")
            assert FAMILY not in refused.text
        ok = await served.gateway.get("/metrics", headers=bearer(TOKEN))
        assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/plain")
        assert FAMILY in ok.text


async def test_on_its_own_address_the_gateway_port_no_longer_serves_metrics() -> None:
    async with serving(MetricsConfig(listen=Address("127.0.0.1", 0), token=TOKEN)) as served:
        assert served.metrics is not None
        moved = await served.gateway.get("/metrics", headers=bearer(TOKEN))
        assert moved.status_code == 404 and FAMILY not in moved.text
        assert (await served.metrics.get("/metrics")).status_code == 401
        ok = await served.metrics.get("/metrics", headers=bearer(TOKEN))
        assert ok.status_code == 200 and FAMILY in ok.text
        assert (await served.metrics.get("/v1/models", headers=bearer(TOKEN))).status_code == 404
        assert (await served.metrics.post("/metrics", headers=bearer(TOKEN))).status_code == 405
        assert (await served.gateway.get("/healthz")).status_code == 200  # the rest of the gateway is unchanged


async def test_on_its_own_address_without_a_token_metrics_are_served_to_anyone_reaching_it() -> None:
    async with serving(MetricsConfig(listen=Address("127.0.0.1", 0))) as served:
        assert served.metrics is not None
        assert (await served.metrics.get("/metrics")).status_code == 200


async def test_by_default_with_auth_on_the_gateway_port_serves_loopback_clients_only() -> None:
    async with serving(MetricsConfig()) as served:
        assert (await served.gateway.get("/metrics")).status_code == 200  # this client is on loopback
    rule = MetricsAccess.on_gateway(MetricsConfig(), auth_enabled=True)
    for client in (("10.0.0.7", 5000), ("2001:db8::1", 5000), None):
        refusal = rule.refusal({"type": "http", "path": "/metrics", "headers": [], "client": client})
        assert refusal is not None and refusal.status == 403, client
    for client in (("127.0.0.1", 5000), ("::1", 5000), ("::ffff:127.0.0.1", 5000)):
        assert rule.refusal({"type": "http", "path": "/metrics", "headers": [], "client": client}) is None


def test_with_auth_off_metrics_stay_open_as_before() -> None:
    rule = MetricsAccess.on_gateway(MetricsConfig(), auth_enabled=False)
    assert rule.refusal({"type": "http", "path": "/metrics", "headers": [], "client": ("10.0.0.7", 1)}) is None


@pytest.mark.parametrize("listen", [False, True])
async def test_a_worker_pool_applies_the_same_rule_to_its_merged_scrape(listen: bool) -> None:
    config = MetricsConfig(listen=Address("127.0.0.1", 0) if listen else None, token=TOKEN)
    pool = build_gateway(GatewaySettings(gateway=GatewayConfig(workers=2), auth=AuthConfig(enabled=True),
                                         metrics=config))
    async with trio.open_nursery() as nursery:
        with trio.fail_after(60):
            port = await nursery.start(pool.serve, "127.0.0.1", 0)
            metrics_port = await nursery.start(metrics_listener, pool.scrape, config)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as client:
            for _ in range(4):  # connections spread over both workers
                refused = await client.get("/metrics")
                assert refused.status_code == (404 if listen else 401)
                served = await client.get("/metrics", headers=bearer(TOKEN))
                assert served.status_code == (404 if listen else 200)
        if listen:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_port}", timeout=DEADLINE_S) as m:
                assert (await m.get("/metrics")).status_code == 401
                ok = await m.get("/metrics", headers=bearer(TOKEN))
                assert ok.status_code == 200 and FAMILY in ok.text
        nursery.cancel_scope.cancel()
