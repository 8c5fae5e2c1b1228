"""The OpenAI-compatible gateway: a Quart-Trio app that routes each request to a replica.

Endpoints: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` are
forwarded to one READY replica of the requested model (body bytes unchanged, except
llama.cpp's per-request ``lora`` field: :mod:`llmgw.router.adapters`);
``GET /v1/models`` and ``GET /v1/models/<name>`` answer from the catalog;
``GET /healthz`` says the gateway is up.

Per request: parse just enough of the body to learn ``model`` and ``stream``, pick a
replica with the :class:`~llmgw.router.replicas.RoutingPolicy`, count the request on
that replica for as long as it is in flight, and relay the answer. Event streams
(``text/event-stream``) are relayed chunk by chunk as the engine sends them; other
answers are read whole and returned. A client that disconnects cancels the handler,
which closes the upstream connection, so the engine sees the disconnect too.

Every error is OpenAI-shaped JSON (:mod:`llmgw.router.errors`), including routing
errors (404/405/413) and bugs (500), and every response carries ``x-request-id``.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from typing import Any, AsyncIterator, Mapping

import httpx
import trio
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from . import errors, h1fastlane, hypercorn_fast, hypercorn_fix
from .admission import Admission, Ticket, estimate_tokens, request_too_large, system_stopped
from .auth import AuthTable, Tenant, model_not_allowed
from .errors import GatewayError
from .fastpath import FastForward, ForwardCall, ForwardResult, request_id_from
from .h1fastlane import FAST_LANE_KEY
from .replicas import LeastOutstanding, Lease, LoadTracker, Replica, ReplicaTable, RequestInfo, RoutingPolicy
from .kvindex import KvIndex
from llmgw.spec import KvDelta
from .h1pool import H1Response
from .upstream import UpstreamClient, UpstreamConnectError, UpstreamTimeouts, close_quietly, describe_error
from .usage import StreamUsage, Usage, UsageMeter, usage_from_body
from .adapters import NO_HOLD, Adapters, UpstreamAdmin

# -- observability (metrics, tracing, deadlines: llmgw/router/{metrics,tracing,instrument}.py)
from .instrument import TRACE_KEY, Instrumentation
from .metrics import GatewayMetrics
from .tracing import GatewayTracer

log = logging.getLogger(__name__)

# Hypercorn 0.18 can crash the whole server on a close race (see hypercorn_fix.py).
hypercorn_fix.install()
# Hypercorn's per-response idle-timer churn and split head/body writes (see hypercorn_fast.py).
hypercorn_fast.install()
# Simple, complete HTTP/1.1 requests skip h11 and Hypercorn's per-request stream (see h1fastlane.py).
h1fastlane.install()

# Attempts per request: the chosen replica plus one other if the first refused the
# connection. More would add latency for little gain: the control plane takes a dead
# replica out of the table within a heartbeat.
MAX_ATTEMPTS = 2

# Largest request body accepted (413 above it). Long-context prompts are well under
# 1 MB of JSON; 16 MiB leaves room for big embedding batches.
MAX_REQUEST_BYTES = 16 * 1024 * 1024

# Seconds allowed to receive the request body from the client.
BODY_TIMEOUT_S = 60.0

# Seconds the last body message of a response may take to send while shielded from
# cancellation (see _RequestCleanup): it only writes a final chunk and closes or recycles
# the connection, so this bounds a client that stopped reading.
FINAL_SEND_TIMEOUT_S = 10.0

# Paths forwarded to replicas, as Quart routes.
FORWARDED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

_EVENT_STREAM = "text/event-stream"

# The per-request exit stack (see _RequestCleanup); None outside an HTTP request.
_cleanup_stack: contextvars.ContextVar[contextlib.AsyncExitStack | None] = contextvars.ContextVar(
    "llmgw_router_cleanup", default=None
)


class _RequestCleanup:
    """ASGI middleware that gives each HTTP request an exit stack run when the request ends.

    Leases and upstream responses are registered on it so they are released even when
    the request ends in a way the view never sees: the client disconnecting before the
    streaming body was started, a cancellation between the view returning and Quart
    iterating the body, or a failure while sending headers.

    It also shields the last ``http.response.body`` message from cancellation (except on
    the fast lane, which needs no shield: :data:`~llmgw.router.h1fastlane.FAST_LANE_KEY`). Hypercorn
    finishes the exchange inside that ``send`` (closes a ``Connection: close`` /
    HTTP/1.0 connection, or re-arms the keep-alive idle timer), and that same ``send``
    delivers ``http.disconnect`` to the app's receiver, which (in Quart-Trio and in
    :class:`~llmgw.router.fastpath.FastForward`) cancels the request at once; unshielded,
    the cancellation lands in Hypercorn's close and the connection stays open forever.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._inner(scope, receive, send)
            return

        async def send_last_shielded(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # One scope: shielded from outer cancellation, bounded by its own deadline.
                with trio.CancelScope(shield=True, relative_deadline=FINAL_SEND_TIMEOUT_S):
                    await send(message)
            else:
                await send(message)

        # The fast lane finishes its exchange by itself, cancelled or not (h1fastlane.py).
        extensions = scope.get("extensions")
        lane = extensions is not None and FAST_LANE_KEY in extensions
        async with contextlib.AsyncExitStack() as stack:
            token = _cleanup_stack.set(stack)
            try:
                await self._inner(scope, receive, send if lane else send_last_shielded)
            finally:
                _cleanup_stack.reset(token)


def _request_stack() -> contextlib.AsyncExitStack:
    stack = _cleanup_stack.get()
    if stack is None:  # only possible if the middleware was removed
        raise RuntimeError("gateway request cleanup middleware is not installed")
    return stack


class Gateway:
    """The gateway's state (replica table, load, policy, upstream client) and its app.

    ``table`` is shared with whoever updates it (the control plane). ``load`` and
    ``policy`` default to a fresh :class:`LoadTracker` and :class:`LeastOutstanding` on
    it. The upstream client is created when the app starts serving and closed when it
    stops.
    """

    def __init__(
        self,
        table: ReplicaTable,
        *,
        load: LoadTracker | None = None,
        policy: RoutingPolicy | None = None,
        timeouts: UpstreamTimeouts = UpstreamTimeouts(),
        auth: AuthTable | None = None,
        admission: Admission | None = None,
        usage: UsageMeter | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        metrics: GatewayMetrics | None = None,
        tracer: GatewayTracer | None = None,
    ) -> None:
        self.table = table
        # Without an AuthTable every request is served (tenant "anonymous"): the
        # behaviour of a bare gateway in tests; the control plane always passes one.
        self.auth = auth if auth is not None else AuthTable(enabled=False)
        self.admission = admission if admission is not None else Admission()
        self.usage = usage if usage is not None else UsageMeter()
        self.max_request_bytes = max_request_bytes
        #: Cluster setting ``serving.stopped``: every POST under /v1/ is answered 503.
        self.stopped = False
        self.load = load if load is not None else LoadTracker()
        self.policy = policy if policy is not None else LeastOutstanding(self.load)
        # KV-cache blocks per replica, fed by the control plane (kv_update/kv_forget); a
        # KV-aware policy (llmgw/router/kvrouting.py) brings its own index and reads it.
        policy_index = getattr(self.policy, "index", None)
        self.kv_index: KvIndex = policy_index if isinstance(policy_index, KvIndex) else KvIndex()
        self.timeouts = timeouts
        self.upstream: UpstreamClient | None = None
        # Observability: metrics served on /metrics (in-flight read from ``load``); the
        # tracer (None: tracing off) is owned by the gateway and closed when it stops.
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self.metrics.bind_sources(
            lambda name: table.has_model(name) or table.parent_of(name) is not None,  # adapters are names too
            self.load.snapshot, lambda: _replica_ids(table),
        )
        # LoRA adapters: names resolved to models, loads on demand (llmgw/router/adapters.py).
        self.adapters = Adapters(table, self.load, UpstreamAdmin(self.upstream_client), metrics=self.metrics)
        self.metrics.bind_kv(self.kv_index)
        attach = getattr(self.policy, "attach_observer", None)  # routing decisions, hash alarms -> metrics
        if attach is not None:
            attach(self.metrics)
        if self.admission.metrics is None:
            self.admission.metrics = self.metrics
        self.tracer = tracer
        self.app = self._build_app()

    # -- app wiring ---------------------------------------------------------------------

    def _build_app(self) -> QuartTrio:
        app = QuartTrio(__name__)
        app.config["MAX_CONTENT_LENGTH"] = self.max_request_bytes
        app.config["BODY_TIMEOUT"] = BODY_TIMEOUT_S
        # Streams last as long as generation does; they are bounded by the upstream
        # read deadline between chunks instead of a total response timeout.
        app.config["RESPONSE_TIMEOUT"] = None
        app.extensions["llmgw.gateway"] = self
        # POSTs on the forwarded paths skip Quart (llmgw/router/fastpath.py: same forward()).
        app.asgi_app = FastForward(app.asgi_app, self, FORWARDED_PATHS, BODY_TIMEOUT_S)  # type: ignore[method-assign]
        app.asgi_app = _RequestCleanup(app.asgi_app)  # type: ignore[method-assign]
        app.asgi_app = Instrumentation(app.asgi_app, self.metrics, self.tracer)  # type: ignore[method-assign]

        app.before_serving(self._start)
        app.after_serving(self._stop)
        app.before_request(self._assign_request_id)
        app.after_request(self._tag_response)
        app.register_error_handler(GatewayError, self._on_gateway_error)
        app.register_error_handler(HTTPException, self._on_http_exception)
        app.register_error_handler(Exception, self._on_unexpected)

        app.add_url_rule("/healthz", "healthz", self._healthz, methods=["GET"])
        app.add_url_rule("/metrics", "metrics", self._metrics, methods=["GET"])
        app.add_url_rule("/v1/models", "models", self._list_models, methods=["GET"])
        app.add_url_rule("/v1/models/<path:model>", "model", self._get_model, methods=["GET"])
        for path in FORWARDED_PATHS:
            app.add_url_rule(path, path, self._forward, methods=["POST"])
        return app

    async def _start(self) -> None:
        self.upstream = UpstreamClient(self.timeouts, metrics=self.metrics)
        bind = getattr(self.policy, "bind_upstream", None)  # a KV-aware policy tokenizes through it
        if bind is not None:
            bind(self.upstream)

    async def _stop(self) -> None:
        upstream, self.upstream = self.upstream, None
        bind = getattr(self.policy, "bind_upstream", None)
        if bind is not None:
            bind(None)
        if upstream is not None:
            await upstream.aclose()
        if self.tracer is not None:
            await self.tracer.aclose()

    async def _assign_request_id(self) -> None:
        g.request_id = request_id_from(request.headers.get("x-request-id"))

    async def _tag_response(self, response: Response) -> Response:
        request_id = getattr(g, "request_id", None)
        if request_id and "x-request-id" not in response.headers:
            response.headers["x-request-id"] = request_id
        return response

    async def _on_gateway_error(self, error: GatewayError) -> Response:
        return errors.error_response(error, getattr(g, "request_id", None))

    async def _on_http_exception(self, error: HTTPException) -> Response:
        status = error.code or 500
        message = error.description or error.name
        if status == 404:
            message = f"No such endpoint: {request.method} {request.path}. The gateway serves /v1/*."
        return errors.error_response(errors.http_error(status, message), getattr(g, "request_id", None))

    async def _on_unexpected(self, error: Exception) -> Response:
        request_id = getattr(g, "request_id", None)
        log.error("gateway request %s failed", request_id, exc_info=error)
        return errors.error_response(errors.internal_error(request_id), request_id)

    # -- local endpoints ------------------------------------------------------------------

    async def _healthz(self) -> Response:
        return _json({"status": "ok"})

    def upstream_client(self) -> UpstreamClient:
        """Return the upstream client; raise a 503 GatewayError if the gateway is not serving."""
        upstream = self.upstream
        if upstream is None:
            raise GatewayError(503, "The gateway is shutting down.", "service_unavailable")
        return upstream

    async def _metrics(self) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, status=200, content_type=content_type)

    async def _list_models(self) -> Response:
        tenant = self.auth.authenticate(request.headers.get("authorization"))
        return _json({"object": "list", "data": self.adapters.model_objects(tenant)})

    async def _get_model(self, model: str) -> Response:
        tenant = self.auth.authenticate(request.headers.get("authorization"))
        found = self.adapters.model_object_of(model, tenant)
        if found is None:
            raise errors.model_not_found(model)
        return _json(found)

    # -- KV cache state (from the engines' KV events, relayed by the control plane) ------------

    def kv_update(self, replica_id: str, delta: KvDelta) -> None:
        """Apply one KV-cache delta reported for ``replica_id`` (see :class:`KvDelta`).

        Updates the KV index and tells a KV-aware policy (its hash-agreement check).
        Synchronous and cheap; never raises for an unknown replica (it is remembered
        until :meth:`kv_forget`).
        """
        self.kv_index.apply(replica_id, delta)
        applied = getattr(self.policy, "kv_applied", None)
        if applied is not None:
            applied(replica_id, delta)

    def kv_forget(self, replica_id: str) -> None:
        """Drop everything known about ``replica_id``'s KV cache (its shard stopped or its
        session ended); routing falls back to approximate for it until a new full copy."""
        self.kv_index.forget(replica_id)
        forgotten = getattr(self.policy, "kv_forgotten", None)
        if forgotten is not None:
            forgotten(replica_id)

    # -- forwarding -----------------------------------------------------------------------

    async def _forward(self) -> Response:
        """The Quart view of the forwarded paths; returns :meth:`forward`'s answer as a Response.

        Served POSTs normally never get here: :class:`~llmgw.router.fastpath.FastForward`
        runs :meth:`forward` without Quart. This view serves callers that bypass the ASGI
        middlewares (Quart's test client).
        """

        async def read_body() -> bytes:
            body = await request.get_data(cache=False)
            assert isinstance(body, bytes)
            return body

        call = ForwardCall(request.path, request.query_string, request.headers, g.request_id,
                           request.content_length, request.max_content_length, request.scope, read_body)
        status, headers, content = await self.forward(call)
        return Response(content, status=status, headers=headers)

    async def forward(self, call: ForwardCall) -> ForwardResult:
        """Route the request to a replica and return (status, headers, body) (see the module docstring).

        The body is bytes, or for an event stream an async iterator of chunks that
        releases the replica's lease when it ends or is closed (the caller must close it).

        Order: key (401), ``serving.stopped`` (503), size (413), body (400), the tenant's
        models (403), catalog (404), ready replicas (503), admission (429/503), route.
        Raises GatewayError for anything the client should see as an error.
        """
        tenant = self.auth.authenticate(call.headers.get("authorization"))
        labels = call.scope.setdefault("extensions", {}).setdefault("llmgw", {})
        labels["tenant"] = tenant.name
        if self.stopped:
            raise system_stopped()
        limit = call.max_bytes
        if limit is not None and (call.content_length or 0) > limit:
            raise request_too_large(limit)
        body = await call.read_body()
        info = _parse_request(call.path, body)
        labels["model"] = info.model
        if not tenant.allows(info.model):
            raise model_not_allowed(tenant.name, info.model)
        target = self.adapters.resolve(info.model, info.body)  # LoRA: a model, or an adapter of one (404)
        if target.adapter is not None:
            info = RequestInfo(info.path, info.model, info.stream, info.body, target.adapter)
        candidates = self.table.replicas(target.model)
        if candidates is None:
            raise errors.model_not_found(info.model)
        candidates = self.adapters.serving(target, candidates)  # LoRA: replicas that list the adapter
        if not candidates:
            raise errors.no_ready_replica(info.model)
        upstream = self.upstream
        if upstream is None:
            raise GatewayError(503, "The gateway is shutting down.", "service_unavailable")

        stack = _request_stack()
        trace = call.scope["extensions"].get(TRACE_KEY) if self.tracer is not None else None
        with trace.span("admission") if trace is not None else _NO_SPAN:
            ticket = await self.admission.admit(
                tenant, info.model, len(candidates), lambda: estimate_tokens(info.body)
            )
        stack.callback(ticket.release)
        candidates = self.adapters.serving(target, self.table.replicas(target.model) or ())  # it may have changed while queued
        if not candidates:
            raise errors.no_ready_replica(info.model)
        strip_usage = False
        if info.stream:
            body, strip_usage = _ask_for_usage(info.body, body)
        accounting = _Accounting(self.usage, self.admission, ticket, tenant, info.model, strip_usage)
        tried: set[str] = set()
        for attempt in range(MAX_ATTEMPTS):
            remaining = [r for r in candidates if r.id not in tried]
            if not remaining:
                break
            if tried:
                self.metrics.retry(info.model)
            remaining = self.adapters.prefer(target, remaining)  # LoRA: warm, unsaturated replicas first
            with trace.span("schedule") if trace is not None else _NO_SPAN:
                replica = self.policy.choose(remaining, info)
                if not isinstance(replica, Replica):  # a KV-aware policy is async (it may tokenize)
                    replica = await replica
            lease = self.load.acquire(replica.id)
            stack.callback(lease.release)
            # LoRA: llama.cpp's per-request lora field; the adapter loaded on the replica if needed.
            send_body = self.adapters.body_for(replica, target, body, tenant)
            adapter_hold = await self.adapters.acquire(replica, target, call.request_id)
            if adapter_hold is not NO_HOLD:
                stack.callback(adapter_hold.release)
            trace_headers = None
            if trace is not None:
                span, trace_headers = trace.start_upstream(replica.id)
                stack.callback(trace.end, span)
            try:
                response = await upstream.open(
                    replica,
                    "POST",
                    call.path,
                    query=call.query,
                    headers=call.headers,
                    body=send_body,
                    request_id=call.request_id,
                    extra_headers=trace_headers,
                )
            except UpstreamConnectError as error:
                lease.release()
                tried.add(replica.id)
                log.warning("request %s: %s", call.request_id, error)
                continue
            except httpx.TimeoutException as error:
                lease.release()
                raise errors.upstream_timeout(info.model, describe_error(error)) from error
            except httpx.HTTPError as error:
                lease.release()
                raise errors.upstream_failed(info.model, describe_error(error)) from error
            stack.push_async_callback(close_quietly, response)
            # LoRA: a 404 for an adapter the gateway loaded means the engine lost it (restart, or
            # another gateway worker unloaded it): load it again and retry once.
            if self.adapters.engine_answered(replica, target, response.status_code) and attempt + 1 < MAX_ATTEMPTS:
                lease.release()
                adapter_hold.release()
                await close_quietly(response)
                continue
            labels["replica"] = replica.id
            return await self._relay(response, lease, info, accounting, call.request_id)
        raise errors.replicas_unreachable(info.model, len(tried))

    async def _relay(
        self, upstream: H1Response, lease: Lease, info: RequestInfo, accounting: _Accounting, request_id: str
    ) -> ForwardResult:
        """Return (status, headers, body) for ``upstream``; releases ``lease`` when the body is done."""
        content_type = upstream.headers.get("content-type", "application/json")
        headers = {"content-type": content_type, "x-request-id": request_id}
        if content_type.split(";")[0].strip().lower() == _EVENT_STREAM:
            headers["cache-control"] = "no-cache"
            headers["x-accel-buffering"] = "no"  # tell a reverse proxy in front not to buffer
            chunks = self.upstream_client().iter_body(upstream, lease.replica_id)  # under deadlines
            return upstream.status_code, headers, _relay_stream(upstream, lease, info.model, request_id, accounting, chunks)
        try:
            content = await self.upstream_client().read_body(upstream, lease.replica_id)  # under deadlines
        except httpx.TimeoutException as error:
            raise errors.upstream_timeout(info.model, describe_error(error)) from error
        except httpx.HTTPError as error:
            raise errors.upstream_failed(info.model, describe_error(error)) from error
        finally:
            lease.release()
            await close_quietly(upstream)
        accounting.done(usage_from_body(content) if upstream.status_code == 200 else None)
        return upstream.status_code, headers, content


class _Accounting:
    """Ends one admitted request's accounting: usage to the meter (and metrics), the
    token budget settled, the admission slot freed. :meth:`done` runs once."""

    __slots__ = ("meter", "admission", "ticket", "tenant", "model", "stream")

    def __init__(
        self, meter: UsageMeter, admission: Admission, ticket: Ticket, tenant: Tenant, model: str,
        strip_usage: bool,
    ) -> None:
        self.meter = meter
        self.admission = admission
        self.ticket = ticket
        self.tenant = tenant
        self.model = model
        self.stream = StreamUsage(strip=strip_usage)

    def done(self, usage: Usage | None) -> None:
        ticket: Ticket | None = self.ticket
        self.ticket = None
        if ticket is None:
            return
        ticket.release()
        self.meter.record(self.tenant.name, self.model, usage)
        if usage is not None:
            ticket.settle(usage.total)
            metrics = self.admission.metrics
            if metrics is not None:
                metrics.usage(self.tenant.name, self.model, usage.prompt_tokens, usage.completion_tokens)


def _ask_for_usage(parsed: Mapping[str, Any], body: bytes) -> tuple[bytes, bool]:
    """Return the body to send for a stream, with ``stream_options.include_usage`` set, and
    whether the usage chunk must be stripped (the client did not ask for it)."""
    options = parsed.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return body, False
    changed = dict(parsed)
    changed["stream_options"] = {**options, "include_usage": True} if isinstance(options, dict) else {
        "include_usage": True
    }
    return json.dumps(changed).encode(), True


async def _relay_stream(
    upstream: H1Response, lease: Lease, model: str, request_id: str, accounting: _Accounting,
    body: AsyncIterator[bytes],
) -> AsyncIterator[bytes]:
    """Yield the upstream body's bytes as they arrive; release ``lease`` and close at the end.

    If the replica breaks the stream (closes it early, goes silent past the read
    deadline) the client gets one final SSE event ``data: {"error": {...}}`` (which
    OpenAI clients raise as an error) instead of a silently truncated answer.
    Cancellation (client gone) closes the upstream connection and propagates.
    """
    watch = accounting.stream
    try:
        try:
            async with contextlib.aclosing(body) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    out = watch.feed(chunk)
                    if out:
                        yield out
        except httpx.TimeoutException as error:
            failure = errors.upstream_timeout(model, describe_error(error))
        except httpx.HTTPError as error:
            failure = errors.upstream_failed(model, describe_error(error))
        else:
            rest = watch.flush()
            if rest:
                yield rest
            return
        rest = watch.flush()
        if rest:
            yield rest
        log.warning("request %s: stream from replica broke: %s", request_id, failure.message)
        yield b"data: " + json.dumps(failure.body()).encode() + b"\n\n"
    finally:
        lease.release()
        accounting.done(watch.usage)
        await close_quietly(upstream)


def _parse_request(path: str, body: bytes) -> RequestInfo:
    """Return what routing needs from a JSON request body; raise a 400 GatewayError if unusable."""
    try:
        parsed = json.loads(body)
    # ValueError covers bad JSON, invalid UTF-8 and integers past Python's digit limit;
    # RecursionError is JSON nested deeper than the interpreter's recursion limit.
    except (ValueError, RecursionError) as error:
        raise errors.invalid_request(
            f"The request body is not valid JSON ({error}). Send a JSON object with at least a 'model' field."
        ) from error
    if not isinstance(parsed, dict):
        raise errors.invalid_request("The request body must be a JSON object with at least a 'model' field.")
    model = parsed.get("model")
    if model is None:
        raise errors.invalid_request(
            "You must provide a model parameter (GET /v1/models lists the models).", param="model"
        )
    if not isinstance(model, str) or not model:
        raise errors.invalid_request("'model' must be a non-empty string.", param="model")
    return RequestInfo(path=path, model=model, stream=parsed.get("stream") is True, body=parsed)


def _json(value: object, status: int = 200) -> Response:
    return Response(json.dumps(value), status=status, content_type="application/json")


# Observability helpers: the stand-in for a span when tracing is off (reusable), and the
# replica ids the in-flight gauge reports even when idle.
_NO_SPAN = contextlib.nullcontext()


def _replica_ids(table: ReplicaTable) -> list[str]:
    return [r.id for m in table.models() for r in table.replicas(m.name) or ()]


def create_app(
    table: ReplicaTable,
    *,
    load: LoadTracker | None = None,
    policy: RoutingPolicy | None = None,
    timeouts: UpstreamTimeouts = UpstreamTimeouts(),
    auth: AuthTable | None = None,
    admission: Admission | None = None,
    usage: UsageMeter | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    metrics: GatewayMetrics | None = None,
    tracer: GatewayTracer | None = None,
) -> QuartTrio:
    """Return the gateway's Quart-Trio app routing over ``table`` (see :class:`Gateway`)."""
    return Gateway(
        table, load=load, policy=policy, timeouts=timeouts, auth=auth, admission=admission,
        usage=usage, max_request_bytes=max_request_bytes,
        metrics=metrics, tracer=tracer,
    ).app


def gateway_of(app: QuartTrio) -> Gateway:
    """Return the :class:`Gateway` behind an app made by :func:`create_app`."""
    return app.extensions["llmgw.gateway"]
