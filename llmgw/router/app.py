"""The OpenAI-compatible gateway: a Quart-Trio app that routes each request to a replica.

Endpoints: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` are
forwarded to one READY replica of the requested model (body bytes unchanged, except
llama.cpp's per-request ``lora`` field: :mod:`llmgw.router.adapters`);
``GET /v1/models`` and ``GET /v1/models/<name>`` answer from the catalog;
``GET /healthz`` says the gateway is up (liveness); ``GET /readyz`` whether it is ready
to route (503 with the reason while its control plane is still rebuilding the replica table).

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
import json
import logging
from typing import Any, Awaitable, Callable, Mapping, Sequence

import attrs
import httpx
from quart import Response, request
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from llmgw.config import MetricsConfig, RoutingConfig
from llmgw.config.defaults import DEFAULT_MAX_REQUEST_BYTES
from llmgw.spec import KvDelta

from . import errors
from .adapters import NO_HOLD, Adapters, Target, UpstreamAdmin
from .admin_api import ADMIN_API_METHODS, ADMIN_API_PREFIX, NO_ADMIN_API, AdminApiHandler, ApiRequest, encode_response
from .admission import Admission, Ticket, estimate_tokens, request_too_large, system_stopped
from .auth import AuthTable, Tenant, model_not_allowed
from .errors import GatewayError
from .http.cleanup import Releases
from .http.drain import StreamCut, StreamCuts
from .http.extensions import REQUEST_ID_KEY
from .http.forward import BodySink, FastForward, ForwardCall, ForwardResult
from .http.relayhub import RelayHub
from .http.upstream import (
    BodyReader, UpstreamClient, UpstreamConnectError, UpstreamTimeouts, close_quietly, describe_error,
    release_or_close,
)
from .http.upstream_pool import H1Response
from .kvindex import KvIndex
from .kvrouting import make_policy
from .replicas import LeastOutstanding, Lease, LoadTracker, Replica, ReplicaTable, RequestInfo, Route, RoutingPolicy
from .usage import StreamUsage, Usage, UsageMeter, usage_from_body

# -- observability (metrics, tracing, deadlines: llmgw/router/{metrics,tracing,instrument}.py)
from .instrument import TRACE_KEY, Instrumentation
from .metrics import GatewayMetrics
from .metrics_access import MetricsAccess, MetricsGate
from .tracing import GatewayTracer

log = logging.getLogger(__name__)

# Attempts per request: the chosen replica plus one other if the first refused the
# connection. More would add latency for little gain: the control plane takes a dead
# replica out of the table within a heartbeat.
MAX_ATTEMPTS = 2

# Seconds allowed to receive the request body from the client.
BODY_TIMEOUT_S = 60.0

# Paths forwarded to replicas, as Quart routes.
FORWARDED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

_EVENT_STREAM = "text/event-stream"


def error_response(error: GatewayError, request_id: str | None = None) -> Response:
    """Return a Quart response carrying ``error`` as JSON, its headers and ``x-request-id``."""
    headers = dict(error.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return Response(
        json.dumps(error.body()),
        status=error.status,
        content_type="application/json",
        headers=headers,
    )


def describe_routing(routing: RoutingConfig) -> str:
    """Returns ``routing`` in words: the policy, then the KV-aware policy's parameters."""
    if routing.policy != "kv":
        return routing.policy
    params = attrs.asdict(routing)
    del params["policy"]
    return "kv (" + ", ".join(f"{name} {value:g}" for name, value in params.items()) + ")"


class Gateway:
    """The gateway's state (replica table, load, policy, upstream client) and its app.

    ``table`` is shared with whoever updates it (the control plane). ``load`` defaults to a
    fresh :class:`LoadTracker`; ``policy`` to the one ``routing`` (server.yaml's ``routing:``)
    names, or :class:`LeastOutstanding` without either. The upstream client is created when the app starts serving and closed when it
    stops.
    """

    def __init__(
        self,
        table: ReplicaTable,
        *,
        load: LoadTracker | None = None,
        policy: RoutingPolicy | None = None,
        routing: RoutingConfig | None = None,
        timeouts: UpstreamTimeouts = UpstreamTimeouts(),
        auth: AuthTable | None = None,
        admission: Admission | None = None,
        usage: UsageMeter | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        metrics: GatewayMetrics | None = None,
        tracer: GatewayTracer | None = None,
        metrics_config: MetricsConfig | None = None,
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
        #: Why ``/readyz`` answers 503 (the control plane sets it), or None: ready.
        self.not_ready: str | None = None
        #: What ``/leader`` answers (:func:`leader_state`; the control plane sets it).
        self.leader: dict[str, Any] = leader_state(False, "", 0)
        #: Who answers ``/api/v1/*`` (llmgw/router/admin_api.py; the control plane sets it).
        self.admin_api: AdminApiHandler | None = None
        self.load = load if load is not None else LoadTracker()
        if policy is None:
            policy = make_policy(routing, self.load) if routing is not None else LeastOutstanding(self.load)
        self.policy = policy
        #: server.yaml's ``routing:`` (None: the one naming ``policy``); the cluster setting
        #: ``routing`` is laid over it by :meth:`apply_routing`, giving :attr:`routing`.
        self.routing_base = routing if routing is not None else RoutingConfig(policy=policy.name)
        self.routing = self.routing_base
        # KV-cache blocks per replica, fed by the control plane (kv_update/kv_forget); a
        # KV-aware policy (llmgw/router/kvrouting.py) brings its own index and reads it.
        policy_index = self.policy.index
        self.kv_index: KvIndex = policy_index if policy_index is not None else KvIndex()
        self.timeouts = timeouts
        self.upstream: UpstreamClient | None = None
        # Observability: metrics served on /metrics (in-flight read from ``load``); the
        # tracer (None: tracing off) is owned by the gateway and closed when it stops.
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        # A model label is a catalog model or an adapter of one (table.knows).
        self.metrics.bind_sources(table.knows, self.load.snapshot, lambda: _replica_ids(table))
        # LoRA adapters: names resolved to models, loads on demand (llmgw/router/adapters.py).
        self.adapters = Adapters(table, self.load, UpstreamAdmin(self.upstream_client), metrics=self.metrics)
        self.metrics.bind_kv(self.kv_index)
        # The approximate router's prefix tree (a KV-aware policy's, whichever policy routes now).
        self.metrics.bind_prefix_tree(lambda: getattr(self.policy, "tree", None))
        self.policy.attach_observer(self.metrics)  # routing decisions, hash alarms -> metrics
        self.metrics.routing_policy(self.routing.policy)
        if self.admission.metrics is None:
            self.admission.metrics = self.metrics
        self.tracer = tracer
        #: ``metrics:`` of server.yaml: who may read /metrics here, or that it moved to its
        #: own address (llmgw/router/metrics_access.py).
        self.metrics_config = metrics_config if metrics_config is not None else MetricsConfig()
        #: More series for /metrics, appended to the gateway's own (the control plane's fleet:
        #: GatewayInterface.set_extra_metrics); None: none.
        self.extra_metrics: Callable[[], Awaitable[bytes]] | None = None
        #: The relayed streams' upstream reads; a stopping server cuts them when its
        #: shutdown grace runs out (each stream then ends with an SSE error event).
        self.streams = StreamCuts()
        #: The task relaying the streams' events in batches while it runs (started with the app).
        self.relay_hub = RelayHub()
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
        # POSTs on the forwarded paths skip Quart (llmgw/router/http/forward.py runs forward());
        # every request gets its id there.
        gate = MetricsGate(app.asgi_app, MetricsAccess.on_gateway(self.metrics_config, self.auth.enabled))
        forward = FastForward(gate, self.forward, app.config, FORWARDED_PATHS, BODY_TIMEOUT_S)
        app.asgi_app = forward  # type: ignore[method-assign]
        app.asgi_app = Instrumentation(app.asgi_app, self.metrics, self.tracer)  # type: ignore[method-assign]

        app.before_serving(self._start)
        app.after_serving(self._stop)
        app.after_request(self._tag_response)
        app.register_error_handler(GatewayError, self._on_gateway_error)
        app.register_error_handler(HTTPException, self._on_http_exception)
        app.register_error_handler(Exception, self._on_unexpected)

        app.add_url_rule("/healthz", "healthz", self._healthz, methods=["GET"])
        app.add_url_rule("/readyz", "readyz", self._readyz, methods=["GET"])
        app.add_url_rule("/leader", "leader", self._leader, methods=["GET"])
        app.add_url_rule(ADMIN_API_PREFIX + "<path:path>", "admin_api", self._admin_api,
                         methods=list(ADMIN_API_METHODS))
        app.add_url_rule("/metrics", "metrics", self._metrics, methods=["GET"])
        app.add_url_rule("/v1/models", "models", self._list_models, methods=["GET"])
        app.add_url_rule("/v1/models/<path:model>", "model", self._get_model, methods=["GET"])
        for path in FORWARDED_PATHS:
            # Only so that other methods get Quart's 405: FastForward serves every POST here.
            app.add_url_rule(path, path, _served_by_fast_forward, methods=["POST"])
        return app

    def apply_routing(self, overrides: Mapping[str, Any]) -> None:
        """Route by :attr:`routing_base` with ``overrides`` (the cluster setting ``routing``,
        :class:`RoutingConfig` field values) over it, from the next request on.

        Another ``policy`` starts that policy on the same load and KV index (requests in
        flight finish as routed; a KV-aware policy learns prefill rates afresh); the other
        keys retune the current policy in place. Raises TypeError for an unknown field.
        """
        routing = attrs.evolve(self.routing_base, **overrides)
        if routing == self.routing:
            return
        if routing.policy == self.policy.name:
            self.policy.retune(routing)
        else:
            policy = make_policy(routing, self.load, index=self.kv_index)
            policy.attach_observer(self.metrics)
            policy.bind_upstream(self.upstream, self.app.nursery if self.upstream is not None else None)
            old, self.policy = self.policy, policy
            old.bind_upstream(None)
            old.close()
        log.info("routing now %s", describe_routing(routing))
        self.routing = routing
        self.metrics.routing_policy(routing.policy)

    async def _start(self) -> None:
        self.upstream = UpstreamClient(self.timeouts, metrics=self.metrics, watch=self.streams)
        self.policy.bind_upstream(self.upstream, self.app.nursery)  # a KV-aware policy tokenizes through it
        # The relayed streams' read deadlines, kept by one task instead of a cancel scope
        # per chunk (llmgw/router/http/drain.py); it runs in the app's lifespan nursery.
        await self.app.nursery.start(self.streams.watch)
        # Relays the streams' events that need no waiting, one trio wait per batch
        # (llmgw/router/http/relayhub.py); it relies on the watch above for deadlines.
        await self.app.nursery.start(self.relay_hub.run)

    async def _stop(self) -> None:
        self.relay_hub.stop()
        self.streams.stop_watching()
        upstream, self.upstream = self.upstream, None
        self.policy.bind_upstream(None)
        if upstream is not None:
            await upstream.aclose()
        if self.tracer is not None:
            await self.tracer.aclose()

    async def _tag_response(self, response: Response) -> Response:
        request_id = _request_id()
        if request_id and "x-request-id" not in response.headers:
            response.headers["x-request-id"] = request_id
        return response

    async def _on_gateway_error(self, error: GatewayError) -> Response:
        return error_response(error, _request_id())

    async def _on_http_exception(self, error: HTTPException) -> Response:
        status = error.code or 500
        message = error.description or error.name
        if status == 404:
            message = f"No such endpoint: {request.method} {request.path}. The gateway serves /v1/*."
        return error_response(errors.http_error(status, message), _request_id())

    async def _on_unexpected(self, error: Exception) -> Response:
        request_id = _request_id()
        log.error("gateway request %s failed", request_id, exc_info=error)
        return error_response(errors.internal_error(request_id), request_id)

    # -- local endpoints ------------------------------------------------------------------

    async def _healthz(self) -> Response:
        return _json({"status": "ok"})

    async def _readyz(self) -> Response:
        not_ready = self.not_ready
        if not_ready is not None:
            return _json({"status": "not ready", "reason": not_ready}, 503)
        return _json({"status": "ready"})

    async def _leader(self) -> Response:
        state = self.leader
        return _json(state, 200 if state["leading"] else 503)

    async def _admin_api(self, path: str) -> Response:
        handler = self.admin_api
        if handler is None:
            answer = NO_ADMIN_API
        else:
            body = await request.get_data(cache=False)
            answer = await handler(ApiRequest(request.method, path, request.headers.get("authorization", ""), body))
        return Response(encode_response(answer), status=answer.status, content_type="application/json")

    def upstream_client(self) -> UpstreamClient:
        """Return the upstream client; raise a 503 GatewayError if the gateway is not serving."""
        upstream = self.upstream
        if upstream is None:
            raise GatewayError(503, "The gateway is shutting down.", "service_unavailable")
        return upstream

    async def _metrics(self) -> Response:
        return Response(await self.metrics_body(), status=200, content_type=CONTENT_TYPE_LATEST)

    async def metrics_body(self) -> bytes:
        """Returns this gateway's ``/metrics`` body: its own series, then :meth:`extra_metrics_body`."""
        return self.metrics.render()[0] + await self.extra_metrics_body()

    async def extra_metrics_body(self) -> bytes:
        """Returns what ``extra_metrics()`` writes (b"" without it): a pool appends it to the
        workers' merged samples."""
        return await self.extra_metrics() if self.extra_metrics is not None else b""

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
        self.policy.kv_applied(replica_id, delta)

    def kv_forget(self, replica_id: str) -> None:
        """Drop everything known about ``replica_id``'s KV cache (its shard stopped or its
        session ended); routing falls back to approximate for it until a new full copy."""
        self.kv_index.forget(replica_id)
        self.policy.kv_forgotten(replica_id)

    # -- forwarding -----------------------------------------------------------------------

    async def forward(self, call: ForwardCall) -> ForwardResult:
        """Serve one forwarded request; return (status, headers, body) (see the module docstring).

        The body is bytes, or for an event stream a :class:`_StreamRelay` that releases the
        replica's lease when it ends or is closed (the caller must pump or close it).

        The request passes the stages in order, each a method below: :meth:`_resolve`
        (key 401, ``serving.stopped`` 503, size 413, body 400, the tenant's models 403,
        catalog 404, ready replicas 503), :meth:`_admit` (429/503), :meth:`_route` (a
        replica chosen and the request sent to it, once more elsewhere if it refused),
        :meth:`_relay`; the accounting (:meth:`_Request.account`) runs when the answer's
        body is done. Raises GatewayError for anything the client should see as an error.
        """
        forwarded = await self._resolve(call)
        candidates = await self._admit(forwarded)
        response = await self._route(forwarded, candidates)
        return await self._relay(forwarded, response)

    async def _resolve(self, call: ForwardCall) -> _Request:
        """Return ``call`` resolved, once: its tenant, body, model or LoRA adapter, and how
        many ready replicas serve it (at least one).

        Raises GatewayError: 401 (key), 503 (``serving.stopped``), 413 (size), 400 (body),
        403 (the tenant's models), 404 (not in the catalog), 503 (no ready replica; the
        gateway shutting down).
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
        upstream = self.upstream_client()  # 503 while shutting down
        trace = call.scope["extensions"].get(TRACE_KEY) if self.tracer is not None else None
        return _Request(call, tenant, info, target, body, labels, trace, call.releases, upstream,
                        len(candidates), self.usage, self.admission)

    async def _admit(self, forwarded: _Request) -> Sequence[Replica]:
        """Wait for the tenant's turn (:class:`~llmgw.router.admission.Admission`); return the
        ready replicas serving the request now (the table may have changed while it waited).

        The admission ticket goes on the request; it is released when the request ends,
        or earlier by :meth:`_Request.account`. A stream is sent asking for its usage.
        Raises GatewayError 429/503 (admission refused), 503 (no ready replica left).
        """
        info = forwarded.info
        trace = forwarded.trace
        with trace.span("admission") if trace is not None else _NO_SPAN:
            ticket = await self.admission.admit(
                forwarded.tenant, info.model, forwarded.ready, lambda: estimate_tokens(info.body)
            )
        forwarded.releases.callback(ticket.release)
        target = forwarded.target
        candidates = self.adapters.serving(target, self.table.replicas(target.model) or ())
        if not candidates:
            raise errors.no_ready_replica(info.model)
        forwarded.ticket = ticket
        if info.stream:
            forwarded.body, strip_usage = _ask_for_usage(info.body, forwarded.body)
            forwarded.stream = StreamUsage(strip=strip_usage)
        return candidates

    async def _route(self, forwarded: _Request, candidates: Sequence[Replica]) -> H1Response:
        """Choose a replica among ``candidates``, send the request; return the response (its head read).

        The chosen replica's lease is set on the request (:attr:`_Request.lease`); it and
        the response are released when the request ends at the latest. A replica that
        refuses the connection is left out and another one chosen, and a replica that lost
        a LoRA adapter the gateway loaded gets it loaded again, within
        :data:`MAX_ATTEMPTS` in all. Raises GatewayError 504 (the replica timed out), 502
        (it failed, or no replica could be reached).
        """
        call = forwarded.call
        info = forwarded.info
        target = forwarded.target
        releases = forwarded.releases
        trace = forwarded.trace
        tried: set[str] = set()
        for attempt in range(MAX_ATTEMPTS):
            remaining = [r for r in candidates if r.id not in tried] if tried else candidates
            if not remaining:
                break
            if tried:
                self.metrics.retry(info.model)
            route = await self._choose(forwarded, remaining)
            replica = route.replica
            lease = self.load.acquire(replica.id, route.prefill_tokens, route.on_first_token)
            releases.callback(lease.release)
            forwarded.on_usage = route.on_usage
            # LoRA: llama.cpp's per-request lora field; the adapter loaded on the replica if needed.
            send_body = self.adapters.body_for(replica, target, forwarded.body, forwarded.tenant)
            adapter_hold = await self.adapters.acquire(replica, target, call.request_id)
            if adapter_hold is not NO_HOLD:
                releases.callback(adapter_hold.release)
            trace_headers = None
            if trace is not None:
                span, trace_headers = trace.start_upstream(replica.id)
                releases.callback(trace.end, span)
            try:
                response = await forwarded.upstream.open(
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
            releases.push_async_callback(release_or_close, response)
            # LoRA: a 404 for an adapter the gateway loaded means the engine lost it (restart, or
            # another gateway worker unloaded it): load it again and retry once.
            if self.adapters.engine_answered(replica, target, response.status_code) and attempt + 1 < MAX_ATTEMPTS:
                lease.release()
                adapter_hold.release()
                await close_quietly(response)
                continue
            forwarded.labels["replica"] = replica.id
            forwarded.lease = lease
            return response
        raise errors.replicas_unreachable(info.model, len(tried))

    async def _choose(self, forwarded: _Request, remaining: Sequence[Replica]) -> Route:
        """Return the route the policy picks among ``remaining`` (LoRA: warm, unsaturated ones first)."""
        remaining = self.adapters.prefer(forwarded.target, remaining)
        trace = forwarded.trace
        with trace.span("schedule") if trace is not None else _NO_SPAN:
            route = self.policy.route(remaining, forwarded.info)
            if not isinstance(route, Route):  # a KV-aware policy is async (it may tokenize)
                route = await route
        return route

    async def _relay(self, forwarded: _Request, upstream: H1Response) -> ForwardResult:
        """Return (status, headers, body) for the replica's answer ``upstream``.

        A whole body is read under the upstream deadlines, then the lease is released, the
        response closed and the request accounted; an event stream is returned as a
        :class:`_StreamRelay` that does all three when it ends. Raises
        GatewayError 504/502 if a whole body cannot be read.
        """
        lease = forwarded.lease
        assert lease is not None
        request_id = forwarded.call.request_id
        content_type = upstream.headers.get("content-type", "application/json")
        headers = {"content-type": content_type, "x-request-id": request_id}
        if content_type.split(";")[0].strip().lower() == _EVENT_STREAM:
            if forwarded.stream is None:  # an event stream the client did not ask for: relayed as it is
                forwarded.stream = StreamUsage(strip=False)
            headers["cache-control"] = "no-cache"
            headers["x-accel-buffering"] = "no"  # tell a reverse proxy in front not to buffer
            # Under the deadlines, cut by a stopping gateway's grace running out.
            reader = self.upstream_client().body_reader(upstream, lease.replica_id, self.streams)
            return upstream.status_code, headers, _StreamRelay(upstream, forwarded, reader, self.relay_hub)
        try:
            content = await self.upstream_client().read_body(upstream, lease.replica_id)  # under deadlines
        except httpx.TimeoutException as error:
            raise errors.upstream_timeout(forwarded.info.model, describe_error(error)) from error
        except httpx.HTTPError as error:
            raise errors.upstream_failed(forwarded.info.model, describe_error(error)) from error
        finally:
            lease.release()
            closing = release_or_close(upstream)
            if closing is not None:
                await closing
        forwarded.account(usage_from_body(content) if upstream.status_code == 200 else None)
        return upstream.status_code, headers, content


class _Request:
    """One forwarded request as it passes the stages of :meth:`Gateway.forward`.

    :meth:`Gateway._resolve` makes it (tenant, parsed body, LoRA target: resolved once
    and read by every later stage), :meth:`Gateway._admit` adds the admission ticket
    and a streamed request's usage watch (:class:`StreamUsage`; :meth:`Gateway._relay` adds
    one for an event stream the client did not ask for), :meth:`Gateway._route` the chosen
    replica's lease. ``releases`` is what the request holds, released when it ends
    (:class:`~llmgw.router.http.cleanup.Releases`, the call's).
    :meth:`account` ends the request's accounting into ``meter`` and ``admission``.
    """

    __slots__ = ("call", "tenant", "info", "target", "body", "labels", "trace", "releases", "upstream",
                 "ready", "lease", "meter", "admission", "ticket", "stream", "on_usage")

    def __init__(
        self, call: ForwardCall, tenant: Tenant, info: RequestInfo, target: Target, body: bytes,
        labels: dict[str, str], trace: Any, releases: Releases, upstream: UpstreamClient,
        ready: int, meter: UsageMeter, admission: Admission,
    ) -> None:
        self.call = call
        self.tenant = tenant
        self.info = info
        self.target = target
        self.body = body  # as sent upstream (a stream's asks for usage)
        self.labels = labels
        self.trace = trace
        self.releases = releases
        self.upstream = upstream
        self.ready = ready  # ready replicas when resolved (admission's queue-length hint)
        self.meter = meter
        self.admission = admission
        self.lease: Lease | None = None
        self.ticket: Ticket | None = None
        self.stream: StreamUsage | None = None
        self.on_usage: Callable[[Usage], None] | None = None  # the route's (the policy learns from the engine's usage)

    def account(self, usage: Usage | None) -> None:
        """End the request's accounting: usage to the meter (and metrics) and to the routing
        policy (its route's ``on_usage``), the token budget settled, the admission slot freed.
        Runs once; later calls do nothing."""
        ticket = self.ticket
        self.ticket = None
        if ticket is None:
            return
        ticket.release()
        self.meter.record(self.tenant.name, self.info.model, usage)
        if usage is not None:
            if self.on_usage is not None:
                self.on_usage(usage)
            ticket.settle(usage.total)
            metrics = self.admission.metrics
            if metrics is not None:
                metrics.usage(self.tenant.name, self.info.model, usage.prompt_tokens, usage.completion_tokens,
                              usage.cached_tokens)


# The member _ask_for_usage puts first in a streamed request's JSON object.
_INCLUDE_USAGE_MEMBER = b'"stream_options":{"include_usage":true},'


def _ask_for_usage(parsed: Mapping[str, Any], body: bytes) -> tuple[bytes, bool]:
    """Return the body to send for a stream, with ``stream_options.include_usage`` set, and
    whether the usage chunk must be stripped (the client did not ask for it)."""
    options = parsed.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return body, False
    if "stream_options" not in parsed and parsed:
        # The common case, spliced in front of the client's own members instead of
        # serializing the whole body again (40 us for a 15 kB prompt, growing with it).
        # Only for a UTF-8 body that is a JSON object ("{" first): json.loads also takes
        # UTF-16 and UTF-32, and a byte-order mark, which the splice would corrupt.
        start = len(body) - len(body.lstrip(b" \t\r\n"))
        if body[start:start + 1] == b"{":
            return body[:start + 1] + _INCLUDE_USAGE_MEMBER + body[start + 1:], True
    changed = dict(parsed)
    changed["stream_options"] = {**options, "include_usage": True} if isinstance(options, dict) else {
        "include_usage": True
    }
    return json.dumps(changed).encode(), True


class _StreamRelay:
    """An engine's event stream on its way to the client (a
    :class:`~llmgw.router.http.forward.StreamedBody`).

    :meth:`pump` relays the upstream body piece by piece as it arrives: read (under the
    deadlines), note the first token, watch for usage, hand to the sink (the response's
    head with the first piece when it came with the engine's head). Past the first piece
    the pieces that need no waiting are relayed by ``hub``
    (:mod:`~llmgw.router.http.relayhub`), the rest here. At the end, however it ends, the
    request's lease is released, ``upstream`` closed and the request accounted
    (:meth:`aclose` does the same if the pump never ran); then the last piece is returned,
    to go out with the response's end.

    If the replica breaks the stream (closes it early, goes silent past the read
    deadline), or the stopping gateway cuts it (the reader raises StreamCut: its shutdown
    grace ran out), the client gets one final SSE event ``data: {"error": {...}}`` (which
    OpenAI clients raise as an error) and the stream's end instead of a silently truncated
    answer. Cancellation (client gone) closes the upstream connection and propagates.
    """

    __slots__ = ("_upstream", "_forwarded", "_reader", "_hub", "_send", "_closed")

    def __init__(self, upstream: H1Response, forwarded: _Request, reader: BodyReader, hub: RelayHub) -> None:
        self._upstream = upstream
        self._forwarded = forwarded
        self._reader = reader
        self._hub = hub
        self._send: Callable[[bytes], Awaitable[None] | None] | None = None
        self._closed = False

    def _forward(self, piece: bytes) -> Awaitable[None] | None:
        """Pass ``piece`` on (what the usage watch lets through); return None once sent, else
        the awaitable that sends the rest."""
        out = self._forwarded.stream.feed(piece)  # type: ignore[union-attr]
        return self._send(out) if out else None  # type: ignore[misc]

    async def pump(self, sink: BodySink) -> bytes:
        forwarded = self._forwarded
        watch = forwarded.stream
        assert watch is not None  # set when admitted, or by _relay for an unasked-for stream
        reader = self._reader
        self._send = sink.send_piece
        forward = self._forward
        hub = self._hub
        try:
            try:
                if not reader.has_buffered():  # the first piece is not here yet: the head goes alone
                    pending = sink.flush()
                    if pending is not None:
                        await pending
                piece = await reader.next()  # an engine's first piece follows its prefill
                if piece and not reader.ended:
                    # The head goes with the first piece, or now if the watch held it back.
                    pending = forward(piece) or sink.flush()
                    # The prefill accounted once the client has its first event (the ledger's
                    # TTFT is then a few microseconds longer, not the client's).
                    self._first_token()
                    while True:
                        if pending is None:  # the sink sends at once: the hub may relay what follows
                            await reader.via_hub(hub, forward)
                        else:  # the client has no room now, or the sink is the ASGI send's
                            await pending
                        piece = await reader.next()
                        if not piece or reader.ended:
                            break
                        pending = forward(piece)
                elif piece:  # the first piece is also the last
                    self._first_token()
            except httpx.TimeoutException as error:
                failure = errors.upstream_timeout(forwarded.info.model, describe_error(error))
            except httpx.HTTPError as error:
                failure = errors.upstream_failed(forwarded.info.model, describe_error(error))
            except StreamCut:
                failure = errors.shutting_down(forwarded.info.model)
            else:
                failure = None
            # The last piece (often the usage and [DONE]) waits for the accounting below, and
            # goes out with the response's end.
            last = watch.feed(piece) if failure is None and piece else b""
            last += watch.flush()
            if failure is not None:
                log.warning("request %s: stream ended early: %s", forwarded.call.request_id, failure.message)
                last += b"data: " + json.dumps(failure.body()).encode() + b"\n\n"
        finally:
            await self.aclose()
        return last

    def _first_token(self) -> None:
        """The replica's first token has come: its prefill leaves the lease's ledger (once)."""
        lease = self._forwarded.lease
        if lease is not None:
            lease.first_token()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._send = None  # the sink reaches back to the request
        self._reader.close()
        forwarded = self._forwarded
        lease = forwarded.lease
        if lease is not None:
            lease.release()
        forwarded.account(forwarded.stream.usage if forwarded.stream is not None else None)
        await close_quietly(self._upstream)


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


def _request_id() -> str | None:
    """Return the current Quart request's id, given by :class:`~llmgw.router.http.forward.FastForward`."""
    extensions = request.scope.get("extensions")
    return extensions.get(REQUEST_ID_KEY) if extensions is not None else None


async def _served_by_fast_forward() -> Response:
    """The Quart view of the forwarded paths, there only for Quart's 405 on other methods.

    :class:`~llmgw.router.http.forward.FastForward` serves every POST on these paths
    before Quart sees it; reaching this view is a bug (answered 500).
    """
    raise RuntimeError("a forwarded POST reached Quart: the FastForward middleware is missing")


def leader_state(leading: bool, leader: str, epoch: int) -> dict[str, Any]:
    """Returns the body of ``GET /leader``: whether this control plane leads, who does
    ("" while unknown) and at which epoch."""
    return {"leading": leading, "leader": leader, "epoch": epoch}


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
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
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
