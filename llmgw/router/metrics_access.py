"""Who may read ``/metrics`` (tenant names are in it), and its own listener.

:class:`MetricsAccess` is the rule for one listener, made from ``server.yaml``'s
``metrics:`` section (docs/config.md):

- ``metrics.listen`` set: ``/metrics`` is served there only (:func:`serve_metrics`); the
  gateway port answers 404 for it.
- ``metrics.token`` set: every ``/metrics`` request needs ``Authorization: Bearer <token>``
  (compared in constant time), on whichever listener serves it; 401 without it.
- neither, with ``auth.enabled``: the gateway port serves ``/metrics`` to loopback clients
  only (403 for others), so a gateway open to tenants does not show them each other.
- neither, auth off (loopback demos): served to anyone, as before.

:class:`MetricsGate` applies a rule in front of an ASGI app; refusals are OpenAI-shaped
JSON errors, like every other gateway error.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Awaitable, Callable

import attrs
import trio

from llmgw.config import MetricsConfig
from llmgw.config.values import is_loopback_host

from . import errors
from .errors import GatewayError
from .http.extensions import REQUEST_ID_KEY
from .http.serve import serve_gateway

__all__ = ["METRICS_PATH", "MetricsAccess", "MetricsGate", "metrics_app", "serve_metrics", "metrics_listener"]

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"

#: Seconds a scrape on the metrics listener may wait for its body (a worker pool merges
#: every worker's samples; Prometheus' own default scrape timeout is 10 s).
SCRAPE_TIMEOUT_S = 8.0

_EXPOSITION = b"text/plain; version=0.0.4; charset=utf-8"

#: Returns the Prometheus text exposition, or None when it could not be had in time.
Scrape = Callable[[], Awaitable["bytes | None"]]


@attrs.frozen
class MetricsAccess:
    """The rule for ``/metrics`` on one listener (see the module docstring)."""

    #: False: this listener does not serve /metrics (it moved to ``metrics.listen``).
    served: bool = True
    #: Required as ``Authorization: Bearer``; empty: no token needed.
    token: bytes = attrs.field(default=b"", repr=False)
    #: Only clients on a loopback address are served.
    loopback_only: bool = False

    @classmethod
    def on_gateway(cls, config: MetricsConfig, auth_enabled: bool) -> MetricsAccess:
        """The rule on the gateway's own port for ``config`` (with ``auth.enabled`` or not)."""
        if config.listen is not None:
            return cls(served=False)
        return cls(token=config.token.encode(), loopback_only=auth_enabled and not config.token)

    @classmethod
    def on_listener(cls, config: MetricsConfig) -> MetricsAccess:
        """The rule on ``metrics.listen``: the token if one is set (the address is the operator's choice)."""
        return cls(token=config.token.encode())

    def refusal(self, scope: dict[str, Any]) -> GatewayError | None:
        """Returns why the HTTP request ``scope`` may not read /metrics here, or None if it may."""
        if not self.served:
            return errors.http_error(
                404, "No such endpoint: GET /metrics. Metrics are served on their own address (metrics.listen)."
            )
        if self.token and not hmac.compare_digest(_bearer(scope), self.token):
            return GatewayError(
                401, "/metrics needs the metrics token: send 'Authorization: Bearer <metrics.token>'.",
                "invalid_request_error", code="invalid_metrics_token",
                headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
            )
        if self.loopback_only and not _from_loopback(scope):
            return GatewayError(
                403, "/metrics is served to loopback clients only while auth is enabled; the operator can "
                "set metrics.token or metrics.listen in server.yaml.", "invalid_request_error",
                code="metrics_forbidden",
            )
        return None


def _bearer(scope: dict[str, Any]) -> bytes:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            scheme, _, token = bytes(value).strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""


def _from_loopback(scope: dict[str, Any]) -> bool:
    client = scope.get("client")
    return bool(client) and is_loopback_host(str(client[0]))


class MetricsGate:
    """ASGI middleware: requests for ``/metrics`` that ``access`` refuses are answered here
    (JSON error, with ``x-request-id`` when the request has one); everything else goes to ``app``."""

    def __init__(self, app: Any, access: MetricsAccess) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == METRICS_PATH:
            error = self.access.refusal(scope)
            if error is not None:
                extensions = scope.get("extensions") or {}
                await _send_error(send, error, extensions.get(REQUEST_ID_KEY))
                return
        await self.app(scope, receive, send)


async def _send_error(send: Any, error: GatewayError, request_id: str | None) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(name.lower().encode("latin-1"), str(value).encode("latin-1")) for name, value in error.headers.items()]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if request_id:
        headers.append((b"x-request-id", request_id.encode("latin-1")))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def metrics_app(scrape: Scrape, access: MetricsAccess) -> Any:
    """Returns an ASGI app serving ``GET /metrics`` from ``scrape`` under ``access``;
    every other path is 404, other methods 405, ``scrape`` returning None 503."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["path"] != METRICS_PATH:
            await _send_error(send, errors.http_error(404, "This address serves GET /metrics only."), None)
            return
        if scope["method"] not in ("GET", "HEAD"):
            await _send_error(send, errors.http_error(405, "Method not allowed: /metrics answers GET."), None)
            return
        body = None
        with trio.move_on_after(SCRAPE_TIMEOUT_S):
            body = await scrape()
        if body is None:
            await _send_error(send, GatewayError(503, "The metrics were not collected in time; retry.",
                                                 "service_unavailable"), None)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", _EXPOSITION), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})

    return MetricsGate(app, access)


async def serve_metrics(
    scrape: Scrape, host: str, port: int, access: MetricsAccess,
    *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve :func:`metrics_app` on ``host``:``port`` until cancelled; reports the bound port.

    Raises ``OSError`` (before started) if the address cannot be bound.
    """
    await serve_gateway(metrics_app(scrape, access), host, port, task_status=task_status)


async def metrics_listener(
    scrape: Scrape, config: MetricsConfig, *, task_status: trio.TaskStatus[int | None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``/metrics`` on ``config.listen`` (``metrics:`` of server.yaml) until cancelled,
    for ``nursery.start``: reports the bound port, or None (and returns) when
    ``config.listen`` is not set (then the gateway port serves it).

    Raises ``OSError`` (before started) if the address cannot be bound.
    """
    if config.listen is None:
        task_status.started(None)
        return
    host = config.listen.host
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, scrape, host, config.listen.port, MetricsAccess.on_listener(config))
        log.info("metrics on %s:%d (token %s)", host, port, "required" if config.token else "not required")
        if not config.token and not is_loopback_host(host):
            log.warning("metrics on %s:%d need no token: anyone who reaches that address reads tenant and model "
                        "names; set metrics.token_file unless only the scraper can reach it", host, port)
        task_status.started(port)
