"""Ending a stopping gateway's open streams when its shutdown grace runs out.

A stopping gateway (:func:`~llmgw.router.http.serve.serve_gateway`) lets its in-flight
requests finish for ``gateway.shutdown_grace`` seconds. A stream still running then
must end with an SSE error event and the stream's end, never a bare close. Each relayed
stream reads its upstream through :meth:`StreamCuts.read`, one cancel scope per read and
never around a yield to the client; :meth:`StreamCuts.cut_all` cancels the reads in
progress and makes every later one raise :class:`StreamCut`, so the relay writes its
error event and returns while the client connection is still open.
"""

from __future__ import annotations

from typing import AsyncIterator

import trio


class StreamCut(Exception):
    """Raised by :meth:`StreamCuts.read` once the gateway's streams are being cut."""


class StreamCuts:
    """The upstream reads of one gateway's relayed streams, and the switch that ends them."""

    __slots__ = ("_reading", "cut")

    def __init__(self) -> None:
        self._reading: set[trio.CancelScope] = set()
        #: True once :meth:`cut_all` was called: every read raises :class:`StreamCut`.
        self.cut = False

    async def read(self, chunks: AsyncIterator[bytes]) -> bytes | None:
        """Return the next chunk of ``chunks``, or None at its end.

        Raises :class:`StreamCut` if :meth:`cut_all` was called before or during the
        read (the read is cancelled: ``chunks`` is then finished, close it as usual).
        Errors of ``chunks`` and cancellation from outside propagate.
        """
        if self.cut:
            raise StreamCut
        scope = trio.CancelScope()
        self._reading.add(scope)
        try:
            with scope:
                try:
                    return await anext(chunks)
                except StopAsyncIteration:
                    return None
        finally:
            self._reading.discard(scope)
        raise StreamCut  # the scope caught cut_all's cancellation

    def cut_all(self) -> int:
        """End every stream: cancel the reads in progress, refuse later ones. Returns the
        number of reads cancelled (streams waiting on their replica at that moment)."""
        self.cut = True
        reading = list(self._reading)
        for scope in reading:
            scope.cancel()
        return len(reading)
