"""The per-request exit stack: what a request holds is released however the request ends.

:class:`RequestCleanup` is the ASGI middleware that gives each HTTP request an
``AsyncExitStack``; code serving the request registers what must be released on it
through :func:`request_stack`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import trio

from .extensions import FAST_LANE_KEY

# Seconds the last body message of a response may take to send while shielded from
# cancellation (see RequestCleanup): it only writes a final chunk and closes or recycles
# the connection, so this bounds a client that stopped reading.
FINAL_SEND_TIMEOUT_S = 10.0

# The per-request exit stack (see RequestCleanup); None outside an HTTP request.
_cleanup_stack: contextvars.ContextVar[contextlib.AsyncExitStack | None] = contextvars.ContextVar(
    "llmgw_router_cleanup", default=None
)


class RequestCleanup:
    """ASGI middleware that gives each HTTP request an exit stack run when the request ends.

    Leases and upstream responses are registered on it so they are released even when
    the request ends in a way the view never sees: the client disconnecting before the
    streaming body was started, a cancellation between the view returning and Quart
    iterating the body, or a failure while sending headers.

    It also shields the last ``http.response.body`` message from cancellation (except on
    the fast lane, which needs no shield: :data:`~llmgw.router.http.extensions.FAST_LANE_KEY`).
    Hypercorn finishes the exchange inside that ``send`` (closes a ``Connection: close`` /
    HTTP/1.0 connection, or re-arms the keep-alive idle timer), and that same ``send``
    delivers ``http.disconnect`` to the app's receiver, which (in Quart-Trio and in
    :class:`~llmgw.router.http.forward.FastForward`) cancels the request at once; unshielded,
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

        # The fast lane finishes its exchange by itself, cancelled or not (h1lane.py).
        extensions = scope.get("extensions")
        lane = extensions is not None and FAST_LANE_KEY in extensions
        async with contextlib.AsyncExitStack() as stack:
            token = _cleanup_stack.set(stack)
            try:
                await self._inner(scope, receive, send if lane else send_last_shielded)
            finally:
                _cleanup_stack.reset(token)


def request_stack() -> contextlib.AsyncExitStack:
    """Return the current HTTP request's exit stack; raise RuntimeError outside one (no
    :class:`RequestCleanup` in front of the app)."""
    stack = _cleanup_stack.get()
    if stack is None:  # only possible if the middleware was removed
        raise RuntimeError("gateway request cleanup middleware is not installed")
    return stack
