"""OpenTelemetry tracing: a real OTLP/HTTP receiver on 127.0.0.1 decodes what the gateway exports."""

from __future__ import annotations

import gzip
import subprocess
import sys
from contextlib import asynccontextmanager
from typing import AsyncIterator

import attrs
import h11
import httpx
import pytest
import trio

from llmgw.router import Replica, ReplicaTable, create_app, serve_gateway
from llmgw.router.tracing import TracingSettings, create_tracer, traces_url
from tests.component.upstream_fixture import FakeUpstream

trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

MODEL = "tiny-chat"
DEADLINE_S = 10
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@attrs.frozen
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str


class OtlpReceiver:
    """Accepts ``POST /v1/traces`` (OTLP protobuf) and keeps the decoded spans."""

    def __init__(self) -> None:
        self.port = 0
        self.spans: list[ReceivedSpan] = []
        self.paths: list[str] = []
        self._changed = trio.Event()

    async def wait_for_spans(self, count: int) -> None:
        """Return once ``count`` spans have arrived; fail after DEADLINE_S.

        The gateway ends a request's spans after the client has its last byte, and the
        batch processor exports every second on its own, so waiting suffices.
        """
        with trio.fail_after(DEADLINE_S):
            while len(self.spans) < count:
                await self._changed.wait()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                head, body = None, bytearray()
                with trio.fail_after(DEADLINE_S):
                    while not isinstance(event := conn.next_event(), h11.EndOfMessage):
                        if event is h11.NEED_DATA:
                            data = await stream.receive_some(65536)
                            if not data:
                                return
                            conn.receive_data(data)
                        elif isinstance(event, h11.Request):
                            head = event
                        elif isinstance(event, h11.Data):
                            body += event.data
                        elif isinstance(event, h11.ConnectionClosed):
                            return
                assert head is not None
                self.paths.append(head.target.decode())
                headers = {k.lower(): v for k, v in head.headers}
                payload = gzip.decompress(body) if headers.get(b"content-encoding") == b"gzip" else bytes(body)
                self._decode(payload)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                response = h11.Response(
                    status_code=200,
                    headers=[("content-type", "application/x-protobuf"), ("content-length", str(len(reply)))],
                )
                await stream.send_all(conn.send(response) + conn.send(h11.Data(data=reply)) + conn.send(h11.EndOfMessage()))
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            return
        finally:
            await stream.aclose()

    def _decode(self, payload: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(payload)
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex())
                    )
        self._changed.set()
        self._changed = trio.Event()


@attrs.define
class Env:
    client: httpx.AsyncClient
    upstream: FakeUpstream
    receiver: OtlpReceiver
    tracer: object


@asynccontextmanager
async def traced_gateway(sample_ratio: float = 1.0) -> AsyncIterator[Env]:
    async with trio.open_nursery() as nursery:
        receiver = OtlpReceiver()
        await nursery.start(receiver.serve)
        upstream = FakeUpstream("r0")
        await nursery.start(upstream.serve)
        table = ReplicaTable()
        table.set_model_replicas(MODEL, [Replica("r0", MODEL, upstream.endpoint)])
        tracer = create_tracer(TracingSettings(f"http://127.0.0.1:{receiver.port}", "gw-test", sample_ratio))
        assert tracer is not None
        port = await nursery.start(serve_gateway, create_app(table, tracer=tracer), "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as client:
            yield Env(client, upstream, receiver, tracer)
        nursery.cancel_scope.cancel()


def chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize("stream", [False, True])
async def test_request_spans_reach_the_collector_with_parent_links(stream: bool) -> None:
    async with traced_gateway() as env:
        traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
        response = await env.client.post(
            "/v1/chat/completions", json=chat(stream=stream), headers={"traceparent": traceparent}
        )
        assert response.status_code == 200
        await env.receiver.wait_for_spans(4)
        spans = {span.name: span for span in env.receiver.spans}
        assert set(spans) == {"POST /v1/chat/completions", "admission", "schedule", "upstream"}
        assert env.receiver.paths == ["/v1/traces"] * len(env.receiver.paths)
        root = spans["POST /v1/chat/completions"]
        assert root.trace_id == CLIENT_TRACE_ID
        assert root.parent_span_id == CLIENT_SPAN_ID
        for child in ("admission", "schedule", "upstream"):
            assert spans[child].trace_id == CLIENT_TRACE_ID
            assert spans[child].parent_span_id == root.span_id

        # The engine was told the upstream span is its parent.
        sent = env.upstream.requests[-1].headers["traceparent"]
        version, trace_id, parent_id, flags = sent.split("-")
        assert (version, trace_id, parent_id, flags) == ("00", CLIENT_TRACE_ID, spans["upstream"].span_id, "01")


async def test_request_without_traceparent_starts_a_trace() -> None:
    async with traced_gateway() as env:
        assert (await env.client.post("/v1/chat/completions", json=chat())).status_code == 200
        await env.receiver.wait_for_spans(4)
        root = next(s for s in env.receiver.spans if s.name.startswith("POST "))
        assert root.parent_span_id == ""
        assert env.upstream.requests[-1].headers["traceparent"].split("-")[1] == root.trace_id


async def test_unsampled_traces_export_nothing_but_still_propagate() -> None:
    async with traced_gateway(sample_ratio=0.0) as env:
        assert (await env.client.post("/v1/chat/completions", json=chat())).status_code == 200
        flags = env.upstream.requests[-1].headers["traceparent"].split("-")[3]
        assert int(flags, 16) & 0x01 == 0  # the "sampled" bit is clear
        # A caller's sampled trace is followed even at ratio 0; only its spans arrive.
        sampled = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"}
        assert (await env.client.post("/v1/chat/completions", json=chat(), headers=sampled)).status_code == 200
        await env.receiver.wait_for_spans(4)
        with trio.fail_after(DEADLINE_S):
            assert await env.tracer.flush()  # type: ignore[attr-defined]
        assert {span.trace_id for span in env.receiver.spans} == {CLIENT_TRACE_ID}
        assert len(env.receiver.spans) == 4


def test_tracing_off_imports_no_opentelemetry() -> None:
    program = (
        "import sys\n"
        "from llmgw.control import plane\n"
        "from llmgw.router import ReplicaTable, create_app\n"
        "from llmgw.router.tracing import create_tracer, TracingSettings\n"
        "assert create_tracer(TracingSettings()) is None and create_tracer(None) is None\n"
        "create_app(ReplicaTable(), tracer=create_tracer(TracingSettings()))\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_traces_url() -> None:
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ValueError):
        traces_url("c:4318")
