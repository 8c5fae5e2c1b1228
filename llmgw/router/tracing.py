"""Optional OpenTelemetry tracing of gateway requests, exported over OTLP/HTTP.

Off unless ``tracing.endpoint`` is set: :func:`create_tracer` then returns None, nothing
here imports ``opentelemetry`` (it is imported only inside :func:`create_tracer`), and
the gateway's per-request cost is one ``if``. Install the extra with
``pip install 'llmgw[tracing]'``.

On, each ``/v1/*`` request gets a SERVER span (``POST /v1/chat/completions``), a child of
the client's span when the request carries a W3C ``traceparent``. The request path opens
child spans through the :class:`RequestTrace` that the instrumentation middleware stores
at ``scope["extensions"]["llmgw.trace"]``::

    with trace.span("admission"): ...
    with trace.span("schedule"): ...
    span, headers = trace.start_upstream(replica_id)   # CLIENT span + traceparent for the engine
    ...; trace.end(span)                                # when the upstream exchange is over

Spans are batched and exported by the SDK's ``BatchSpanProcessor`` from its own thread,
so trio never blocks on the collector. Nothing is registered globally (no global tracer
provider or propagator): several gateways can run in one process with their own.
"""

from __future__ import annotations

import contextlib
import logging
import urllib.parse
from typing import TYPE_CHECKING, Any, Iterator, Mapping, MutableMapping

import attrs
import trio

from llmgw.config.defaults import DEFAULT_TRACING_SAMPLE_RATIO, DEFAULT_TRACING_SERVICE_NAME

if TYPE_CHECKING:  # pragma: no cover - typing only; never imported at run time when off
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

# Path of the OTLP/HTTP traces endpoint, appended when ``tracing.endpoint`` names only
# the collector (``http://collector:4318``), as OTLP exporters conventionally do.
OTLP_TRACES_PATH = "/v1/traces"

# Seconds one export POST may take. The export runs on the SDK's thread, so this only
# bounds how stale a backlog gets when the collector is down, and how long shutdown waits.
EXPORT_TIMEOUT_S = 5.0

# Milliseconds between batch exports: short enough that traces show up while an operator
# is looking at a problem, long enough that a busy gateway sends few large batches.
SCHEDULE_DELAY_MS = 1000

# Spans buffered before new ones are dropped (collector down or slow): bounds memory.
MAX_QUEUE_SIZE = 8192

# Seconds allowed to flush and shut the exporter down when the gateway stops.
SHUTDOWN_TIMEOUT_S = 10.0

_TRACE_HEADERS = (b"traceparent", b"tracestate")


@attrs.frozen
class TracingSettings:
    """What :func:`create_tracer` needs (``config.TracingConfig`` has the same fields)."""

    endpoint: str = ""
    service_name: str = DEFAULT_TRACING_SERVICE_NAME
    sample_ratio: float = DEFAULT_TRACING_SAMPLE_RATIO


def traces_url(endpoint: str) -> str:
    """Return the OTLP/HTTP traces URL for ``endpoint`` (``/v1/traces`` added if it has no path).

    Raises ``ValueError`` for anything but an ``http``/``https`` URL with a host.
    """
    parsed = urllib.parse.urlsplit(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"expected an http(s) URL of an OTLP/HTTP collector, got {endpoint!r}")
    if parsed.path in ("", "/"):
        parsed = parsed._replace(path=OTLP_TRACES_PATH)
    return urllib.parse.urlunsplit(parsed)


def create_tracer(settings: Any) -> GatewayTracer | None:
    """Return a :class:`GatewayTracer` for ``settings`` (``endpoint``, ``service_name``,
    ``sample_ratio``), or None when ``settings`` is None or its endpoint is empty.

    Raises ``RuntimeError`` telling the operator to install ``llmgw[tracing]`` when the
    OpenTelemetry packages are missing, and ``ValueError`` for a malformed endpoint.
    """
    if settings is None or not settings.endpoint:
        return None
    service_name = settings.service_name or DEFAULT_TRACING_SERVICE_NAME
    return GatewayTracer(settings.endpoint, service_name, settings.sample_ratio)


class GatewayTracer:
    """A private OpenTelemetry tracer provider exporting to one OTLP/HTTP collector.

    Close it with :meth:`aclose` (flushes buffered spans). Safe to use from the trio thread
    only; span export happens on the SDK's worker thread.
    """

    def __init__(self, endpoint: str, service_name: str, sample_ratio: float) -> None:
        try:
            import requests
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as error:
            raise RuntimeError(
                f"tracing.endpoint is set but OpenTelemetry is not installed ({error}); "
                "install it with: pip install 'llmgw[tracing]', or leave tracing.endpoint empty"
            ) from error
        if not 0.0 <= sample_ratio <= 1.0:
            raise ValueError(f"tracing.sample_ratio must be between 0 and 1, got {sample_ratio}")
        self.url = traces_url(endpoint)
        session = requests.Session()
        session.trust_env = False  # an operator's HTTP(S)_PROXY must not capture collector traffic
        exporter = OTLPSpanExporter(endpoint=self.url, timeout=EXPORT_TIMEOUT_S, session=session)
        self._provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
            resource=Resource.create({"service.name": service_name}),
            shutdown_on_exit=False,
        )
        self._provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                max_queue_size=MAX_QUEUE_SIZE,
                schedule_delay_millis=SCHEDULE_DELAY_MS,
                export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
            )
        )
        self._tracer = self._provider.get_tracer("llmgw.router")
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()

    def start_request(self, scope: Mapping[str, Any]) -> RequestTrace:
        """Start the SERVER span of the HTTP request ``scope``; return its :class:`RequestTrace`.

        A valid ``traceparent`` (and ``tracestate``) header makes it a child of the caller's
        span; an invalid one is ignored (a new trace starts).
        """
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers", ())
            if name.lower() in _TRACE_HEADERS
        }
        parent = self._propagator.extract(carrier) if carrier else None
        span = self._tracer.start_span(
            f"{scope.get('method', 'GET')} {scope.get('path', '')}",
            context=parent,
            kind=self._trace.SpanKind.SERVER,
            attributes={"http.request.method": scope.get("method", ""), "url.path": scope.get("path", "")},
        )
        return RequestTrace(self, span)

    async def flush(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Export every finished span now (on a worker thread); return whether it completed in time."""
        millis = int(timeout * 1000)
        return await trio.to_thread.run_sync(self._provider.force_flush, millis, abandon_on_cancel=True)

    async def aclose(self) -> None:
        """Flush buffered spans and stop the exporter thread (bounded by SHUTDOWN_TIMEOUT_S).

        Runs on a worker thread; cancellation abandons the wait (the SDK thread finishes
        on its own).
        """
        with trio.move_on_after(SHUTDOWN_TIMEOUT_S):
            await trio.to_thread.run_sync(self._provider.shutdown, abandon_on_cancel=True)


class RequestTrace:
    """The spans of one gateway request (made by :meth:`GatewayTracer.start_request`)."""

    __slots__ = ("_tracer", "request_span", "_context")

    def __init__(self, tracer: GatewayTracer, request_span: Span) -> None:
        self._tracer = tracer
        self.request_span = request_span
        self._context = tracer._trace.set_span_in_context(request_span)

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Span]:
        """Run the ``with`` body inside an INTERNAL child span ``name`` of the request span.

        An exception (cancellation included) is recorded on the span, which ends, and
        propagates unchanged.
        """
        span = self._tracer._tracer.start_span(name, context=self._context, attributes=attributes or None)
        try:
            yield span
        except BaseException as error:
            span.record_exception(error)
            span.set_status(self._tracer._trace.Status(self._tracer._trace.StatusCode.ERROR, type(error).__name__))
            raise
        finally:
            span.end()

    def start_upstream(self, replica: str, **attributes: Any) -> tuple[Span, dict[str, str]]:
        """Start the CLIENT span of one upstream exchange with ``replica``.

        Returns the span (end it with :meth:`end`) and the headers to send to the engine
        (``traceparent``, and ``tracestate`` if any) naming that span as the parent.
        """
        trace = self._tracer._trace
        span = self._tracer._tracer.start_span(
            "upstream",
            context=self._context,
            kind=trace.SpanKind.CLIENT,
            attributes={"llmgw.replica": replica, **attributes},
        )
        headers: dict[str, str] = {}
        self._tracer._propagator.inject(headers, context=trace.set_span_in_context(span))
        return span, headers

    def end(self, span: Span, error: BaseException | None = None) -> None:
        """End ``span`` (idempotent in effect: the SDK ignores a second end), noting ``error``."""
        if error is not None:
            span.record_exception(error)
            trace = self._tracer._trace
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
        span.end()

    def finish(self, status: int, labels: MutableMapping[str, str]) -> None:
        """End the request span with the response ``status`` and the request's labels."""
        span = self.request_span
        span.set_attribute("http.response.status_code", status)
        for key in ("model", "tenant", "replica"):
            value = labels.get(key)
            if value:
                span.set_attribute(f"llmgw.{key}", value)
        if status >= 500:
            trace = self._tracer._trace
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"HTTP {status}"))
        span.end()
