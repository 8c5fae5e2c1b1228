"""Cap'n Proto connections over trio streams: serve a bootstrap, or open a client."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

import capnp

from llmgw.rpc.transport import open_capnp_stream


async def serve_stream(stream: Any, bootstrap: Any) -> None:
    """Serve ``bootstrap`` (a capnp ``Server`` object) on one connection.

    Returns when the peer disconnects; closes the stream. Cancellation closes
    the connection, which fails the peer's pending calls with DISCONNECTED and
    cancels this side's running server calls.
    """
    async with open_capnp_stream(stream) as capnp_stream:
        server = capnp.TwoPartyServer(capnp_stream, bootstrap=bootstrap)
        try:
            await server.on_disconnect()
        finally:
            server.close()


@contextlib.asynccontextmanager
async def open_client(stream: Any) -> AsyncIterator[Any]:
    """Open a Cap'n Proto client on ``stream``; yields the ``TwoPartyClient``.

    Use ``client.bootstrap().cast_as(Interface)`` for the peer's bootstrap
    capability. On exit the client and the stream are closed; calls still
    pending then fail with DISCONNECTED.
    """
    async with open_capnp_stream(stream) as capnp_stream:
        client = capnp.TwoPartyClient(capnp_stream)
        try:
            yield client
        finally:
            client.close()
