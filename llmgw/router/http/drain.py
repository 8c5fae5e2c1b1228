"""Ending a stopping gateway's open streams when its shutdown grace runs out.

A stopping gateway (:func:`~llmgw.router.http.serve.serve_gateway`) lets its in-flight
requests finish for ``gateway.shutdown_grace`` seconds. A stream still running then
must end with an SSE error event and the stream's end, never a bare close. Each relayed
stream reads its upstream through
:meth:`~llmgw.router.http.upstream.UpstreamClient.iter_body` given the gateway's
:class:`StreamCuts`: each read's deadline scope is listed in :attr:`StreamCuts.reading`
while it waits (one cancel scope per read, the deadline's, and never around a yield to
the client). :meth:`StreamCuts.cut_all` cancels the reads in progress and makes every
later one raise :class:`StreamCut`, so the relay writes its error event and returns while
the client connection is still open.
"""

from __future__ import annotations

import trio


class StreamCut(Exception):
    """Raised by :meth:`StreamCuts.read` once the gateway's streams are being cut."""


class StreamCuts:
    """The upstream reads of one gateway's relayed streams, and the switch that ends them."""

    __slots__ = ("reading", "cut")

    def __init__(self) -> None:
        #: The cancel scopes of the reads waiting now (added and removed by the reader).
        self.reading: set[trio.CancelScope] = set()
        #: True once :meth:`cut_all` was called: readers raise :class:`StreamCut`.
        self.cut = False

    def cut_all(self) -> int:
        """End every stream: cancel the reads in progress, refuse later ones. Returns the
        number of reads cancelled (streams waiting on their replica at that moment)."""
        self.cut = True
        reading = list(self.reading)
        for scope in reading:
            scope.cancel()
        return len(reading)
