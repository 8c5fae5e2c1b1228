"""The gateway's front door with real sockets: API keys, tenants' models, every error status,
``serving.stopped``, usage accounting (streaming too), and the ``openai`` client with a key."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import attrs
import h11
import httpx
import openai
import pytest
import trio

from llmgw.catalog import generate_key
from llmgw.router import LoadTracker, Replica, ReplicaTable, create_app, gateway_of, serve_gateway
from llmgw.router.admission import Admission, AdmissionLimits
from llmgw.router.app import Gateway
from llmgw.router.auth import AuthTable, KeyEntry, Tenant
from llmgw.router.errors import MAX_ECHO_CHARS
from llmgw.router.usage import Usage, UsageMeter
from tests.component.test_hypercorn_patch import read_response
from tests.component.upstream_fixture import FakeUpstream, ReceivedRequest, expected_stream_text

MODEL = "tiny-chat"
OTHER = "other-model"
DEADLINE_S = 10

#: What UsageUpstream reports for every stream it is asked to count.
STREAM_USAGE = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}


class UsageUpstream(FakeUpstream):
    """A FakeUpstream that honours ``stream_options.include_usage`` like vLLM: one last
    chunk with ``"choices": []`` and the usage, just before ``[DONE]``."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._include_usage: dict[int, bool] = {}

    async def _respond(self, stream: Any, conn: h11.Connection, got: ReceivedRequest) -> bool:
        try:
            options = got.json().get("stream_options") or {}
        except (ValueError, AttributeError):
            options = {}
        self._include_usage[id(conn)] = isinstance(options, dict) and options.get("include_usage") is True
        try:
            return await super()._respond(stream, conn, got)
        finally:
            self._include_usage.pop(id(conn), None)

    async def _send(self, stream: Any, conn: h11.Connection, event: Any) -> None:
        if (isinstance(event, h11.Data) and event.data == b"data: [DONE]\n\n"
                and self._include_usage.get(id(conn))):
            chunk = {"id": "u", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                     "choices": [], "usage": STREAM_USAGE}
            await super()._send(stream, conn, h11.Data(data=b"data: " + json.dumps(chunk).encode() + b"\n\n"))
        await super()._send(stream, conn, event)


@attrs.define
class Env:
    url: str
    client: httpx.AsyncClient
    table: ReplicaTable
    load: LoadTracker
    upstream: UsageUpstream
    gateway: Gateway
    auth: AuthTable
    keys: dict[str, str]  # tenant name -> key

    def headers(self, tenant: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[tenant]}"}

    async def wait_idle(self) -> None:
        with trio.fail_after(DEADLINE_S):
            await self.load.wait_until(lambda load: load.total() == 0)


def make_keys(tenants: list[Tenant]) -> tuple[list[KeyEntry], dict[str, str]]:
    """One key per tenant: the table entries and the keys as a client sends them."""
    entries, keys = [], {}
    for tenant in tenants:
        new = generate_key()
        entries.append(KeyEntry(new.key_id, bytes.fromhex(new.secret_hash), tenant))
        keys[tenant.name] = new.key
    return entries, keys


DEFAULT_TENANTS = [
    Tenant("acme"),
    Tenant("narrow", models=frozenset({OTHER})),
    Tenant("pair", max_concurrency=2),
    Tenant("slow", rpm=2),
]


@asynccontextmanager
async def gateway(
    *, tenants: list[Tenant] = DEFAULT_TENANTS, enabled: bool = True,
    limits: AdmissionLimits = AdmissionLimits(), max_request_bytes: int = 4096,
) -> AsyncIterator[Env]:
    """One UsageUpstream for MODEL (and OTHER) plus the gateway with keys for ``tenants``."""
    async with trio.open_nursery() as nursery:
        upstream = UsageUpstream("r0")
        await nursery.start(upstream.serve)
        table = ReplicaTable()
        table.set_model_replicas(MODEL, [Replica("r0", MODEL, upstream.endpoint, "node-1")])
        table.set_model_replicas(OTHER, [Replica("o0", OTHER, upstream.endpoint, "node-1")])
        entries, keys = make_keys(tenants)
        auth = AuthTable(enabled=enabled, keys=entries)
        load = LoadTracker()
        app = create_app(table, load=load, auth=auth, admission=Admission(limits),
                         max_request_bytes=max_request_bytes)
        port = await nursery.start(serve_gateway, app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S) as client:
            yield Env(url, client, table, load, upstream, gateway_of(app), auth, keys)
        nursery.cancel_scope.cancel()


def chat_body(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if status in (429, 503):
        assert int(response.headers["retry-after"]) >= 1
    return error


# -- keys ------------------------------------------------------------------------------------


async def test_a_key_is_required_and_checked() -> None:
    async with gateway() as env:
        missing = await env.client.post("/v1/chat/completions", json=chat_body())
        error = assert_error(missing, 401, "invalid_api_key")
        assert "ctl keys create" in error["message"]
        assert missing.headers["www-authenticate"].startswith("Bearer")
        good = env.keys["acme"]
        wrong_secret = good[: good.rindex("_") + 1] + "A" * 43
        for bad in (f"Bearer {wrong_secret}", "Bearer sk-not-ours", "Basic dXNlcjpwdw==", f"Bearer {good}x",
                    f"Bearer {good.replace('llmgw_', 'llmgw_00')}"):
            refused = await env.client.post("/v1/chat/completions", json=chat_body(), headers={"authorization": bad})
            assert_error(refused, 401, "invalid_api_key")
        assert_error(await env.client.get("/v1/models"), 401, "invalid_api_key")
        assert env.upstream.requests == []

        ok = await env.client.post("/v1/chat/completions", json=chat_body(), headers=env.headers("acme"))
        assert ok.status_code == 200, ok.text
        assert "authorization" not in env.upstream.requests[-1].headers  # gateway keys stay here

        # Revoking = the control plane replacing the table without the key.
        env.auth.replace([])
        revoked = await env.client.post("/v1/chat/completions", json=chat_body(), headers=env.headers("acme"))
        assert_error(revoked, 401, "invalid_api_key")
        await env.wait_idle()


async def test_a_request_refused_before_its_body_arrived_says_the_connection_closes() -> None:
    # A client's head and body can arrive in two reads (httpx writes them separately). Refused
    # at the head (no key), the body is never read, so the connection cannot carry the next
    # request: the answer must say so, or the client sends into a connection about to close
    # and gets no answer at all (seen in CI: "Server disconnected without sending a response").
    body = json.dumps(chat_body()).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body))
    async with gateway() as env:
        port = int(env.url.rsplit(":", 1)[1])
        with trio.fail_after(DEADLINE_S):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(head)  # the head alone: the gateway answers it at once
                buffer = bytearray()
                answer, error = await read_response(stream, buffer)
                assert answer.startswith(b"HTTP/1.1 401 ") and json.loads(error)["error"]["code"] == "invalid_api_key"
                assert b"\r\nconnection: close" in answer.lower(), answer
                await stream.send_all(body)
                assert buffer == b"" and await stream.receive_some() == b""  # closed, as it said
            # Whole in one write (the fast lane has the body): the same refusal keeps the connection.
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                buffer = bytearray()
                for _ in range(2):
                    await stream.send_all(head + body)
                    answer, _ = await read_response(stream, buffer)
                    assert answer.startswith(b"HTTP/1.1 401 ") and b"connection: close" not in answer.lower()


async def test_tenant_models_are_enforced_and_listed() -> None:
    async with gateway() as env:
        narrow = env.headers("narrow")
        denied = await env.client.post("/v1/chat/completions", json=chat_body(), headers=narrow)
        error = assert_error(denied, 403, "model_not_allowed")
        assert error["param"] == "model" and MODEL in error["message"]
        allowed = await env.client.post("/v1/chat/completions", json=chat_body(model=OTHER), headers=narrow)
        assert allowed.status_code == 200
        listing = (await env.client.get("/v1/models", headers=narrow)).json()
        assert [m["id"] for m in listing["data"]] == [OTHER]
        assert_error(await env.client.get(f"/v1/models/{MODEL}", headers=narrow), 404)
        everything = (await env.client.get("/v1/models", headers=env.headers("acme"))).json()
        assert sorted(m["id"] for m in everything["data"]) == sorted([MODEL, OTHER])
        await env.wait_idle()


async def test_auth_disabled_serves_everyone_as_anonymous_or_their_tenant() -> None:
    async with gateway(enabled=False) as env:
        anonymous = await env.client.post("/v1/chat/completions", json=chat_body())
        assert anonymous.status_code == 200
        keyed = await env.client.post("/v1/chat/completions", json=chat_body(), headers=env.headers("acme"))
        assert keyed.status_code == 200
        counted = env.gateway.usage.pending()
        assert counted[("anonymous", MODEL)].requests == 1
        assert counted[("acme", MODEL)].requests == 1


# -- every error status ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "param"),
    [(b"{not json", None), (b'{"messages": []}', "model"), (b'{"model": 7}', "model"), (b"[1]", None)],
)
async def test_bad_bodies_are_400_naming_the_field(content: bytes, param: str | None) -> None:
    async with gateway() as env:
        response = await env.client.post(
            "/v1/chat/completions", content=content,
            headers={**env.headers("acme"), "content-type": "application/json"},
        )
        error = assert_error(response, 400)
        assert error["param"] == param
        if param:
            assert f"'{param}'" in error["message"] or param in error["message"]


async def test_unknown_model_404_and_body_over_the_limit_413() -> None:
    async with gateway(max_request_bytes=512) as env:
        acme = env.headers("acme")
        assert_error(await env.client.post("/v1/chat/completions", json=chat_body(model="nope"), headers=acme),
                     404, "model_not_found")
        big = chat_body(padding="x" * 1000)
        declared = await env.client.post("/v1/chat/completions", json=big, headers=acme)
        assert_error(declared, 413, "request_too_large")

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: capped while reading
            data = json.dumps(big).encode()
            for i in range(0, len(data), 100):
                yield data[i:i + 100]

        streamed = await env.client.post("/v1/chat/completions", content=chunked(), headers=acme)
        assert_error(streamed, 413)
        assert env.upstream.requests == []


async def test_no_ready_replica_and_stopped_serving_are_503_with_retry_after() -> None:
    async with gateway() as env:
        acme = env.headers("acme")
        env.table.set_model_replicas("warming", [])
        response = await env.client.post("/v1/chat/completions", json=chat_body(model="warming"), headers=acme)
        assert_error(response, 503, "no_ready_replica")

        env.gateway.stopped = True
        for path, body in (("/v1/chat/completions", chat_body()), ("/v1/completions", {"model": MODEL}),
                           ("/v1/embeddings", {"model": MODEL, "input": "x"}),
                           ("/v1/chat/completions", {"garbage": True})):
            stopped = await env.client.post(path, json=body, headers=acme)
            error = assert_error(stopped, 503, "system_stopped")
            assert "ctl start" in error["message"]
        assert (await env.client.get("/v1/models", headers=acme)).status_code == 200
        assert env.upstream.requests == []
        env.gateway.stopped = False
        assert (await env.client.post("/v1/chat/completions", json=chat_body(), headers=acme)).status_code == 200
        await env.wait_idle()


async def test_concurrency_limit_sheds_with_429_while_requests_are_held() -> None:
    async with gateway() as env:
        pair = env.headers("pair")
        hold = trio.Event()
        env.upstream.hold = hold
        statuses: list[int] = []

        async def held_request() -> None:
            response = await env.client.post("/v1/chat/completions", json=chat_body(), headers=pair)
            statuses.append(response.status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(held_request)
            with trio.fail_after(DEADLINE_S):
                await env.load.wait_until(lambda load: load.total() == 2)
            shed = await env.client.post("/v1/chat/completions", json=chat_body(), headers=pair)
            error = assert_error(shed, 429, "concurrency_limit_exceeded")
            assert "pair" in error["message"]
            # Another tenant is not affected by pair's limit.
            other = await env.client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True},
                                          headers=env.headers("acme"))
            assert other.status_code == 200
            hold.set()
        assert statuses == [200, 200]
        counters = env.gateway.admission.snapshot()
        assert (counters["pair"].admitted, counters["pair"].shed, counters["pair"].in_flight) == (2, 1, 0)
        after = await env.client.post("/v1/chat/completions", json=chat_body(), headers=pair)
        assert after.status_code == 200
        await env.wait_idle()


async def test_requests_per_minute_budget_is_429_with_retry_after() -> None:
    async with gateway() as env:
        slow = env.headers("slow")
        for _ in range(2):
            assert (await env.client.post("/v1/chat/completions", json=chat_body(), headers=slow)).status_code == 200
        over = await env.client.post("/v1/chat/completions", json=chat_body(), headers=slow)
        assert_error(over, 429, "rate_limit_exceeded")
        assert 20 <= int(over.headers["retry-after"]) <= 30  # one request every 30 s at 2/min
        assert len(env.upstream.requests) == 2
        await env.wait_idle()


# -- usage -----------------------------------------------------------------------------------


async def test_usage_is_counted_for_plain_and_streamed_answers() -> None:
    async with gateway() as env:
        acme = env.headers("acme")
        plain = await env.client.post("/v1/chat/completions", json=chat_body(), headers=acme)
        assert plain.json()["usage"]["completion_tokens"] == 4
        embedding = await env.client.post("/v1/embeddings", json={"model": MODEL, "input": "x"}, headers=acme)
        assert embedding.status_code == 200

        # The client did not ask for usage: the gateway asks the engine and strips the chunk.
        silent = await env.client.post("/v1/chat/completions", json=chat_body(stream=True), headers=acme)
        events = [e for e in silent.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert all('"usage"' not in e for e in events)
        sent = env.upstream.requests[-1].json()
        assert sent["stream_options"] == {"include_usage": True}

        # The client asked: the chunk reaches it unchanged, and the body goes through as sent.
        raw = json.dumps(chat_body(stream=True, stream_options={"include_usage": True})).encode()
        asked = await env.client.post("/v1/chat/completions", content=raw,
                                      headers={**acme, "content-type": "application/json"})
        usage_events = [json.loads(e[6:]) for e in asked.text.split("\n\n") if '"usage"' in e]
        assert [e["usage"] for e in usage_events] == [STREAM_USAGE]
        assert env.upstream.requests[-1].body == raw

        await env.wait_idle()
        counted = env.gateway.usage.pending()
        chat = counted[("acme", MODEL)]
        assert chat.requests == 4
        assert chat.prompt_tokens == 3 + 2 + 11 + 11
        assert chat.completion_tokens == 4 + 0 + 4 + 4


async def test_openai_client_with_a_key() -> None:
    async with gateway() as env:
        def client(key: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=env.url + "/v1", api_key=key, max_retries=0, timeout=DEADLINE_S)

        good, narrow, wrong = client(env.keys["acme"]), client(env.keys["narrow"]), client("llmgw_00_nope")
        try:
            chat = await good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert chat.choices[0].message.content == "hello from r0"
            stream = await good.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            chunks = [chunk async for chunk in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_stream_text()
            assert all(c.usage is None for c in chunks)
            asked = await good.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                stream_options={"include_usage": True},
            )
            assert [c.usage.completion_tokens async for c in asked if c.usage] == [4]
            assert [m.id for m in (await good.models.list()).data] == sorted([MODEL, OTHER])
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
            with pytest.raises(openai.PermissionDeniedError):
                await narrow.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        finally:
            for c in (good, narrow, wrong):
                await c.close()
        assert env.gateway.usage.pending()[("acme", MODEL)].completion_tokens == 12
        await env.wait_idle()


def test_usage_value_total() -> None:
    assert Usage(3, 4).total == 7
    assert UsageMeter().pending() == {}


@pytest.mark.parametrize(
    ("tenant", "status", "code"), [("narrow", 403, "model_not_allowed"), ("acme", 404, "model_not_found")]
)
async def test_a_huge_model_name_is_not_echoed_whole(tenant: str, status: int, code: str) -> None:
    huge = "m" * 1_000_000
    async with gateway(max_request_bytes=2_000_000) as env:
        response = await env.client.post(
            "/v1/chat/completions", json=chat_body(model=huge), headers=env.headers(tenant)
        )
        error = assert_error(response, status, code)
        assert "m" * (MAX_ECHO_CHARS - 3) + "..." in error["message"]
        assert len(error["message"]) < MAX_ECHO_CHARS + 300 and len(response.content) < 2 * MAX_ECHO_CHARS + 600


async def test_the_engine_gets_its_own_secret_never_the_clients_key() -> None:
    async with gateway() as env:
        env.table.set_model_replicas(MODEL, [Replica("r0", MODEL, env.upstream.endpoint, "node-1", api_key="eng-s3cret")])
        assert "eng-s3cret" not in repr(env.table.replicas(MODEL))
        ok = await env.client.post("/v1/chat/completions", json=chat_body(), headers=env.headers("acme"))
        assert ok.status_code == 200, ok.text
        assert env.upstream.requests[-1].headers["authorization"] == "Bearer eng-s3cret"
        streamed = await env.client.post("/v1/chat/completions", json=chat_body(stream=True), headers=env.headers("acme"))
        assert streamed.status_code == 200, streamed.text
        assert env.upstream.requests[-1].headers["authorization"] == "Bearer eng-s3cret"
        # The gateway's own calls to the engine (/tokenize, adapter loads) carry it too.
        client = env.gateway.upstream
        assert client is not None
        await client.call(env.table.replicas(MODEL)[0], "POST", "/tokenize", b"{}", "req-t")
        assert env.upstream.requests[-1].headers["authorization"] == "Bearer eng-s3cret"
        # A replica without a secret (an engine started before secrets existed) gets no header.
        env.table.set_model_replicas(MODEL, [Replica("r0", MODEL, env.upstream.endpoint, "node-1")])
        ok = await env.client.post("/v1/chat/completions", json=chat_body(), headers=env.headers("acme"))
        assert ok.status_code == 200 and "authorization" not in env.upstream.requests[-1].headers
        await env.wait_idle()
