"""An ASGI middleware the agent adds to vLLM's API server: every path but the liveness checks
needs the shard's secret.

vLLM checks its own key (``VLLM_API_KEY``) only under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``; ``/invocations`` (SageMaker's door to the same completions), ``/tokenize``,
``/pooling``, ``/classify``, ``/score``, ``/rerank`` and the rest would answer anyone who reaches
the port. This module runs inside vLLM's own interpreter (the agent puts only this directory
on its ``PYTHONPATH`` and passes ``--middleware llmgw_vllm_guard.Guard``), so it imports
nothing but the standard library. It reads the secret from ``VLLM_API_KEY``, never from the
command line; without one it lets everything through, as vLLM does.
"""

from __future__ import annotations

import hmac
import os
from typing import Any, Awaitable, Callable

#: The variable the secret comes in (the one vLLM's own check reads too).
API_KEY_ENV = "VLLM_API_KEY"
#: Paths answered without the secret: vLLM's liveness checks (the agent polls /health).
OPEN_PATHS = frozenset({"/health", "/ping"})
#: The refusal, in OpenAI's shape; it never echoes what the caller sent.
UNAUTHORIZED_BODY = (
    b'{"error":{"message":"Incorrect API key provided: send the engine\'s key as '
    b'\'Authorization: Bearer <key>\'.","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}'
)
#: WebSocket close code for a refused handshake (policy violation).
WS_POLICY_VIOLATION = 1008
_BEARER = b"bearer "

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def authorized(scope: Scope, key: bytes) -> bool:
    """Return whether the request in ``scope`` carries ``Authorization: Bearer <key>``
    (constant-time compare; the scheme's case does not matter)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            if value[: len(_BEARER)].lower() != _BEARER:
                return False
            return hmac.compare_digest(value[len(_BEARER):].strip(), key)
    return False


class Guard:
    """Pure ASGI middleware (no per-request overhead beyond a header scan): refuses with 401
    every HTTP request, and closes every WebSocket, that lacks the secret, except
    :data:`OPEN_PATHS` and CORS preflights (``OPTIONS``, as vLLM's own check allows)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.key = os.environ.get(API_KEY_ENV, "").encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            not self.key
            or scope["type"] not in ("http", "websocket")
            or scope.get("method") == "OPTIONS"
            or scope.get("path") in OPEN_PATHS
            or authorized(scope, self.key)
        ):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION})
            return
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(UNAUTHORIZED_BODY)).encode())],
        })
        await send({"type": "http.response.body", "body": UNAUTHORIZED_BODY})
