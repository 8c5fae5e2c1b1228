"""The gateway's sections of ``server.yaml``: ``gateway:``, ``tracing:``, ``auth:``,
``serving:``, ``routing:`` and ``metrics:``.

Each section is a frozen attrs class whose defaults come from :mod:`.defaults` (so a
gateway built without a file, e.g. in a worker process or a test, gets the same values),
and a ``read_*`` function that builds it from a :class:`~.yaml_reader.Section`.
"""

from __future__ import annotations

import logging
import urllib.parse
from typing import Any

import attrs

from . import defaults
from .values import Address, count, parse_address, parse_bool, parse_duration, parse_ratio, parse_str, positive, show
from .yaml_reader import MISSING, Reader

log = logging.getLogger(__name__)

#: ``routing:`` keys of earlier releases, accepted with a warning so that an old server.yaml
#: still starts: the load gate they tuned is gone (llmgw/router/prefillcost.py replaced it).
RETIRED_ROUTING_KEYS = ("load_gate_min", "load_gate_share")

__all__ = [
    "ROUTING_POLICIES",
    "AuthConfig",
    "GatewayConfig",
    "MIN_METRICS_TOKEN_CHARS",
    "MetricsConfig",
    "RoutingConfig",
    "ServingConfig",
    "TracingConfig",
    "read_auth",
    "read_gateway",
    "read_metrics",
    "read_routing",
    "read_serving",
    "read_tracing",
]

#: The values of ``routing.policy`` (docs/gateway.md).
ROUTING_POLICIES = ("kv", "least-load", "round-robin")


@attrs.frozen
class GatewayConfig:
    """``gateway:``: how the gateway talks to engine replicas (deadlines, in seconds)."""

    connect_timeout: float = defaults.DEFAULT_UPSTREAM_CONNECT_TIMEOUT
    first_byte_timeout: float = defaults.DEFAULT_UPSTREAM_FIRST_BYTE_TIMEOUT
    chunk_timeout: float = defaults.DEFAULT_UPSTREAM_CHUNK_TIMEOUT
    #: Gateway processes on the HTTP port (1: in the server process; N > 1: N worker
    #: processes with SO_REUSEPORT, fed by the control plane; docs/gateway.md).
    workers: int = defaults.DEFAULT_GATEWAY_WORKERS
    #: Seconds in-flight requests get to finish when the server stops (SIGTERM/SIGINT);
    #: streams still running then end with an SSE error event.
    shutdown_grace: float = defaults.DEFAULT_GATEWAY_SHUTDOWN_GRACE


@attrs.frozen
class TracingConfig:
    """``tracing:``: OpenTelemetry export over OTLP/HTTP; an empty endpoint turns it off."""

    endpoint: str = ""
    service_name: str = defaults.DEFAULT_TRACING_SERVICE_NAME
    sample_ratio: float = defaults.DEFAULT_TRACING_SAMPLE_RATIO


@attrs.frozen
class AuthConfig:
    """``auth:``: whether the gateway requires API keys (off only for loopback demos)."""

    enabled: bool = defaults.DEFAULT_AUTH_ENABLED


@attrs.frozen
class ServingConfig:
    """``serving:``: request size limit, per-model admission queue, usage flushing."""

    max_request_bytes: int = defaults.DEFAULT_MAX_REQUEST_BYTES
    max_inflight_per_replica: int = defaults.DEFAULT_MAX_INFLIGHT_PER_REPLICA
    queue_size: int = defaults.DEFAULT_QUEUE_SIZE
    queue_timeout: float = defaults.DEFAULT_QUEUE_TIMEOUT
    usage_flush_interval: float = defaults.DEFAULT_USAGE_FLUSH_INTERVAL


@attrs.frozen
class RoutingConfig:
    """``routing:``: how the gateway picks a replica (KV-cache aware by default)."""

    policy: str = defaults.DEFAULT_ROUTING_POLICY
    unconfirmed_ttl: float = defaults.DEFAULT_UNCONFIRMED_TTL
    tokenize_timeout: float = defaults.DEFAULT_TOKENIZE_TIMEOUT
    agreement_window: float = defaults.DEFAULT_AGREEMENT_WINDOW
    mismatch_alarm_after: int = defaults.DEFAULT_MISMATCH_ALARM_AFTER


#: Shortest ``metrics.token`` accepted: a bearer token is guessed online, so it must be long
#: enough that guessing is hopeless (16 random characters; ``openssl rand -hex 32`` gives 64).
MIN_METRICS_TOKEN_CHARS = 16


@attrs.frozen
class MetricsConfig:
    """``metrics:``: where ``/metrics`` is served and who may read it (docs/config.md).

    ``listen`` None serves it on the gateway port; then, with ``auth.enabled`` and no
    ``token``, only to loopback clients (tenant names are in it). ``token`` (from
    ``token`` or ``token_file``), when set, is required as ``Authorization: Bearer``.
    """

    listen: Address | None = None
    token: str = attrs.field(default="", repr=False)


def _parse_token(value: Any) -> str:
    token = parse_str(value).strip()
    if len(token) < MIN_METRICS_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(
            f"expected at least {MIN_METRICS_TOKEN_CHARS} characters without spaces "
            f"(e.g. the output of `openssl rand -hex 32`), got {len(token)} characters"
        )
    return token


def read_metrics(reader: Reader, raw: Any) -> MetricsConfig:
    """``metrics:`` from its raw value (:data:`MISSING`: on the gateway port, no token).

    ``token_file`` is read here (blocking, once at start-up); its text never appears in
    an error message.
    """
    if raw is MISSING:
        return MetricsConfig()
    section = reader.section(raw, "metrics")
    listen = section.get("listen", lambda v: parse_address(v, listen=True), None)
    token = section.get("token", _parse_token, "")
    token_file = section.get_path("token_file", None)  # type: ignore[arg-type]
    section.finish()
    if token_file is not None:
        if token:
            raise reader.error("metrics", "give token or token_file, not both")
        try:
            text = token_file.read_text(encoding="utf-8")
        except (OSError, UnicodeError) as exc:
            raise reader.error("metrics.token_file", f"cannot read {token_file}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            token = _parse_token(text)
        except ValueError as exc:
            raise reader.error("metrics.token_file", f"{token_file}: {exc}") from None
    return MetricsConfig(listen=listen, token=token)


def read_gateway(reader: Reader, raw: Any) -> GatewayConfig:
    """``gateway:`` from its raw value (:data:`MISSING`: all defaults)."""
    if raw is MISSING:
        return GatewayConfig()
    section = reader.section(raw, "gateway")
    seconds = positive(parse_duration)
    config = GatewayConfig(
        connect_timeout=section.get("connect_timeout", seconds, defaults.DEFAULT_UPSTREAM_CONNECT_TIMEOUT),
        first_byte_timeout=section.get("first_byte_timeout", seconds,
                                       defaults.DEFAULT_UPSTREAM_FIRST_BYTE_TIMEOUT),
        chunk_timeout=section.get("chunk_timeout", seconds, defaults.DEFAULT_UPSTREAM_CHUNK_TIMEOUT),
        workers=section.get("workers", count(1), defaults.DEFAULT_GATEWAY_WORKERS),
        shutdown_grace=section.get("shutdown_grace", parse_duration, defaults.DEFAULT_GATEWAY_SHUTDOWN_GRACE),
    )
    section.finish()
    return config


def _parse_otlp_endpoint(value: Any) -> str:
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise ValueError(f"expected an http(s) URL or empty, got {show(value)}")
    parsed = urllib.parse.urlsplit(value.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(
            f"expected the http(s) URL of an OTLP/HTTP collector, e.g. \"http://collector:4318\", "
            f"got {show(value)}"
        )
    return value.strip()


def read_tracing(reader: Reader, raw: Any) -> TracingConfig:
    """``tracing:`` from its raw value (:data:`MISSING`: all defaults, tracing off)."""
    if raw is MISSING:
        return TracingConfig()
    section = reader.section(raw, "tracing")
    config = TracingConfig(
        endpoint=section.get("endpoint", _parse_otlp_endpoint, ""),
        service_name=section.get("service_name", parse_str, defaults.DEFAULT_TRACING_SERVICE_NAME),
        sample_ratio=section.get("sample_ratio", parse_ratio, defaults.DEFAULT_TRACING_SAMPLE_RATIO),
    )
    section.finish()
    return config


def read_auth(reader: Reader, raw: Any) -> AuthConfig:
    """``auth:`` from its raw value (:data:`MISSING`: all defaults)."""
    if raw is MISSING:
        return AuthConfig()
    section = reader.section(raw, "auth")
    config = AuthConfig(enabled=section.get("enabled", parse_bool, defaults.DEFAULT_AUTH_ENABLED))
    section.finish()
    return config


def read_serving(reader: Reader, raw: Any) -> ServingConfig:
    """``serving:`` from its raw value (:data:`MISSING`: all defaults)."""
    if raw is MISSING:
        return ServingConfig()
    section = reader.section(raw, "serving")
    seconds = positive(parse_duration)
    config = ServingConfig(
        max_request_bytes=section.get("max_request_bytes", count(1), defaults.DEFAULT_MAX_REQUEST_BYTES),
        max_inflight_per_replica=section.get("max_inflight_per_replica", count(1),
                                             defaults.DEFAULT_MAX_INFLIGHT_PER_REPLICA),
        queue_size=section.get("queue_size", count(0), defaults.DEFAULT_QUEUE_SIZE),
        queue_timeout=section.get("queue_timeout", seconds, defaults.DEFAULT_QUEUE_TIMEOUT),
        usage_flush_interval=section.get("usage_flush_interval", seconds,
                                         defaults.DEFAULT_USAGE_FLUSH_INTERVAL),
    )
    section.finish()
    return config


def _parse_policy(value: Any) -> str:
    if value not in ROUTING_POLICIES:
        raise ValueError(f"expected one of {', '.join(ROUTING_POLICIES)}, got {show(value)}")
    return str(value)


def read_routing(reader: Reader, raw: Any) -> RoutingConfig:
    """``routing:`` from its raw value (:data:`MISSING`: all defaults)."""
    if raw is MISSING:
        return RoutingConfig()
    section = reader.section(raw, "routing")
    seconds = positive(parse_duration)
    config = RoutingConfig(
        policy=section.get("policy", _parse_policy, defaults.DEFAULT_ROUTING_POLICY),
        unconfirmed_ttl=section.get("unconfirmed_ttl", seconds, defaults.DEFAULT_UNCONFIRMED_TTL),
        tokenize_timeout=section.get("tokenize_timeout", seconds, defaults.DEFAULT_TOKENIZE_TIMEOUT),
        agreement_window=section.get("agreement_window", seconds, defaults.DEFAULT_AGREEMENT_WINDOW),
        mismatch_alarm_after=section.get("mismatch_alarm_after", count(1),
                                         defaults.DEFAULT_MISMATCH_ALARM_AFTER),
    )
    for key in RETIRED_ROUTING_KEYS:
        if section.raw(key) is not MISSING:
            log.warning("%s: routing.%s is no longer used (the gateway prices each replica by its predicted "
                        "time to first token instead of gating on requests in flight; docs/gateway.md): "
                        "remove it", reader.source, key)
    section.finish()
    return config
