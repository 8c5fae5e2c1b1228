"""Prometheus metrics of a real gateway: scrape /metrics over HTTP and parse the text format."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import AsyncIterator

import attrs
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from llmgw.router import LoadTracker, Replica, ReplicaTable, create_app, serve_gateway
from tests.component.upstream_fixture import FakeUpstream, refused_endpoint  # noqa: F401 (fixture)

MODEL = "tiny-chat"
DEADLINE_S = 10


@attrs.define
class Env:
    client: httpx.AsyncClient
    load: LoadTracker
    upstreams: list[FakeUpstream]

    async def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Return every sample of /metrics as {(sample name, sorted labels): value}."""
        response = await self.client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        samples = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    async def wait_idle(self) -> None:
        with trio.fail_after(DEADLINE_S):
            await self.load.wait_until(lambda load: load.total() == 0)


def select(samples: dict, name: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Return the samples called ``name`` whose labels include ``labels``."""
    return {
        key_labels: value
        for (sample_name, key_labels), value in samples.items()
        if sample_name == name and all((k, v) in key_labels for k, v in labels.items())
    }


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(select(samples, name, **labels).values())


@asynccontextmanager
async def gateway(replicas: int = 2, extra: tuple[Replica, ...] = ()) -> AsyncIterator[Env]:
    async with trio.open_nursery() as nursery:
        upstreams = [FakeUpstream(f"r{i}") for i in range(replicas)]
        for upstream in upstreams:
            await nursery.start(upstream.serve)
        table = ReplicaTable()
        table.set_model_replicas(MODEL, list(extra) + [Replica(u.name, MODEL, u.endpoint) for u in upstreams])
        load = LoadTracker()
        port = await nursery.start(serve_gateway, create_app(table, load=load), "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as client:
            yield Env(client, load, upstreams)
        nursery.cancel_scope.cancel()


def chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


async def test_requests_are_counted_by_model_and_status() -> None:
    async with gateway() as env:
        for _ in range(3):
            assert (await env.client.post("/v1/chat/completions", json=chat())).status_code == 200
        assert (await env.client.post("/v1/chat/completions", json=chat(upstream_status=500))).status_code == 500
        assert (await env.client.post("/v1/chat/completions", json=chat(model="nope"))).status_code == 404
        assert (await env.client.post("/v1/chat/completions", content=b"{")).status_code == 400
        await env.client.get("/healthz")  # not API traffic: not counted
        await env.wait_idle()
        samples = await env.scrape()

        assert total(samples, "llmgw_gateway_requests_total", model=MODEL, status="200") == 3
        assert total(samples, "llmgw_gateway_requests_total", model=MODEL, status="500") == 1
        assert total(samples, "llmgw_gateway_requests_total", model="unknown", status="404") == 1
        assert total(samples, "llmgw_gateway_requests_total", model="unknown", status="400") == 1
        assert total(samples, "llmgw_gateway_requests_total") == 6
        tenants = {dict(labels)["tenant"] for labels in select(samples, "llmgw_gateway_requests_total")}
        assert len(tenants) == 1  # the one tenant of an unauthenticated gateway
        assert total(samples, "llmgw_gateway_request_duration_seconds_count", model=MODEL) == 4
        assert select(samples, "llmgw_gateway_request_duration_seconds_bucket", model=MODEL, le="+Inf")
        assert total(samples, "llmgw_gateway_upstream_errors_total", kind="status_5xx") == 1
        # Non-streamed answers have no time to first token.
        assert total(samples, "llmgw_gateway_time_to_first_token_seconds_count") == 0


async def test_unknown_model_names_do_not_create_series() -> None:
    async with gateway(replicas=1) as env:
        for index in range(20):
            body = chat(model=f"made-up-{index}")
            assert (await env.client.post("/v1/chat/completions", json=body)).status_code == 404
        samples = await env.scrape()
        models = {dict(labels)["model"] for labels in select(samples, "llmgw_gateway_requests_total")}
        assert models == {"unknown"}
        assert total(samples, "llmgw_gateway_requests_total", model="unknown", status="404") == 20


async def test_stream_records_time_to_first_token_and_chunk_gaps() -> None:
    async with gateway(replicas=1) as env:
        upstream = env.upstreams[0]
        upstream.gated = True  # each chunk waits for the client to have read the previous one
        chunks = 0
        async with env.client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    assert "error" not in json.loads(line[len("data: "):])
                    upstream.allow_chunk()
        assert chunks == 4
        await env.wait_idle()
        samples = await env.scrape()
        assert total(samples, "llmgw_gateway_time_to_first_token_seconds_count", model=MODEL) == 1
        # Four gated chunks leave the gateway as at least four body messages: three gaps or more.
        assert total(samples, "llmgw_gateway_inter_chunk_seconds_count", model=MODEL) >= 3
        assert total(samples, "llmgw_gateway_requests_total", model=MODEL, status="200") == 1


async def test_in_flight_per_replica_rises_and_returns_to_zero() -> None:
    async with gateway(replicas=2) as env:
        hold = trio.Event()
        for upstream in env.upstreams:
            upstream.hold = hold
        statuses: list[int] = []

        async def one() -> None:
            statuses.append((await env.client.post("/v1/chat/completions", json=chat())).status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
            with trio.fail_after(DEADLINE_S):
                await env.load.wait_until(lambda load: load.total() == 3)
            samples = await env.scrape()
            in_flight = select(samples, "llmgw_gateway_in_flight")
            assert sorted(in_flight.values()) == [1.0, 2.0]
            assert {dict(labels)["replica"] for labels in in_flight} == {"r0", "r1"}
            hold.set()
        assert statuses == [200, 200, 200]
        await env.wait_idle()
        samples = await env.scrape()
        assert select(samples, "llmgw_gateway_in_flight") == {
            (("replica", "r0"),): 0.0,
            (("replica", "r1"),): 0.0,
        }
        assert total(samples, "llmgw_gateway_admitted_total", model=MODEL) == 3
        assert total(samples, "llmgw_gateway_queued", model=MODEL) == 0


async def test_connect_failure_counts_an_error_and_a_retry(refused_endpoint: str) -> None:
    dead = Replica("dead", MODEL, refused_endpoint)
    async with gateway(replicas=1, extra=(dead,)) as env:
        # Idle replicas take turns, so at least one of two requests tries "dead" first;
        # each that did is retried once on the live replica.
        for _ in range(2):
            assert (await env.client.post("/v1/chat/completions", json=chat())).status_code == 200
        samples = await env.scrape()
        errors = total(samples, "llmgw_gateway_upstream_errors_total", replica="dead", kind="connect")
        assert errors >= 1
        assert total(samples, "llmgw_gateway_upstream_retries_total", model=MODEL) == errors
        assert total(samples, "llmgw_gateway_upstream_errors_total", replica="r0") == 0


async def test_each_gateway_has_its_own_registry() -> None:
    async with gateway(replicas=1) as first, gateway(replicas=1) as second:
        assert (await first.client.post("/v1/chat/completions", json=chat())).status_code == 200
        assert total(await first.scrape(), "llmgw_gateway_requests_total") == 1
        assert total(await second.scrape(), "llmgw_gateway_requests_total") == 0
