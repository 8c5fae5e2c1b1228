"""An ASGI middleware the agent adds to vLLM's API server: every path but the liveness checks
needs the shard's secret.

vLLM checks its own key (``VLLM_API_KEY``) only under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``; ``/invocations`` (SageMaker's door to the same completions), ``/tokenize``,
``/pooling``, ``/classify``, ``/score``, ``/rerank`` and the rest would answer anyone who reaches
the port. It also answers ``GET /llmgw/tokenizer`` (:data:`TOKENIZER_PATH`, behind the same
secret) with the model's tokenizer files, so the gateway can tokenize prompts itself
(llmgw/hftokenizer.py) instead of calling ``/tokenize`` per request. This module
runs inside vLLM's own interpreter (the agent puts only this directory
on its ``PYTHONPATH`` and passes ``--middleware llmgw_vllm_guard.Guard``), so it imports
nothing but the standard library. It reads the secret from ``VLLM_API_KEY``, never from the
command line; without one it lets everything through, as vLLM does.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any, Awaitable, Callable

try:
    import llmgw_undumpable  # beside this module on the engine path
except ImportError:  # imported as part of the llmgw package (its tests)
    from . import llmgw_undumpable

# vLLM's API server imports this module as it builds its app: from then on its environment
# (the secret) is unreadable to the other engines of the engines' user.
llmgw_undumpable.apply()

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
#: Where the gateway fetches the model's tokenizer files.
TOKENIZER_PATH = "/llmgw/tokenizer"
#: The variable naming the model's directory (the agent sets it to the weights it fetched).
TOKENIZER_DIR_ENV = "LLMGW_TOKENIZER_DIR"
#: The files served, when present (llmgw.hftokenizer.TOKENIZER_FILES; kept in step by a test).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")
#: Largest file served (bytes); the biggest tokenizer.json files in use are ~35 MB.
MAX_TOKENIZER_FILE = 64 * 1024 * 1024

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
        if scope["type"] == "http" and scope.get("path") == TOKENIZER_PATH and scope.get("method") == "GET":
            if not self.key or authorized(scope, self.key):
                status, body = tokenizer_files(os.environ.get(TOKENIZER_DIR_ENV, ""))
                await _send_json(send, status, body)
                return
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
        await _send_json(send, 401, UNAUTHORIZED_BODY)


def tokenizer_files(directory: str) -> tuple[int, bytes]:
    """Return (status, JSON body) for ``GET /llmgw/tokenizer``: ``{"files": {name: text}}`` of
    the :data:`TOKENIZER_FILES` in ``directory``; 404 when it holds no tokenizer.json (or no
    directory was named), 500 when a file cannot be read or is too large."""
    if not directory or not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return 404, json.dumps({"error": {"message": "this engine serves no tokenizer files"}}).encode()
    files = {}
    try:
        for name in TOKENIZER_FILES:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                continue
            if os.path.getsize(path) > MAX_TOKENIZER_FILE:
                raise OSError(f"{name} is over {MAX_TOKENIZER_FILE} bytes")
            with open(path, encoding="utf-8") as f:
                files[name] = f.read()
    except (OSError, UnicodeDecodeError) as error:
        return 500, json.dumps({"error": {"message": f"cannot read the tokenizer files: {error}"}}).encode()
    return 200, json.dumps({"files": files}).encode()


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    })
    await send({"type": "http.response.body", "body": body})
