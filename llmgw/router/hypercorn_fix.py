"""A fix for a connection race in Hypercorn 0.18's trio server that can stop the whole gateway.

Hypercorn's ``TCPServer`` writes responses under its ``send_lock`` but closes the
connection (``send_eof`` in ``_close``) without it. When the app finishes a response
(so its task closes a ``Connection: close`` connection) at the moment the reading task
meets a protocol error (a client that half-closed or sent junk after its request) and
writes Hypercorn's own error response, the write hits trio's conflict detector and
raises ``trio.BusyResourceError`` out of the connection handler, which cancels
``serve_listeners`` and with it every connection: one malformed request stops the
gateway (found by tests/component/test_gateway_fuzz.py).

:func:`install` wraps ``TCPServer.protocol_send`` so that such a write is dropped (the
connection is being closed anyway) and the connection is treated as closed. Importing
:mod:`llmgw.router.app` installs it; installing twice is harmless.
"""

from __future__ import annotations

from typing import Any

import trio
from hypercorn.events import Closed, RawData
from hypercorn.trio.tcp_server import TCPServer

_MARK = "_llmgw_close_race_fixed"


def install() -> None:
    """Patch ``hypercorn.trio.tcp_server.TCPServer.protocol_send`` (idempotent); returns nothing."""
    if getattr(TCPServer.protocol_send, _MARK, False):
        return
    original = TCPServer.protocol_send

    async def protocol_send(self: Any, event: Any) -> None:
        try:
            await original(self, event)
        except trio.BusyResourceError:
            if not isinstance(event, RawData):
                raise
            # Another task is closing this connection (send_eof): drop the write and
            # let the protocol see the close, as Hypercorn does for a broken stream.
            await self.protocol.handle(Closed())

    setattr(protocol_send, _MARK, True)
    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]
