"""LoRA routing logic without sockets: names, candidates, llama.cpp bodies, on-demand loads
(single flight, LRU eviction of idle adapters only, failures), and the worker mirror.

Engines are a fake :class:`EngineAdmin` that records every call and, when told to, holds
answers until the test lets them go, so concurrency is proven without sleeps.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import msgpack
import pytest
import trio
import trio.testing

from llmgw.router.adapters import (
    HOLDER_LOAD_SLACK,
    LOAD_PATH,
    MODELS_PATH,
    UNLOAD_PATH,
    Adapters,
    Target,
    engine_message,
)
from llmgw.router.auth import Tenant
from llmgw.router.errors import GatewayError
from llmgw.router.metrics import GatewayMetrics
from llmgw.router.replicas import LoadTracker, ModelInfo, Replica, ReplicaTable
from llmgw.router.workers.protocol import MirrorTable, encode_table

BASE = "base"
PATHS = (("a1", "/w/a1"), ("a2", "/w/a2"), ("a3", "/w/a3"))
EVERYONE = Tenant("t")
DEADLINE_S = 10


class FakeAdmin:
    """Answers the gateway's engine calls like vLLM, recording them; ``gate`` holds loads."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, Any]] = []  # (replica, method, path, payload)
        self.held: dict[str, set[str]] = {}  # what each replica holds, as the engine sees it
        self.gate: trio.Event | None = None
        self.models_gate: trio.Event | None = None  # holds /v1/models answers
        self.fail_load: tuple[int, bytes] | None = None
        self.arrived = trio.Event()

    def loads(self, replica: str | None = None) -> list[str]:
        return [p["lora_name"] for r, _, path, p in self.calls if path == LOAD_PATH and replica in (None, r)]

    def unloads(self) -> list[str]:
        return [p["lora_name"] for _, _, path, p in self.calls if path == UNLOAD_PATH]

    async def call(self, replica: Replica, method: str, path: str, payload: Mapping[str, Any] | None,
                   request_id: str) -> tuple[int, bytes]:
        self.calls.append((replica.id, method, path, payload))
        held = self.held.setdefault(replica.id, set())
        if path == MODELS_PATH:
            if self.models_gate is not None:
                await self.models_gate.wait()
            cards = [{"id": BASE, "parent": None}] + [{"id": n, "parent": BASE} for n in sorted(held)]
            return 200, json.dumps({"object": "list", "data": cards}).encode()
        assert payload is not None
        name = payload["lora_name"]
        if path == LOAD_PATH:
            self.arrived.set()
            if self.gate is not None:
                await self.gate.wait()
            if self.fail_load is not None:
                return self.fail_load
            if name in held:
                return 400, json.dumps({"error": {"message": f"The lora adapter '{name}' has already been loaded."}}).encode()
            held.add(name)
            return 200, f"Success: LoRA adapter '{name}' added successfully.".encode()
        if name not in held:
            return 404, b'{"error": {"message": "not found"}}'
        held.discard(name)
        return 200, b"Success"


def make(engine: str = "vllm", max_loaded: int = 2, replicas: int = 1, **kw: Any) -> tuple[Adapters, ReplicaTable, LoadTracker, FakeAdmin]:
    table = ReplicaTable()
    table.set_model_replicas(BASE, [Replica(f"r{i}", BASE, f"http://h{i}:1", "n", engine, PATHS) for i in range(replicas)])
    table.set_model_info(BASE, ModelInfo(engine, tuple(n for n, _ in PATHS), max_loaded))
    load = LoadTracker()
    admin = FakeAdmin()
    return Adapters(table, load, admin, metrics=GatewayMetrics(), **kw), table, load, admin


def replica(table: ReplicaTable, index: int = 0) -> Replica:
    return (table.replicas(BASE) or ())[index]


def adapter(name: str) -> Target:
    return Target(name, BASE, name)


def sample(adapters: Adapters, name: str, labels: dict[str, str]) -> float:
    assert adapters.metrics is not None
    return adapters.metrics.registry.get_sample_value(name, labels) or 0.0


# -- table and names -----------------------------------------------------------------------


def test_table_knows_adapters_only_while_their_model_is_in_the_catalog() -> None:
    table = ReplicaTable()
    table.set_model_info("m", ModelInfo("vllm", ("x", "y"), 1))
    assert table.parent_of("x") is None  # info alone does not put the model in the catalog
    table.set_model_replicas("m", [])
    assert (table.parent_of("x"), table.parent_of("y"), table.parent_of("m")) == ("m", "m", None)
    assert table.model_info("m").max_loaded_adapters == 1
    assert table.model_info("other") == ModelInfo()
    table.replace_all({"n": []})
    assert table.parent_of("x") is None and table.model_info("m") == ModelInfo()
    table.set_model_replicas("m", [])
    table.set_model_info("m", ModelInfo("vllm", ("x",)))
    table.remove_model("m")
    assert table.parent_of("x") is None and table.model_info("m") == ModelInfo()


def test_resolve_names_models_adapters_and_refuses_the_rest() -> None:
    adapters, _, _, _ = make()
    assert adapters.resolve(BASE) == Target(BASE, BASE, None)
    assert adapters.resolve("a2") == Target("a2", BASE, "a2")
    with pytest.raises(GatewayError) as caught:
        adapters.resolve("nope")
    assert caught.value.status == 404 and "The model or adapter 'nope' does not exist" in caught.value.message


def test_llamacpp_adapter_request_with_its_own_lora_field_is_refused() -> None:
    adapters, _, _, _ = make("llama.cpp", 0)
    with pytest.raises(GatewayError) as caught:
        adapters.resolve("a1", {"model": "a1", "lora": [{"id": 1, "scale": 1}]})
    assert caught.value.status == 400 and caught.value.param == "lora"


def test_serving_keeps_replicas_that_list_the_adapter() -> None:
    adapters, table, _, _ = make(replicas=2)
    bare = Replica("r9", BASE, "http://h9:1", "n", "vllm", PATHS[:1])
    table.set_model_replicas(BASE, [*(table.replicas(BASE) or ()), bare])
    assert [r.id for r in adapters.serving(adapter("a2"), table.replicas(BASE) or ())] == ["r0", "r1"]
    assert len(adapters.serving(Target(BASE, BASE), table.replicas(BASE) or ())) == 3
    with pytest.raises(GatewayError) as caught:
        adapters.serving(adapter("a2"), [bare])
    assert caught.value.status == 503 and "'a2'" in caught.value.message


# -- llama.cpp bodies ----------------------------------------------------------------------


def test_llamacpp_adapter_request_gets_the_lora_field_by_id() -> None:
    adapters, table, _, _ = make("llama.cpp", 0)
    body = json.dumps({"model": "a2", "prompt": "hi"}).encode()
    sent = json.loads(adapters.body_for(replica(table), adapter("a2"), body, EVERYONE))
    assert sent["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}, {"id": 2, "scale": 0.0}]
    assert sent["prompt"] == "hi" and sent["model"] == "a2"


def test_llamacpp_base_request_switches_every_adapter_off() -> None:
    # llama.cpp applies loaded adapters to a request without a lora field (measured on b11312)
    adapters, table, _, _ = make("llama.cpp", 0)
    body = b'{"model": "base", "prompt": "the word \\"lora\\" in text"}'
    sent = json.loads(adapters.body_for(replica(table), Target(BASE, BASE), body, EVERYONE))
    assert sent["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}, {"id": 2, "scale": 0.0}]
    assert sent["prompt"] == 'the word "lora" in text'


def test_llamacpp_replica_without_adapters_gets_the_body_byte_for_byte() -> None:
    adapters, table, _, _ = make("llama.cpp", 0)
    bare = Replica("r9", BASE, "http://r9", "n", "llama.cpp", ())
    body = b'{"model": "base", "prompt": "hi"}'
    assert adapters.body_for(bare, Target(BASE, BASE), body, EVERYONE) is body
    with pytest.raises(GatewayError) as caught:  # llama.cpp would ignore the unknown id silently
        adapters.body_for(bare, Target(BASE, BASE), b'{"model": "base", "lora": [{"id": 0}]}', EVERYONE)
    assert caught.value.status == 400


def test_llamacpp_client_lora_ids_are_validated() -> None:
    adapters, table, _, _ = make("llama.cpp", 0)
    base, r = Target(BASE, BASE), replica(table)
    good = json.dumps({"model": BASE, "lora": [{"id": 2, "scale": 0.5}]}).encode()
    assert json.loads(adapters.body_for(r, base, good, EVERYONE))["lora"] == [  # the others explicitly off
        {"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}, {"id": 2, "scale": 0.5}]
    for bad in ([{"id": 3, "scale": 1}], [{"id": -1}], [{"id": True}], [{"id": "0"}], {"id": 0}, [{"id": 0, "scale": "1"}],
                [{"id": 0, "scale": float("nan")}]):
        with pytest.raises(GatewayError) as caught:
            adapters.body_for(r, base, json.dumps({"model": BASE, "lora": bad}).encode(), EVERYONE)
        assert caught.value.status == 400, bad
    only_a1 = Tenant("t", frozenset({BASE, "a1"}))
    with pytest.raises(GatewayError) as forbidden:
        adapters.body_for(r, base, json.dumps({"model": BASE, "lora": [{"id": 1, "scale": 1}]}).encode(), only_a1)
    assert forbidden.value.status == 403 and "'a2'" in forbidden.value.message
    switched_off = json.dumps({"model": BASE, "lora": [{"id": 1, "scale": 0}]}).encode()
    assert json.loads(adapters.body_for(r, base, switched_off, only_a1))["lora"][1] == {"id": 1, "scale": 0.0}


def test_other_engines_get_the_body_byte_for_byte() -> None:
    adapters, table, _, _ = make("vllm", 2)
    body = b'{"model": "a1",  "lora": 7}'
    assert adapters.body_for(replica(table), adapter("a1"), body, EVERYONE) is body


# -- on-demand loads -----------------------------------------------------------------------


async def test_cold_adapter_is_loaded_once_for_twenty_concurrent_requests() -> None:
    adapters, table, _, admin = make()
    admin.gate = trio.Event()
    holds = []

    async def one() -> None:
        holds.append(await adapters.acquire(replica(table), adapter("a1"), "req"))

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(one)
            await admin.arrived.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert admin.loads() == ["a1"] and not holds  # everyone waits for the one load
            admin.gate.set()
    assert admin.loads() == ["a1"] and len(holds) == 20
    assert [c[2] for c in admin.calls] == [MODELS_PATH, LOAD_PATH]  # /v1/models read once
    assert sample(adapters, "llmgw_gateway_adapter_loads_total", {"adapter": "a1"}) == 1
    for hold in holds:
        hold.release()
        hold.release()  # idempotent
    assert adapters.loaded("r0") == ("a1",)


async def test_least_recently_used_idle_adapter_makes_room() -> None:
    adapters, table, _, admin = make(max_loaded=2)
    r = replica(table)
    for name in ("a1", "a2", "a1"):  # a1 used last: a2 is the least recently used
        (await adapters.acquire(r, adapter(name), "req")).release()
    hold = await adapters.acquire(r, adapter("a3"), "req")
    assert admin.unloads() == ["a2"] and admin.held["r0"] == {"a1", "a3"}
    assert set(adapters.loaded("r0")) == {"a1", "a3"}
    assert sample(adapters, "llmgw_gateway_adapter_unloads_total", {"adapter": "a2"}) == 1
    hold.release()


async def test_adapter_with_requests_in_flight_is_not_unloaded(autojump_clock: trio.testing.MockClock) -> None:
    adapters, table, _, admin = make(max_loaded=1)
    r = replica(table)
    busy = await adapters.acquire(r, adapter("a1"), "req")
    with pytest.raises(GatewayError) as caught:  # a1 stays busy past the slot wait
        await adapters.acquire(r, adapter("a2"), "req")
    assert caught.value.status == 503 and caught.value.code == "adapter_capacity"
    assert admin.unloads() == [] and admin.held["r0"] == {"a1"}

    got: list[Any] = []

    async def wait_for_a2() -> None:
        got.append(await adapters.acquire(r, adapter("a2"), "req"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_a2)
        await trio.testing.wait_all_tasks_blocked()
        assert not got and admin.unloads() == []  # still waiting: a1 is in use
        busy.release()
    assert admin.unloads() == ["a1"] and admin.held["r0"] == {"a2"} and len(got) == 1


async def test_failed_load_reaches_every_waiter_with_the_engines_words() -> None:
    adapters, table, _, admin = make()
    admin.gate = trio.Event()
    admin.fail_load = (404, b'{"error": {"message": "Loading lora a1 failed: No adapter found for /w/a1"}}')
    failures: list[GatewayError] = []

    async def one() -> None:
        with pytest.raises(GatewayError) as caught:
            await adapters.acquire(replica(table), adapter("a1"), "req")
        failures.append(caught.value)

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
            await admin.arrived.wait()
            await trio.testing.wait_all_tasks_blocked()
            admin.gate.set()
    assert len(failures) == 3 and admin.loads() == ["a1"]
    assert all(f.status == 503 and "No adapter found for /w/a1" in f.message for f in failures)
    assert adapters.loaded("r0") == ()
    assert sample(adapters, "llmgw_gateway_adapter_load_failures_total", {"adapter": "a1"}) == 1


async def test_already_loaded_answer_counts_as_loaded() -> None:
    adapters, table, _, admin = make()
    admin.held["r0"] = {"a1"}
    admin.calls.clear()
    adapters._replicas.clear()
    # the replica listed nothing when first read (loaded by someone else afterwards)
    real_call = admin.call

    async def hide_models(replica: Replica, method: str, path: str, payload: Any, request_id: str) -> tuple[int, bytes]:
        if path == MODELS_PATH:
            return 200, b'{"data": []}'
        return await real_call(replica, method, path, payload, request_id)

    admin.call = hide_models  # type: ignore[method-assign]
    hold = await adapters.acquire(replica(table), adapter("a1"), "req")
    assert admin.loads() == ["a1"] and adapters.loaded("r0") == ("a1",)  # a 400 "already loaded"
    hold.release()


async def test_adapters_loaded_before_the_gateway_started_are_learnt_from_v1_models() -> None:
    adapters, table, _, admin = make(max_loaded=2)
    admin.held["r0"] = {"a2", "a3"}
    hold = await adapters.acquire(replica(table), adapter("a2"), "req")
    assert admin.loads() == []  # already there
    (await adapters.acquire(replica(table), adapter("a1"), "req")).release()
    assert admin.unloads() == ["a3"]  # the full replica made room with the idle one
    hold.release()


def test_engine_404_forgets_the_adapter() -> None:
    adapters, table, _, _ = make()
    state = adapters._state(replica(table))
    state.loaded["a1"] = None
    adapters.engine_answered(replica(table), adapter("a1"), 200)
    assert adapters.loaded("r0") == ("a1",)
    adapters.engine_answered(replica(table), adapter("a1"), 404)
    assert adapters.loaded("r0") == ()


# -- placement preference ------------------------------------------------------------------


async def test_prefer_warm_unsaturated_replicas_then_spread_to_the_least_loaded() -> None:
    adapters, table, load, _ = make(replicas=3)
    everyone = list(table.replicas(BASE) or ())
    r0 = everyone[0]
    (await adapters.acquire(r0, adapter("a1"), "req")).release()
    assert adapters.prefer(adapter("a1"), everyone) == [r0]
    leases = [load.acquire("r0") for _ in range(HOLDER_LOAD_SLACK)]
    assert adapters.prefer(adapter("a1"), everyone) == [r0]  # at the slack: still sticky
    leases.append(load.acquire("r0"))
    leases.append(load.acquire("r2"))
    assert [r.id for r in adapters.prefer(adapter("a1"), everyone)] == ["r1"]  # saturated: least-loaded other
    for lease in leases:
        lease.release()
    assert adapters.prefer(Target(BASE, BASE), everyone) == everyone  # the base model is not narrowed


async def test_prefer_joins_a_load_in_progress() -> None:
    adapters, table, _, admin = make(replicas=2)
    admin.gate = trio.Event()
    everyone = list(table.replicas(BASE) or ())
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(adapters.acquire, everyone[1], adapter("a1"), "req")
            await admin.arrived.wait()
            assert adapters.prefer(adapter("a1"), everyone) == [everyone[1]]
            admin.gate.set()


def test_prefer_leaves_llamacpp_and_registered_adapters_alone() -> None:
    for engine, n in (("llama.cpp", 0), ("vllm", 0)):
        adapters, table, _, _ = make(engine, n, replicas=2)
        everyone = list(table.replicas(BASE) or ())
        assert adapters.prefer(adapter("a1"), everyone) == everyone


# -- helpers and the worker mirror ---------------------------------------------------------


def test_engine_message_reads_openai_fastapi_and_plain_errors() -> None:
    assert engine_message(b'{"error": {"message": "bad path"}}') == "bad path"
    assert engine_message(b'{"detail": "nope"}') == "nope"
    assert engine_message(b"plain words") == "plain words"
    assert engine_message(b"x" * 1000).endswith("...")


def test_worker_mirror_carries_each_engines_secret() -> None:
    table = ReplicaTable()
    table.set_model_replicas("m", [Replica("r1", "m", "http://h:1", "n", "sim", (), "s3cret"), Replica("r2", "m", "http://h:2")])
    mirror = MirrorTable()
    mirror.load_state(msgpack.unpackb(msgpack.packb(encode_table(table))))
    assert [r.api_key for r in mirror.replicas("m")] == ["s3cret", ""]


def test_worker_mirror_carries_engines_and_adapters() -> None:
    _, table, _, _ = make("llama.cpp", 0, replicas=2)
    table.set_model_replicas("other", [])
    wire = msgpack.unpackb(msgpack.packb(encode_table(table)))
    mirror = MirrorTable()
    mirror.load_state(wire)
    assert mirror.replicas(BASE) == table.replicas(BASE)
    assert mirror.model_info(BASE) == table.model_info(BASE)
    assert mirror.parent_of("a3") == BASE and mirror.model_info("other") == ModelInfo()
    assert [m.created for m in mirror.models()] == [m.created for m in table.models()]


async def test_concurrent_cold_requests_agree_on_one_replica() -> None:
    adapters, table, load, admin = make(replicas=3)
    admin.models_gate = trio.Event()  # the first request is still reading /v1/models
    everyone = list(table.replicas(BASE) or ())
    first, second = adapters.prefer(adapter("a1"), everyone), adapters.prefer(adapter("a1"), everyone)
    assert first == second and len(first) == 1  # before either claims it: the same pick
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            lease = load.acquire(first[0].id)
            nursery.start_soon(adapters.acquire, first[0], adapter("a1"), "req")
            await trio.testing.wait_all_tasks_blocked()
            assert adapters.prefer(adapter("a1"), everyone) == first  # claimed: join it, though busier
            admin.models_gate.set()
    lease.release()
    assert admin.loads() == ["a1"]
