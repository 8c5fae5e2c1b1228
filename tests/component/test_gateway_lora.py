"""LoRA adapters through the gateway, end to end on real sockets.

The replicas are the simulated vLLM engine (``llmgw.sim`` in-process on 127.0.0.1, with
``--enable-lora --any-lora-path``): its runtime LoRA API answers like vLLM's, and its
``loras`` show what it really holds, so each test checks the engine's state, not only the
gateway's belief. llama.cpp's per-request ``lora`` field is checked with a recording fake
engine. Every wait is bounded; nothing sleeps to synchronise.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import attrs
import httpx
import trio

from llmgw.catalog import generate_key
from llmgw.router import (
    LeastOutstanding, LoadTracker, Replica, ReplicaTable, RequestInfo, create_app, gateway_of, serve_gateway,
)
from llmgw.router.app import Gateway
from llmgw.router.auth import AuthTable, KeyEntry, Tenant
from llmgw.router.replicas import ModelInfo
from llmgw.sim import SimConfig, serve
from llmgw.sim.engine import Engine
from tests.component.upstream_fixture import FakeUpstream

BASE = "lora-base"
ADAPTERS = (("a1", "/adapters/a1"), ("a2", "/adapters/a2"), ("a3", "/adapters/a3"))
DEADLINE_S = 20  # every wait; a hang is a failure, not a stuck suite


@attrs.define
class Env:
    client: httpx.AsyncClient
    gateway: Gateway
    engines: list[Engine]
    load: LoadTracker

    def loads(self, adapter: str) -> float:
        return self.gateway.metrics.registry.get_sample_value(
            "llmgw_gateway_adapter_loads_total", {"adapter": adapter}) or 0.0

    def unloads(self, adapter: str) -> float:
        return self.gateway.metrics.registry.get_sample_value(
            "llmgw_gateway_adapter_unloads_total", {"adapter": adapter}) or 0.0

    def held(self, index: int = 0) -> set[str]:
        """What the engine itself holds (not what the gateway believes)."""
        return set(self.engines[index].loras)


@asynccontextmanager
async def lora_gateway(
    *, replicas: int = 1, max_loaded: int = 2, auth: AuthTable | None = None, **sim: Any
) -> AsyncIterator[Env]:
    """Sim replicas of BASE with runtime LoRA, the gateway over them; yield the Env; stop all."""
    async with trio.open_nursery() as nursery:
        engines, rows = [], []
        for i in range(replicas):
            cfg = SimConfig(model=BASE, port=0, enable_lora=True, max_loras=max(max_loaded, 1),
                            lora_path_must_exist=False, **sim)
            engine, port = await nursery.start(serve, cfg)
            engines.append(engine)
            rows.append(Replica(f"s{i}", BASE, f"http://127.0.0.1:{port}", "node-1", "sim", ADAPTERS))
        table = ReplicaTable()
        table.set_model_replicas(BASE, rows)
        table.set_model_info(BASE, ModelInfo("sim", tuple(n for n, _ in ADAPTERS), max_loaded))
        load = LoadTracker()
        app = create_app(table, load=load, auth=auth)
        port = await nursery.start(serve_gateway, app, "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as client:
            yield Env(client, gateway_of(app), engines, load)
        with trio.fail_after(DEADLINE_S):
            await load.wait_until(lambda tracker: tracker.total() == 0)
        nursery.cancel_scope.cancel()


class SeeingPolicy(LeastOutstanding):
    """Least-outstanding, remembering what each request told the policy."""

    def __init__(self, load: LoadTracker) -> None:
        super().__init__(load)
        self.seen: list[tuple[str, str | None]] = []

    def choose(self, candidates: Any, request: RequestInfo) -> Replica:
        self.seen.append((request.model, request.adapter))
        return super().choose(candidates, request)


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, **extra}


async def ask(env: Env, model: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return await env.client.post("/v1/chat/completions", json=chat(model), headers=headers)


async def burst(env: Env, model: str, count: int) -> list[httpx.Response]:
    answers: list[httpx.Response] = []

    async def one() -> None:
        answers.append(await ask(env, model))

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
    assert [r.status_code for r in answers] == [200] * count, [r.text for r in answers if r.status_code != 200]
    assert all(r.json()["model"] == model for r in answers)
    return answers


async def test_first_use_loads_once_for_twenty_concurrent_requests() -> None:
    async with lora_gateway(replicas=1) as env:
        await burst(env, "a1", 20)
        assert env.loads("a1") == 1 and env.held() == {"a1"}


async def test_a_burst_over_two_replicas_loads_at_most_once_per_replica() -> None:
    async with lora_gateway(replicas=2) as env:
        await burst(env, "a2", 20)
        holders = [i for i in range(2) if "a2" in env.held(i)]
        # A second replica loads it only when the first is saturated; never twice on one
        # (a repeated load would be counted too: vLLM answers it "already loaded").
        assert holders and env.loads("a2") == len(holders)


async def test_least_recently_used_idle_adapter_is_unloaded_under_pressure() -> None:
    async with lora_gateway(max_loaded=2) as env:
        for name in ("a1", "a2", "a1"):  # a2 becomes the least recently used
            assert (await ask(env, name)).status_code == 200
        assert env.held() == {"a1", "a2"}
        response = await ask(env, "a3")
        assert response.status_code == 200 and response.json()["model"] == "a3"
        assert env.held() == {"a1", "a3"}
        assert (env.unloads("a2"), env.unloads("a1")) == (1, 0)
        assert (await ask(env, "a2")).status_code == 200  # back again, in place of a1 (now LRU)
        assert env.held() == {"a2", "a3"}


async def test_adapter_with_a_request_in_flight_is_not_unloaded() -> None:
    # 20 ms per generated token and 500 tokens: the first stream lasts until the test closes it.
    async with lora_gateway(max_loaded=1, decode_us_per_token=20_000) as env:
        slow = chat("a1", max_tokens=500, stream=True)
        async with env.client.stream("POST", "/v1/chat/completions", json=slow) as stream:
            assert stream.status_code == 200
            chunks = stream.aiter_raw()
            assert await chunks.__anext__()  # a1 is loaded and generating
            async with trio.open_nursery() as nursery:
                second: list[httpx.Response] = []

                async def want_a2() -> None:
                    second.append(await ask(env, "a2"))

                nursery.start_soon(want_a2)
                with trio.fail_after(DEADLINE_S):  # the a2 request is routed and waits for a slot
                    await env.load.wait_until(lambda tracker: tracker.outstanding("s0") == 2)
                assert env.held() == {"a1"} and not second and env.unloads("a1") == 0
                await stream.aclose()  # a1's request ends: now a1 is idle and may go
        assert second[0].status_code == 200 and second[0].json()["model"] == "a2"
        assert env.held() == {"a2"} and env.unloads("a1") == 1


async def test_unknown_adapter_is_a_clear_404() -> None:
    async with lora_gateway() as env:
        response = await ask(env, "a9")
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "model_not_found"
        assert "The model or adapter 'a9' does not exist" in error["message"]
        assert (await env.client.get("/v1/models/a9")).status_code == 404
        assert env.held() == set()


async def test_a_failed_load_is_503_with_the_engines_words() -> None:
    async with lora_gateway(max_loaded=1) as env:
        env.engines[0].cfg = attrs.evolve(env.engines[0].cfg, lora_path_must_exist=True)
        response = await ask(env, "a1")
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "adapter_load_failed" and "No adapter found for /adapters/a1" in error["message"]
        assert env.gateway.metrics.registry.get_sample_value(
            "llmgw_gateway_adapter_load_failures_total", {"adapter": "a1"}) == 1


async def test_models_lists_adapters_with_their_parent() -> None:
    async with lora_gateway() as env:
        listed = (await env.client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [
            (BASE, None), ("a1", BASE), ("a2", BASE), ("a3", BASE)]
        assert all(m["root"] == m["id"] and m["object"] == "model" for m in listed)
        one = (await env.client.get("/v1/models/a2")).json()
        assert (one["id"], one["parent"]) == ("a2", BASE)


async def test_a_key_may_use_one_adapter_and_not_another() -> None:
    new = generate_key()
    tenant = Tenant("narrow", models=frozenset({BASE, "a1"}))
    auth = AuthTable(keys=[KeyEntry(new.key_id, bytes.fromhex(new.secret_hash), tenant)])
    headers = {"authorization": f"Bearer {new.key}"}
    async with lora_gateway(auth=auth) as env:
        assert (await ask(env, "a1", headers)).status_code == 200
        refused = await ask(env, "a2", headers)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
        assert env.held() == {"a1"}  # nothing was loaded for the refused request
        listed = (await env.client.get("/v1/models", headers=headers)).json()["data"]
        assert [m["id"] for m in listed] == [BASE, "a1"]
        assert (await env.client.get("/v1/models/a2", headers=headers)).status_code == 404


async def test_llamacpp_adapter_request_reaches_the_engine_with_the_lora_field() -> None:
    async with trio.open_nursery() as nursery:
        engine = FakeUpstream("llama")
        await nursery.start(engine.serve)
        table = ReplicaTable()
        paths = (("a1", "/g/a1.gguf"), ("a2", "/g/a2.gguf"))
        table.set_model_replicas(BASE, [Replica("l0", BASE, engine.endpoint, "node-1", "llama.cpp", paths)])
        table.set_model_info(BASE, ModelInfo("llama.cpp", ("a1", "a2"), 0))
        load = LoadTracker()
        policy = SeeingPolicy(load)
        port = await nursery.start(serve_gateway, create_app(table, load=load, policy=policy), "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as client:
            ok = await client.post("/v1/chat/completions", json=chat("a2"))
            assert ok.status_code == 200
            sent = engine.requests[-1].json()
            assert sent["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]
            assert sent["messages"] == chat("a2")["messages"]
            base = await client.post("/v1/chat/completions", json=chat(BASE))
            assert base.status_code == 200  # every adapter explicitly off: llama.cpp applies them otherwise
            assert engine.requests[-1].json()["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
            count = len(engine.requests)
            unknown_id = await client.post("/v1/chat/completions", json=chat(BASE, lora=[{"id": 2, "scale": 1.0}]))
            both = await client.post("/v1/chat/completions", json=chat("a1", lora=[{"id": 0, "scale": 1.0}]))
            assert (unknown_id.status_code, both.status_code) == (400, 400)
            assert json.loads(unknown_id.text)["error"]["param"] == "lora"
            assert len(engine.requests) == count  # neither reached the engine
            # the policy is told the adapter; the lora ids are checked against the chosen replica
            assert policy.seen == [("a2", "a2"), (BASE, None), (BASE, None)]
        nursery.cancel_scope.cancel()
