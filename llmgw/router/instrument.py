"""ASGI middleware that measures every ``/v1/*`` request for Prometheus (and tracing).

:class:`Instrumentation` wraps the gateway's ASGI app. For each HTTP request under
``/v1/`` it puts a fresh dict at ``scope["extensions"]["llmgw"]`` that the request path
fills in (``"tenant"``, ``"model"``, ``"replica"``; absent keys are recorded as ``""`` /
``"unknown"``), watches the messages the app sends, and records into
:class:`~llmgw.router.metrics.GatewayMetrics`:

* when the response ends: the request by model, tenant and status, and its duration;
* for event streams (``text/event-stream``): the time to the first non-empty body chunk
  and the gap between consecutive non-empty chunks, whether they go through ``send`` or
  through the server's body sink (:data:`~llmgw.router.http.extensions.BODY_SINK_KEY`,
  which it wraps).

The status is the one sent to the client; 499 when the client went away (or the request
was cancelled) before a response started, 500 when the app raised before starting one.

With a tracer (:mod:`llmgw.router.tracing`) it also opens the request span, honouring an
incoming ``traceparent``, and stores it at ``scope["extensions"]["llmgw.trace"]`` for
the request path's child spans. Without one the only cost is one ``if``.

The middleware never swallows exceptions or cancellation: it records, then re-raises.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Mapping, MutableMapping

import trio

from .http.extensions import BODY_SINK_KEY
from .http.forward import SinkWrapper
from .metrics import ChunkGaps, GatewayMetrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Key of the request-path labels dict in ``scope["extensions"]``.
LABELS_KEY = "llmgw"
#: Key of the request's trace (a ``tracing.RequestTrace``) in ``scope["extensions"]``.
TRACE_KEY = "llmgw.trace"

# Status recorded for a request whose client disconnected before the response started
# (nginx's convention; never sent on the wire).
CLIENT_CLOSED_STATUS = 499

# Only the API is measured: /metrics scrapes and health checks would drown the request
# counts, and their paths are not client traffic.
MEASURED_PREFIX = "/v1/"

_EVENT_STREAM = b"text/event-stream"
_EVENT_STREAM_TEXT = _EVENT_STREAM.decode()


def request_labels(scope: Scope) -> MutableMapping[str, str]:
    """Return the labels dict of the request ``scope`` (a throwaway dict if not instrumented).

    The request path sets ``"tenant"``, ``"model"`` and ``"replica"`` in it.
    """
    extensions = scope.get("extensions")
    if extensions is None:
        return {}
    labels = extensions.get(LABELS_KEY)
    return labels if labels is not None else {}


class Instrumentation:
    """ASGI middleware recording request metrics (and, with ``tracer``, the request span)."""

    def __init__(self, inner: ASGIApp, metrics: GatewayMetrics, tracer: Any = None) -> None:
        self._inner = inner
        self._metrics = metrics
        self._tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(MEASURED_PREFIX):
            await self._inner(scope, receive, send)
            return
        labels: dict[str, str] = {}
        extensions = scope.get("extensions")
        if extensions is None:
            extensions = scope["extensions"] = {}
        extensions[LABELS_KEY] = labels
        watch = _ResponseWatch(self._metrics, labels, send)
        sink = extensions.get(BODY_SINK_KEY)
        if sink is not None:  # the server's own sink for streamed pieces: watched too
            extensions[BODY_SINK_KEY] = _WatchedSink(watch, sink)
        trace = None
        if self._tracer is not None:
            trace = extensions[TRACE_KEY] = self._tracer.start_request(scope)
        try:
            await self._inner(scope, receive, watch.send)
        except trio.Cancelled:
            watch.fail(CLIENT_CLOSED_STATUS)
            raise
        except BaseException:
            watch.fail(500)
            raise
        finally:
            status = watch.finish()
            if trace is not None:
                trace.finish(status, labels)


class _ResponseWatch:
    """Wraps ``send`` for one request and records what went out (see the module docstring)."""

    __slots__ = ("_metrics", "_labels", "_send", "_start", "_status", "_stream", "_last", "_gaps")

    def __init__(self, metrics: GatewayMetrics, labels: dict[str, str], send: Send) -> None:
        self._metrics = metrics
        self._labels = labels
        self._send = send
        self._start = time.perf_counter()
        self._status = 0
        self._stream = False
        self._last = 0.0
        self._gaps: ChunkGaps | None = None

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            if self._stream and message.get("body"):
                self.chunk()
        elif kind == "http.response.start":
            self._status = message["status"]
            for name, value in message.get("headers", ()):
                if name.lower() == b"content-type":
                    self._stream = value.lower().startswith(_EVENT_STREAM)
                    break
        await self._send(message)

    def chunk(self) -> None:
        """Note one non-empty body chunk sent now (a no-op unless the response is an event stream)."""
        if not self._stream:
            return
        now = time.perf_counter()
        gaps = self._gaps
        if gaps is None:
            model = self._labels.get("model", "")
            self._metrics.first_chunk(model, now - self._start)
            self._gaps = self._metrics.chunk_gaps(model)
        else:
            gaps.add(now - self._last)
        self._last = now

    def started(self, status: int, content_type: str = "") -> None:
        """Note a response of ``status`` going out: whole, or streamed with ``content_type``
        (its pieces are measured if that is an event stream)."""
        self._status = status
        if content_type:
            self._stream = content_type.lower().startswith(_EVENT_STREAM_TEXT)

    def fail(self, status: int) -> None:
        """Record ``status`` unless a response already started (its status stands)."""
        if not self._status:
            self._status = status

    def finish(self) -> int:
        """Record the finished request; return the status recorded."""
        status = self._status or CLIENT_CLOSED_STATUS
        labels = self._labels
        if self._gaps is not None:
            self._gaps.flush()
        self._metrics.request_done(
            labels.get("model", ""), labels.get("tenant", ""), status, time.perf_counter() - self._start
        )
        return status


class _WatchedSink(SinkWrapper):
    """The server's body sink, noting the response's status and each piece in its watch."""

    __slots__ = ("_watch",)

    def __init__(self, watch: _ResponseWatch, sink: Any) -> None:
        super().__init__(sink)
        self._watch = watch

    def send_piece(self, body: bytes) -> Awaitable[None] | None:
        watch = self._watch
        gaps = watch._gaps
        if gaps is None:  # the first piece (or not an event stream): measured once it went
            sent = self._sink.send_piece(body)
            watch.chunk()
            return sent
        now = time.perf_counter()  # watch.chunk() inline: this runs once per relayed event
        gaps.add(now - watch._last)
        watch._last = now
        return self._sink.send_piece(body)

    def start(self, status: int, headers: Mapping[str, str]) -> Awaitable[None]:
        self._watch.started(status, headers.get("content-type", ""))
        return self._sink.start(status, headers)

    def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> Awaitable[None]:
        self._watch.started(status)
        return self._sink.respond(status, headers, body)
