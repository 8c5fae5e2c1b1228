"""The gateway's hot path without Quart: forwarded POSTs handled as raw ASGI.

Quart's request machinery (request and app contexts, routing, the Response model, hooks)
costs about twice as much CPU per request as the whole rest of a proxied request (Hypercorn
plus the hop to the engine), and a gateway is all hot path. :class:`FastForward` sits
in front of the Quart app, inside the gateway's ASGI middlewares (metrics, request
cleanup), and handles ``POST`` on the forwarded paths itself; everything else (other
methods, other paths, ``/metrics``, ``/v1/models``) goes to Quart unchanged.

Both paths run the same forwarding code, :meth:`llmgw.router.app.Gateway.forward`, with
the request described by a :class:`ForwardCall`, so auth, admission, routing, retries,
usage accounting and the error shapes cannot drift apart. What this module adds is only
what Quart did around the view: the request id, reading the body under a size limit and
a deadline, cancelling the request when the client disconnects, and turning the result
or a :class:`~llmgw.router.errors.GatewayError` into ASGI messages.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import secrets
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Mapping

import trio

from . import errors
from .admission import request_too_large
from .errors import GatewayError
from .h1fastlane import WHOLE_BODY_KEY
from .hypercorn_fast import ON_CLOSE_KEY

if TYPE_CHECKING:
    from .app import Gateway

log = logging.getLogger(__name__)

# A client-supplied x-request-id is kept if it looks like an id (it ends up in logs and
# upstream headers), otherwise a fresh one is generated. Same rule as the Quart path.
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")

#: What :meth:`Gateway.forward` returns: status, response headers, and the body (whole, or
#: an async iterator of chunks to relay as they come, which the caller must close).
ForwardResult = tuple[int, dict[str, str], "bytes | AsyncIterator[bytes]"]


class ForwardCall:
    """One forwarded request as :meth:`Gateway.forward` sees it, independent of Quart.

    ``headers`` maps lower-case names to values (first value of a repeated header);
    ``read_body()`` returns the whole body (raising a 413 GatewayError past the limit);
    ``max_bytes`` is the body limit (None: none);
    ``scope`` is the ASGI scope (labels and the trace live in its ``extensions``).
    """

    __slots__ = ("path", "query", "headers", "request_id", "content_length", "max_bytes", "scope", "read_body")

    def __init__(self, path: str, query: bytes, headers: Mapping[str, str], request_id: str,
                 content_length: int | None, max_bytes: int | None, scope: dict[str, Any],
                 read_body: Callable[[], Awaitable[bytes]]) -> None:
        self.path = path
        self.query = query
        self.headers = headers
        self.request_id = request_id
        self.content_length = content_length
        self.max_bytes = max_bytes
        self.scope = scope
        self.read_body = read_body


def request_id_from(given: str | None) -> str:
    """Return ``given`` if it is an acceptable request id, else a fresh one (:func:`new_request_id`)."""
    return given if given and REQUEST_ID_RE.fullmatch(given) else new_request_id()


def _new_id_prefix() -> None:
    global _id_prefix
    _id_prefix = secrets.token_hex(8)


_id_prefix = ""
_new_id_prefix()
os.register_at_fork(after_in_child=_new_id_prefix)  # a forked gateway worker must not repeat its parent's ids
_id_counter = itertools.count(1)


def new_request_id() -> str:
    """Return a fresh request id: 32 hex digits, as ``uuid4().hex`` gives.

    A random 64-bit prefix per process and a 64-bit counter: unique without a
    ``getrandom`` syscall per request, which ``uuid4`` makes (about 2% of the gateway's
    CPU per request). Request ids name requests in logs and traces; they are not secrets.
    """
    return f"{_id_prefix}{next(_id_counter):016x}"


class _ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class FastForward:
    """ASGI middleware serving ``POST`` on ``paths`` with :meth:`Gateway.forward`; the rest goes to ``inner``."""

    def __init__(self, inner: Any, gateway: Gateway, paths: tuple[str, ...], body_timeout: float) -> None:
        self._inner = inner
        self._gateway = gateway
        self._paths = frozenset(paths)
        self._body_timeout = body_timeout

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self._paths:
            await self._inner(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        request_id = request_id_from(headers.get("x-request-id"))
        try:
            content_length: int | None = int(headers["content-length"]) if "content-length" in headers else None
        except ValueError:
            content_length = None
        # The app's MAX_CONTENT_LENGTH, read per request as Quart does (it may be changed live).
        limit: int | None = self._gateway.app.config["MAX_CONTENT_LENGTH"]
        body_timeout = self._body_timeout
        # Hypercorn (as patched by hypercorn_fast, which importing llmgw.router.app installs)
        # and the fast lane call on_close when the request's stream closes: cancelling this
        # scope then does what a task waiting for http.disconnect would, without a task
        # and a nursery per request.
        with trio.CancelScope() as request_scope:
            scope.setdefault("extensions", {})[ON_CLOSE_KEY] = request_scope.cancel
            await self._serve(scope, headers, request_id, content_length, limit, body_timeout, receive, send)

    async def _serve(self, scope: dict[str, Any], headers: dict[str, str], request_id: str,
                     content_length: int | None, limit: int | None, body_timeout: float, receive: Any,
                     send: Any) -> None:
        """Read the body on demand, forward, respond (the caller's scope is cancelled by
        on_close when the client goes away)."""

        async def read_body() -> bytes:
            whole: bytes | None = scope["extensions"].get(WHOLE_BODY_KEY)
            if whole is not None:  # the fast lane read it all already: no receive, no timer
                if limit is not None and len(whole) > limit:
                    raise request_too_large(limit)
                return whole
            parts: list[bytes] = []
            size = 0
            with trio.move_on_after(body_timeout) as timer:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _ClientGone()
                    chunk = message.get("body", b"")
                    if chunk:
                        size += len(chunk)
                        if limit is not None and size > limit:
                            raise request_too_large(limit)  # the same 413 as the Quart path
                        parts.append(chunk)
                    if not message.get("more_body", False):
                        break
            if timer.cancelled_caught:
                raise errors.http_error(408, f"The request body did not arrive within {body_timeout:g}s.")
            return parts[0] if len(parts) == 1 else b"".join(parts)

        call = ForwardCall(scope["path"], scope.get("query_string", b""), headers, request_id,
                           content_length, limit, scope, read_body)
        try:
            await self._respond(call, send)
        except _ClientGone:
            pass

    async def _respond(self, call: ForwardCall, send: Any) -> None:
        """Run the forward and send its result (or its error) as ASGI messages."""
        try:
            status, headers, content = await self._gateway.forward(call)
        except GatewayError as error:
            await _send_error(send, error, call.request_id)
            return
        except _ClientGone:
            raise
        except Exception as error:  # a bug: answer 500 in OpenAI's shape, log the trace
            log.error("gateway request %s failed", call.request_id, exc_info=error)
            await _send_error(send, errors.internal_error(call.request_id), call.request_id)
            return
        headers.setdefault("x-request-id", call.request_id)
        if isinstance(content, (bytes, bytearray)):
            headers["content-length"] = str(len(content))
            await send({"type": "http.response.start", "status": status, "headers": _encode(headers)})
            await send({"type": "http.response.body", "body": bytes(content)})
            return
        try:
            await send({"type": "http.response.start", "status": status, "headers": _encode(headers)})
            async for chunk in content:
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            aclose = getattr(content, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()


def _encode(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]


async def _send_error(send: Any, error: GatewayError, request_id: str) -> None:
    """Send ``error`` as an OpenAI-shaped JSON response with its headers and ``x-request-id``."""
    body = json.dumps(error.body()).encode()
    headers = {name.lower(): str(value) for name, value in dict(error.headers).items()}
    headers["content-type"] = "application/json"
    headers["x-request-id"] = request_id
    headers["content-length"] = str(len(body))
    await send({"type": "http.response.start", "status": error.status, "headers": _encode(headers)})
    await send({"type": "http.response.body", "body": body})
