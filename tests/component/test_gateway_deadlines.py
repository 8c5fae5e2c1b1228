"""Upstream deadlines: replicas that stall at each point of an exchange never hang a client.

A stalling engine (raw trio + h11 on 127.0.0.1) stops at one point: before the response
head, after the head but before any body, or after the first SSE chunk. It waits on an
event the test never sets (no sleeps), so only the gateway's configured deadline can end
the exchange. Deadlines are short here (hundreds of ms) and only where a stall is wanted.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import AsyncIterator

import attrs
import h11
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from llmgw.router import Replica, ReplicaTable, create_app, gateway_of, serve_gateway
from llmgw.router.http.upstream import UpstreamDeadline, UpstreamTimeouts

MODEL = "tiny-chat"
DEADLINE_S = 10  # bound on every wait in the test itself
SHORT_S = 0.3  # the deadline that is meant to fire
LONG_S = 10.0  # deadlines that must not fire


class StallingEngine:
    """An engine that stops at ``stall`` ("head", "body" or "gap") and waits forever.

    ``received`` is set when a request arrived; ``hung_up`` when the gateway closed the
    connection while the engine was stalled.
    """

    def __init__(self, stall: str) -> None:
        self.stall = stall
        self.port = 0
        self.received = trio.Event()
        self.hung_up = trio.Event()
        self.headers: dict[str, str] = {}
        self._never = trio.Event()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        body = bytearray()
        try:
            with trio.fail_after(DEADLINE_S):
                while not isinstance(event := conn.next_event(), h11.EndOfMessage):
                    if event is h11.NEED_DATA:
                        data = await stream.receive_some(65536)
                        if not data:
                            return
                        conn.receive_data(data)
                    elif isinstance(event, h11.Request):
                        self.headers = {k.decode().lower(): v.decode() for k, v in event.headers}
                    elif isinstance(event, h11.Data):
                        body += event.data
            self.received.set()
            if self.stall != "head":
                kind = "text/event-stream" if json.loads(body).get("stream") else "application/json"
                head = h11.Response(status_code=200, headers=[("content-type", kind)])
                await stream.send_all(conn.send(head))
            if self.stall == "gap":
                chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}
                await stream.send_all(conn.send(h11.Data(data=b"data: " + json.dumps(chunk).encode() + b"\n\n")))
            # Stalled: wait for the gateway to give up (EOF) or the test to end.
            with trio.fail_after(DEADLINE_S):
                while await stream.receive_some(65536):
                    pass
            self.hung_up.set()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.hung_up.set()
        finally:
            await stream.aclose()


@attrs.define
class Env:
    client: httpx.AsyncClient
    engine: StallingEngine
    gateway: object

    def errors(self) -> dict[str, float]:
        """Return upstream error counts by kind, parsed from the gateway's /metrics text."""
        return upstream_errors(gateway_of(self.gateway).metrics.render()[0].decode())  # type: ignore[arg-type]


def upstream_errors(text: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "llmgw_gateway_upstream_errors":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["kind"]] = sample.value
    return counts


@asynccontextmanager
async def stalled_gateway(stall: str, timeouts: UpstreamTimeouts) -> AsyncIterator[Env]:
    async with trio.open_nursery() as nursery:
        engine = StallingEngine(stall)
        await nursery.start(engine.serve)
        table = ReplicaTable()
        table.set_model_replicas(MODEL, [Replica("stall-0", MODEL, engine.endpoint, "node-1")])
        app = create_app(table, timeouts=timeouts)
        port = await nursery.start(serve_gateway, app, "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as client:
            yield Env(client, engine, app)
        nursery.cancel_scope.cancel()


def chat(stream: bool) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


async def wait_idle(env: Env) -> None:
    load = gateway_of(env.gateway).load  # type: ignore[arg-type]
    with trio.fail_after(DEADLINE_S):
        await load.wait_until(lambda tracker: tracker.total() == 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_no_response_head_within_first_byte_deadline_is_504(stream: bool) -> None:
    async with stalled_gateway("head", UpstreamTimeouts(first_byte=SHORT_S, chunk=LONG_S)) as env:
        response = await env.client.post("/v1/chat/completions", json=chat(stream))
        assert response.status_code == 504, response.text
        error = response.json()["error"]
        assert error["code"] == "upstream_timeout"
        assert "first_byte_timeout" in error["message"]
        with trio.fail_after(DEADLINE_S):
            await env.engine.hung_up.wait()  # the gateway closed the stalled connection
        await wait_idle(env)
        assert env.errors() == {"first_byte_timeout": 1.0}


async def test_head_without_body_within_first_byte_deadline_is_504() -> None:
    async with stalled_gateway("body", UpstreamTimeouts(first_byte=SHORT_S, chunk=LONG_S)) as env:
        # Non-streamed from the client's side, so the gateway reads the whole body
        # before answering: no byte has reached the client yet, hence a clean 504.
        response = await env.client.post("/v1/chat/completions", json=chat(False))
        assert response.status_code == 504, response.text
        assert "sent no body" in response.json()["error"]["message"]
        with trio.fail_after(DEADLINE_S):
            await env.engine.hung_up.wait()
        await wait_idle(env)
        assert env.errors() == {"first_chunk_timeout": 1.0}


async def test_stream_head_without_first_chunk_ends_with_error_event() -> None:
    async with stalled_gateway("body", UpstreamTimeouts(first_byte=SHORT_S, chunk=LONG_S)) as env:
        async with env.client.stream("POST", "/v1/chat/completions", json=chat(True)) as response:
            assert response.status_code == 200
            text = (await response.aread()).decode()
        events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
        assert len(events) == 1
        assert json.loads(events[0])["error"]["code"] == "upstream_timeout"
        await wait_idle(env)
        assert env.errors() == {"first_chunk_timeout": 1.0}


async def test_stream_stalling_between_chunks_ends_with_error_event() -> None:
    async with stalled_gateway("gap", UpstreamTimeouts(first_byte=LONG_S, chunk=SHORT_S)) as env:
        async with env.client.stream("POST", "/v1/chat/completions", json=chat(True)) as response:
            assert response.status_code == 200
            text = (await response.aread()).decode()
        events = [json.loads(line[len("data: "):]) for line in text.split("\n") if line.startswith("data: ")]
        assert events[0]["choices"][0]["delta"]["content"] == "Hi"  # the chunk before the stall got through
        assert len(events) == 2
        error = events[1]["error"]
        assert error["code"] == "upstream_timeout"
        assert "chunk_timeout" in error["message"]
        with trio.fail_after(DEADLINE_S):
            await env.engine.hung_up.wait()
        await wait_idle(env)
        assert env.errors() == {"chunk_timeout": 1.0}


def test_deadline_error_names_phase_and_setting() -> None:
    error = UpstreamDeadline("r7", "chunk", 2.5)
    assert isinstance(error, httpx.TimeoutException)
    assert error.phase == "chunk"
    assert "r7" in str(error) and "2.5s" in str(error) and "gateway.chunk_timeout" in str(error)


def test_httpx_read_timeout_is_only_a_backstop() -> None:
    timeouts = UpstreamTimeouts(connect=1, first_byte=3, chunk=2)
    as_httpx = timeouts.to_httpx()
    assert as_httpx.connect == 1
    assert as_httpx.read is not None and as_httpx.read > 3
