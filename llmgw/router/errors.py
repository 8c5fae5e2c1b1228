"""OpenAI-shaped errors for the gateway.

Every error the gateway produces reaches the client as JSON in OpenAI's shape::

    {"error": {"message": "...", "type": "...", "param": null, "code": "..."}}

so that OpenAI client libraries raise their usual typed exceptions (``NotFoundError``,
``BadRequestError``, ...) with a readable message. Views raise :class:`GatewayError`; the
app's error handlers turn it (and anything unexpected) into a response with
:func:`llmgw.router.app.error_response`. Nothing here does I/O.
"""

from __future__ import annotations

from typing import Mapping

import attrs

# Seconds a client is told to wait (Retry-After) when no replica of a model can take the
# request. Replicas take seconds to minutes to become ready; 5 s keeps clients polling
# gently without making them wait long once one is up.
NO_REPLICA_RETRY_AFTER_S = 5

# Seconds a client is told to wait when every replica it was routed to refused the
# connection: usually a replica that just died and the control plane has not yet taken
# out of the table, which takes about a heartbeat.
UNREACHABLE_RETRY_AFTER_S = 2


# Characters of a client's own value (a model name, a 'lora' entry) quoted back in an
# error message: enough to recognise it, bounded so that a megabyte of input is not sent
# back (or logged) whole.
MAX_ECHO_CHARS = 200

# Characters of any error message: a bound for text the gateway did not write itself (an
# engine's words in an upstream error), well above every message written here.
MAX_MESSAGE_CHARS = 2000

_ELLIPSIS = "..."


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - len(_ELLIPSIS)] + _ELLIPSIS


def echo(value: object) -> str:
    """Returns ``value`` as quoted back to a client: a string as it is, anything else as its
    ``repr``, cut to :data:`MAX_ECHO_CHARS` characters (ending in ``...`` when cut)."""
    return _cut(value if isinstance(value, str) else repr(value), MAX_ECHO_CHARS)


def _bounded_message(message: str) -> str:
    return _cut(message, MAX_MESSAGE_CHARS)


@attrs.frozen
class GatewayError(Exception):
    """An error that becomes an OpenAI-shaped JSON response.

    ``status`` is the HTTP status; ``type``/``code``/``param``/``message`` fill the
    ``error`` object; ``headers`` are added to the response (e.g. Retry-After).
    ``message`` is cut to :data:`MAX_MESSAGE_CHARS`; values a client sent are quoted with
    :func:`echo`.
    """

    status: int
    message: str = attrs.field(converter=_bounded_message)
    type: str
    code: str | None = None
    param: str | None = None
    headers: Mapping[str, str] = attrs.field(factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.code or self.type}: {self.message}"

    def body(self) -> dict[str, object]:
        """Return the JSON-able ``{"error": {...}}`` object for this error."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> GatewayError:
    """400: the request body cannot be routed (bad JSON, missing or wrong ``model``)."""
    return GatewayError(400, message, "invalid_request_error", code=code, param=param)


def model_not_found(model: str) -> GatewayError:
    """404: ``model`` is neither a catalog model nor an adapter of one (they share a namespace)."""
    return GatewayError(
        404,
        f"The model or adapter '{echo(model)}' does not exist in this cluster's catalog. "
        "GET /v1/models lists the models and adapters you can use.",
        "invalid_request_error",
        code="model_not_found",
        param="model",
    )


def no_ready_replica(model: str) -> GatewayError:
    """503 with Retry-After: ``model`` is in the catalog but no replica of it is ready."""
    return GatewayError(
        503,
        f"The model '{model}' has no ready replica right now (starting, restarting or "
        f"stopped). Retry in {NO_REPLICA_RETRY_AFTER_S} seconds; an operator can check "
        "its replicas with `llmgw ctl replicas`.",
        "service_unavailable",
        code="no_ready_replica",
        headers={"Retry-After": str(NO_REPLICA_RETRY_AFTER_S)},
    )


def adapter_not_served(adapter: str, model: str) -> GatewayError:
    """503 with Retry-After: ``model`` has ready replicas, but none lists ``adapter`` yet."""
    return GatewayError(
        503,
        f"No ready replica of '{model}' has the adapter '{adapter}' yet (nodes fetch adapters "
        f"with the weights). Retry in {NO_REPLICA_RETRY_AFTER_S} seconds; an operator can check "
        "the replicas with `llmgw ctl replicas`.",
        "service_unavailable",
        code="no_ready_replica",
        headers={"Retry-After": str(NO_REPLICA_RETRY_AFTER_S)},
    )


def adapter_load_failed(adapter: str, replica: str, detail: str) -> GatewayError:
    """503 with Retry-After: the replica chosen for ``adapter`` could not load it; ``detail``
    carries the engine's own words."""
    return GatewayError(
        503,
        f"Replica {replica} could not load the adapter '{adapter}': {detail}",
        "service_unavailable",
        code="adapter_load_failed",
        headers={"Retry-After": str(NO_REPLICA_RETRY_AFTER_S)},
    )


def adapter_capacity(adapter: str, replica: str, loaded: int, waited_s: float) -> GatewayError:
    """503 with Retry-After: every adapter slot of the chosen replica stayed busy."""
    return GatewayError(
        503,
        f"Replica {replica} holds its {loaded} adapters, each with requests in flight, and none "
        f"became idle within {waited_s:g}s to make room for '{adapter}'. Retry in "
        f"{NO_REPLICA_RETRY_AFTER_S} seconds; an operator can raise the model's "
        "max_loaded_adapters or its replicas.",
        "service_unavailable",
        code="adapter_capacity",
        headers={"Retry-After": str(NO_REPLICA_RETRY_AFTER_S)},
    )


def replicas_unreachable(model: str, tried: int) -> GatewayError:
    """503 with Retry-After: every replica tried for ``model`` refused or timed out the connection."""
    return GatewayError(
        503,
        f"Could not connect to any replica of '{model}' ({tried} tried). "
        f"Retry in {UNREACHABLE_RETRY_AFTER_S} seconds.",
        "service_unavailable",
        code="replica_unreachable",
        headers={"Retry-After": str(UNREACHABLE_RETRY_AFTER_S)},
    )


def upstream_failed(model: str, detail: str) -> GatewayError:
    """502: the replica accepted the request but broke the exchange (closed, bad HTTP)."""
    return GatewayError(
        502,
        f"The replica serving '{model}' failed while answering: {detail}",
        "upstream_error",
        code="upstream_failed",
    )


def upstream_timeout(model: str, detail: str) -> GatewayError:
    """504: the replica accepted the request but went silent past the read deadline."""
    return GatewayError(
        504,
        f"The replica serving '{model}' did not answer in time: {detail}",
        "upstream_error",
        code="upstream_timeout",
    )


def shutting_down(model: str) -> GatewayError:
    """503: the gateway is stopping and its shutdown grace ran out while this answer streamed."""
    return GatewayError(
        503,
        f"The gateway is shutting down and ended this answer from '{model}' before it was complete; "
        "retry the request.",
        "service_unavailable",
        code="server_shutting_down",
    )


def http_error(status: int, message: str) -> GatewayError:
    """A routing-level HTTP error (unknown path, wrong method, body too large)."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return GatewayError(status, message, kind)


def internal_error(request_id: str | None) -> GatewayError:
    """500: a bug in the gateway; the message points the operator at the log line."""
    where = f" (request id {request_id})" if request_id else ""
    return GatewayError(
        500,
        f"The gateway hit an internal error{where}; the server log has the traceback.",
        "server_error",
        code="internal_error",
    )
