"""The gateway end to end: Hypercorn on a real port, fake engines on real ports, real HTTP clients."""

from __future__ import annotations

import json
import socket
from contextlib import aclosing, asynccontextmanager
from typing import AsyncIterator, Iterator, Sequence

import attrs
import httpx
import openai
import pytest
import trio

from llmgw.router import (
    LeastOutstanding,
    LoadTracker,
    Replica,
    ReplicaTable,
    RequestInfo,
    RoutingPolicy,
    create_app,
    gateway_of,
    serve_gateway,
)
from tests.component.upstream_fixture import (  # noqa: F401 (fixture)
    CHUNK_TOKENS, FakeUpstream, expected_stream_text, refused_endpoint,
)

MODEL = "tiny-chat"
DEADLINE_S = 10  # every wait in these tests; a hang is a failure, not a stuck suite


@attrs.define
class Env:
    url: str
    client: httpx.AsyncClient
    table: ReplicaTable
    load: LoadTracker
    upstreams: list[FakeUpstream]
    app: object

    async def wait_idle(self) -> None:
        """Return once no request is counted in flight on any replica."""
        with trio.fail_after(DEADLINE_S):
            await self.load.wait_until(lambda load: load.total() == 0)


class RecordingPolicy(RoutingPolicy):
    """Least-outstanding, remembering which replica it picked and among which candidates."""

    def __init__(self, load: LoadTracker) -> None:
        self.inner = LeastOutstanding(load)
        self.calls: list[tuple[tuple[str, ...], str]] = []

    def choose(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica:
        chosen = self.inner.choose(candidates, request)
        self.calls.append((tuple(r.id for r in candidates), chosen.id))
        return chosen


@asynccontextmanager
async def gateway(
    replicas: int = 2, *, extra: Sequence[Replica] = (), policy_factory=None
) -> AsyncIterator[Env]:
    """Run ``replicas`` fake engines for MODEL plus the gateway; yield an Env; stop all."""
    async with trio.open_nursery() as nursery:
        upstreams = [FakeUpstream(f"r{i}") for i in range(replicas)]
        for upstream in upstreams:
            await nursery.start(upstream.serve)
        table = ReplicaTable()
        table.set_model_replicas(
            MODEL, [Replica(u.name, MODEL, u.endpoint, "node-1") for u in upstreams] + list(extra)
        )
        load = LoadTracker()
        policy = policy_factory(load) if policy_factory else None
        app = create_app(table, load=load, policy=policy)
        port = await nursery.start(serve_gateway, app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S) as client:
            yield Env(url, client, table, load, upstreams, app)
        nursery.cancel_scope.cancel()


def chat_body(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


# -- pass-through -------------------------------------------------------------------------


async def test_non_streaming_passes_body_and_request_id_through() -> None:
    async with gateway(replicas=1) as env:
        raw = b'{ "messages":[{"role":"user","content":"h\\u00e9"}],  "model" : "tiny-chat" , "x":1}'
        response = await env.client.post(
            "/v1/chat/completions",
            content=raw,
            headers={
                "content-type": "application/json",
                "x-request-id": "req-42",
                "authorization": "Bearer gateway-key",
            },
        )
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        assert response.headers["x-request-id"] == "req-42"
        assert response.json()["choices"][0]["message"]["content"] == "hello from r0"
        (got,) = env.upstreams[0].requests
        assert got.path == "/v1/chat/completions"
        assert got.body == raw
        assert got.headers["x-request-id"] == "req-42"
        assert got.headers["content-type"] == "application/json"
        assert "authorization" not in got.headers

        generated = await env.client.post("/v1/chat/completions", json=chat_body())
        request_id = generated.headers["x-request-id"]
        assert request_id and request_id != "req-42"
        assert env.upstreams[0].requests[-1].headers["x-request-id"] == request_id
        await env.wait_idle()


async def test_endpoints_quart_serves_follow_the_same_request_id_rule() -> None:
    async with gateway(replicas=1) as env:
        for path, status in (("/healthz", 200), ("/v1/models", 200), ("/v1/nothing", 404)):
            kept = await env.client.get(path, headers={"x-request-id": "req-7"})
            assert (kept.status_code, kept.headers["x-request-id"]) == (status, "req-7")
            fresh = await env.client.get(path, headers={"x-request-id": "not an id"})
            assert fresh.status_code == status
            assert len(fresh.headers["x-request-id"]) == 32 and fresh.headers["x-request-id"] != "not an id"


async def test_completions_embeddings_and_upstream_status_pass_through() -> None:
    async with gateway(replicas=1) as env:
        completion = await env.client.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert completion.json()["choices"][0]["text"] == "hello from r0"
        embedding = await env.client.post("/v1/embeddings", json={"model": MODEL, "input": "a"})
        assert embedding.json()["data"][0]["embedding"] == [0.25, -0.5, 1.0]
        failed = await env.client.post("/v1/chat/completions", json=chat_body(upstream_status=422))
        assert failed.status_code == 422
        assert failed.json()["error"]["message"] == "asked to fail"
        assert [r.path for r in env.upstreams[0].requests] == [
            "/v1/completions",
            "/v1/embeddings",
            "/v1/chat/completions",
        ]
        await env.wait_idle()


async def test_stream_is_relayed_chunk_by_chunk_without_buffering() -> None:
    async with gateway(replicas=1) as env:
        upstream = env.upstreams[0]
        upstream.gated = True
        with trio.fail_after(DEADLINE_S):
            async with env.client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                assert resp.headers["x-request-id"]
                chunks = resp.aiter_raw()
                first = b""
                while b"\n\n" not in first:
                    first += await chunks.__anext__()
                # The engine is blocked before its second chunk: what we hold came through alone.
                assert upstream.chunks_sent == 1
                assert first.count(b"data: ") == 1
                assert json.loads(first[len(b"data: ") :])["choices"][0]["delta"]["content"] == "Hel"
                assert env.load.snapshot() == {"r0": 1}
                for _ in range(3):
                    upstream.allow_chunk()
                rest = b"".join([chunk async for chunk in chunks])
        events = [line[len("data: ") :] for line in (first + rest).decode().split("\n\n") if line]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1])
        assert text == expected_stream_text()
        await env.wait_idle()


async def test_a_stream_head_goes_to_the_client_while_the_engine_prefills() -> None:
    """The gateway holds a stream's head back to send it with the first event only when that
    event came with the engine's head: one that is not there yet (a long prefill) does not
    keep the client waiting for the head. A raw keep-alive request sent in one write, which
    the server's fast lane serves (httpx writes head and body apart)."""
    async with gateway(replicas=1) as env:
        upstream = env.upstreams[0]
        upstream.first_chunk_gate = first_chunk = trio.Event()
        body = json.dumps(chat_body(stream=True)).encode()
        port = int(env.url.rsplit(":", 1)[1])
        with trio.fail_after(DEADLINE_S):
            client = await trio.open_tcp_stream("127.0.0.1", port)
            async with client:
                await client.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                                      b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                received = b""
                while b"\r\n\r\n" not in received:  # the head, while the engine holds its first chunk
                    received += await client.receive_some(65536)
                head, _, received = received.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in head
                assert upstream.chunks_sent == 0
                first_chunk.set()
                while not received.endswith(b"0\r\n\r\n"):
                    received += await client.receive_some(65536)
        assert b"data: [DONE]" in received and upstream.chunks_sent == len(CHUNK_TOKENS)
        await env.wait_idle()


async def test_an_event_stream_the_client_did_not_ask_for_is_relayed_as_it_came() -> None:
    async with gateway(replicas=1) as env:
        env.upstreams[0].always_stream = True
        with trio.fail_after(DEADLINE_S):
            response = await env.client.post("/v1/chat/completions", json=chat_body())
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]) == expected_stream_text()
        assert "stream_options" not in env.upstreams[0].requests[-1].json()  # not a stream it asked for
        await env.wait_idle()


# -- spreading -------------------------------------------------------------------------------


async def test_idle_replicas_take_turns() -> None:
    async with gateway(replicas=2) as env:
        served = []
        for _ in range(6):
            response = await env.client.post("/v1/chat/completions", json=chat_body())
            served.append(response.json()["system_fingerprint"])
        assert served in (["r0", "r1"] * 3, ["r1", "r0"] * 3)
        await env.wait_idle()


async def test_busy_replica_is_avoided_until_it_finishes() -> None:
    async with gateway(replicas=2) as env:
        hold = trio.Event()
        for upstream in env.upstreams:
            upstream.hold = hold
        results: list[str] = []

        async def slow_request() -> None:
            response = await env.client.post("/v1/chat/completions", json=chat_body())
            results.append(response.json()["system_fingerprint"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_request)
            with trio.fail_after(DEADLINE_S):
                await env.load.wait_until(lambda load: load.total() == 1)
            (busy_id,) = env.load.snapshot()
            busy, free = sorted(env.upstreams, key=lambda u: u.name != busy_id)
            free.hold = None
            for _ in range(4):
                response = await env.client.post("/v1/chat/completions", json=chat_body())
                assert response.json()["system_fingerprint"] == free.name
            assert env.load.snapshot() == {busy.name: 1}
            hold.set()
        assert results == [busy.name]
        await env.wait_idle()


# -- errors --------------------------------------------------------------------------------


async def test_unknown_model_is_404_naming_it() -> None:
    async with gateway(replicas=1) as env:
        response = await env.client.post("/v1/chat/completions", json={**chat_body(), "model": "gpt-9"})
        error = assert_openai_error(response, 404, "model_not_found")
        assert "gpt-9" in error["message"] and "GET /v1/models" in error["message"]
        assert error["param"] == "model"
        assert response.headers["x-request-id"]
        assert env.upstreams[0].requests == []


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[1, 2]", b'{"messages": []}', b'{"model": 7}', b'{"model": ""}', b"\xff\xfe"],
)
async def test_unroutable_bodies_are_400(content: bytes) -> None:
    async with gateway(replicas=1) as env:
        response = await env.client.post(
            "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        )
        error = assert_openai_error(response, 400)
        assert error["type"] == "invalid_request_error"
        assert env.upstreams[0].requests == []


async def test_model_without_ready_replica_is_503_with_retry_after() -> None:
    async with gateway(replicas=1) as env:
        env.table.set_model_replicas("warming", [])
        response = await env.client.post("/v1/chat/completions", json={**chat_body(), "model": "warming"})
        assert_openai_error(response, 503, "no_ready_replica")
        assert int(response.headers["retry-after"]) > 0


async def test_refused_connection_is_retried_on_another_replica(refused_endpoint: str) -> None:
    dead = Replica("dead", MODEL, refused_endpoint, "node-2")
    async with gateway(replicas=1, extra=[dead], policy_factory=RecordingPolicy) as env:
        for _ in range(4):
            response = await env.client.post("/v1/chat/completions", json=chat_body())
            assert response.status_code == 200
            assert response.json()["system_fingerprint"] == "r0"
        policy = gateway_of(env.app).policy
        assert isinstance(policy, RecordingPolicy)
        # At least one request picked the dead replica first and was retried on the live one.
        retried = [i for i, call in enumerate(policy.calls) if call[1] == "dead"]
        assert retried
        assert all(policy.calls[i + 1] == (("r0",), "r0") for i in retried)
        assert len(env.upstreams[0].requests) == 4
        await env.wait_idle()


async def test_all_replicas_refusing_is_503(refused_endpoint: str) -> None:
    async with gateway(replicas=0, extra=[Replica("dead", MODEL, refused_endpoint)]) as env:
        response = await env.client.post("/v1/chat/completions", json=chat_body())
        assert_openai_error(response, 503, "replica_unreachable")
        assert response.headers["retry-after"]
        await env.wait_idle()


async def test_routing_errors_and_bugs_are_openai_json() -> None:
    class BrokenPolicy(RoutingPolicy):
        def choose(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica:
            raise RuntimeError("policy bug")

    async with gateway(replicas=1, policy_factory=lambda load: BrokenPolicy()) as env:
        assert_openai_error(await env.client.get("/v1/nothing"), 404)
        assert_openai_error(await env.client.get("/v1/chat/completions"), 405)
        error = assert_openai_error(await env.client.post("/v1/chat/completions", json=chat_body()), 500)
        assert error["code"] == "internal_error"
        env.app.config["MAX_CONTENT_LENGTH"] = 64
        too_big = await env.client.post("/v1/chat/completions", json=chat_body(padding="x" * 100))
        assert_openai_error(too_big, 413)
        assert too_big.headers["x-request-id"]
        healthz = await env.client.get("/healthz")
        assert healthz.status_code == 200 and healthz.json() == {"status": "ok"}


# -- streams that end early -------------------------------------------------------------------


async def test_client_disconnect_cancels_the_upstream_request() -> None:
    async with gateway(replicas=1) as env:
        upstream = env.upstreams[0]
        upstream.gated = True
        with trio.fail_after(DEADLINE_S):
            async with env.client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as resp:
                first = b""
                async with aclosing(resp.aiter_raw()) as chunks:
                    async for chunk in chunks:
                        first += chunk
                        if b"\n\n" in first:
                            break
                assert env.load.total() == 1
            # Leaving the block closes our connection mid-stream.
            await upstream.wait_for(lambda u: u.disconnected.is_set())
        assert upstream.chunks_sent == 1
        await env.wait_idle()


async def test_broken_upstream_stream_ends_with_error_event_and_releases_load() -> None:
    async with gateway(replicas=1) as env:
        env.upstreams[0].break_stream_after = 1
        response = await env.client.post("/v1/chat/completions", json=chat_body(stream=True))
        assert response.status_code == 200
        events = [e for e in response.text.split("\n\n") if e]
        assert len(events) == 2
        assert json.loads(events[0][len("data: ") :])["choices"][0]["delta"]["content"] == "Hel"
        error = json.loads(events[1][len("data: ") :])["error"]
        assert error["code"] == "upstream_failed"
        await env.wait_idle()


# -- models and the openai client -------------------------------------------------------------


async def test_models_lists_the_catalog() -> None:
    async with gateway(replicas=1) as env:
        env.table.set_model_replicas("org/other-model", [])
        listing = (await env.client.get("/v1/models")).json()
        assert listing["object"] == "list"
        assert [m["id"] for m in listing["data"]] == ["org/other-model", MODEL]
        for entry in listing["data"]:
            assert entry["object"] == "model" and entry["owned_by"] == "llmgw"
            assert isinstance(entry["created"], int)
        one = (await env.client.get("/v1/models/org/other-model")).json()
        assert one["id"] == "org/other-model"
        assert_openai_error(await env.client.get("/v1/models/absent"), 404, "model_not_found")


async def test_openai_client_against_the_gateway() -> None:
    async with gateway(replicas=2) as env:
        client = openai.AsyncOpenAI(base_url=env.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
        try:
            chat = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
            assert chat.choices[0].message.content in ("hello from r0", "hello from r1")

            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
            assert text == expected_stream_text()

            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
            assert (await client.models.retrieve(MODEL)).owned_by == "llmgw"

            with pytest.raises(openai.NotFoundError) as not_found:
                await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
            assert not_found.value.code == "model_not_found"
        finally:
            await client.close()
        await env.wait_idle()


# -- serving -----------------------------------------------------------------------------------


async def test_serve_gateway_reports_port_and_shuts_down_cleanly() -> None:
    table = ReplicaTable()
    app = create_app(table)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_gateway, app, "127.0.0.1", 0)
        assert port > 0
        assert gateway_of(app).upstream is not None  # startup hooks ran before started()
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            assert (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
        nursery.cancel_scope.cancel()
    assert gateway_of(app).upstream is None  # shutdown hooks closed the upstream client
    with trio.socket.socket() as probe, pytest.raises(OSError):
        await probe.connect(("127.0.0.1", port))


async def test_serve_gateway_refuses_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        async with trio.open_nursery() as nursery:
            with pytest.raises(OSError), trio.fail_after(DEADLINE_S):
                await nursery.start(serve_gateway, create_app(ReplicaTable()), "127.0.0.1", taken.getsockname()[1])
