"""``/api/v1/*`` on the gateway's port: the HTTP admin API, as the gateway carries it.

The gateway does not know the control plane: it hands each request, as an
:class:`ApiRequest`, to the handler the control plane set
(:meth:`~llmgw.router.interface.GatewayInterface.set_admin_api`;
llmgw/control/http_api.py answers it) and writes back the :class:`ApiResponse` as JSON.
With no handler set (a gateway without a control plane) the API does not exist: 404. A
worker process of a pool forwards the request to the control plane's process over its
channel (llmgw/router/workers/).
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

import attrs

#: Where the admin API lives on the gateway's HTTP port.
ADMIN_API_PREFIX = "/api/v1/"
#: The methods it answers.
ADMIN_API_METHODS = ("GET", "PUT", "POST", "DELETE")


@attrs.frozen
class ApiRequest:
    """One admin API call: ``path`` is below :data:`ADMIN_API_PREFIX` (``settings/routing``)."""

    method: str
    path: str
    authorization: str = ""
    body: bytes = b""


@attrs.frozen
class ApiResponse:
    """What the admin API answers: a status and a JSON-able payload."""

    status: int
    payload: Any


#: The control plane's answer to admin API calls.
AdminApiHandler = Callable[[ApiRequest], Awaitable[ApiResponse]]


def api_error(status: int, message: str, code: str) -> ApiResponse:
    """Returns an error answer: ``{"error": {"message", "code"}}`` with ``status``."""
    return ApiResponse(status, {"error": {"message": message, "code": code}})


NO_ADMIN_API = api_error(404, "this gateway has no admin API (it runs without a control plane)", "not_found")


def encode_response(response: ApiResponse) -> bytes:
    """Returns ``response``'s payload as the JSON body (UTF-8, compact)."""
    return json.dumps(response.payload, separators=(",", ":")).encode()
