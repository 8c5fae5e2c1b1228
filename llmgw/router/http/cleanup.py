"""What a request holds is released however it ends, and its last send is not cut short.

* :class:`Releases`: what one forwarded request holds (its admission ticket, lease,
  upstream response), released in reverse order when the request ends.
  :class:`~llmgw.router.http.forward.FastForward` makes one per forwarded request and
  releases it once the response is sent, or the request failed or was cancelled.
* :func:`shield_last_send`: a response's last send shielded from cancellation (see there;
  :class:`~llmgw.router.http.forward.FastForward` applies it to every request not on the
  fast lane).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import trio

# Seconds the last body message of a response may take to send while shielded from
# cancellation (see shield_last_send): it only writes a final chunk and closes or recycles
# the connection, so this bounds a client that stopped reading.
FINAL_SEND_TIMEOUT_S = 10.0


class Releases:
    """Callbacks run once, last registered first, when a request ends (:meth:`aclose`).

    The subset of ``contextlib.AsyncExitStack`` a request needs, at a fraction of its cost
    per request (no wrapper closures, no exception plumbing per callback).
    """

    __slots__ = ("_callbacks",)

    def __init__(self) -> None:
        self._callbacks: list[tuple[Callable[..., Any], tuple[Any, ...], bool]] = []

    def callback(self, function: Callable[..., object], *args: Any) -> None:
        """Call ``function(*args)`` when the request ends."""
        self._callbacks.append((function, args, False))

    def push_async_callback(self, function: Callable[..., Awaitable[object] | None], *args: Any) -> None:
        """Call ``function(*args)`` when the request ends, and await what it returns unless
        that is None (a release that needed no wait)."""
        self._callbacks.append((function, args, True))

    async def aclose(self) -> None:
        """Run the callbacks, last registered first; return when all ran (then none are left).

        Every callback runs even if an earlier one raised; the last error is then raised
        (with the earlier ones as its context), as ``AsyncExitStack`` does. Under
        cancellation the async callbacks are still awaited: they must shield what must
        finish (``close_quietly`` does).
        """
        callbacks, self._callbacks = self._callbacks, []
        error: BaseException | None = None
        for function, args, is_async in reversed(callbacks):
            try:
                if is_async:
                    pending = function(*args)
                    if pending is not None:
                        await pending
                else:
                    function(*args)
            except BaseException as raised:  # raised below, once the rest ran
                if error is not None and raised.__context__ is None:
                    raised.__context__ = error
                error = raised
        if error is not None:
            raise error


def shield_last_send(send: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
    """Return ``send`` with the last ``http.response.body`` message of a response shielded
    from cancellation (for at most :data:`FINAL_SEND_TIMEOUT_S`).

    Hypercorn finishes the exchange inside that ``send`` (closes a ``Connection: close`` /
    HTTP/1.0 connection, or re-arms the keep-alive idle timer), and that same ``send``
    delivers ``http.disconnect`` to the app's receiver, which (in Quart-Trio and in
    :class:`~llmgw.router.http.forward.FastForward`) cancels the request at once; unshielded,
    the cancellation lands in Hypercorn's close and the connection stays open forever.
    The fast lane needs no shield (:data:`~llmgw.router.http.extensions.FAST_LANE_KEY`).
    """

    async def send_last_shielded(message: Any) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            # One scope: shielded from outer cancellation, bounded by its own deadline.
            with trio.CancelScope(shield=True, relative_deadline=FINAL_SEND_TIMEOUT_S):
                await send(message)
        else:
            await send(message)

    return send_last_shielded
