"""A standalone Cap'n Proto peer for the RPC backend tests: serves Echo on 127.0.0.1.

Prints ``port N`` on stdout once listening. Run: python rpc_peer.py
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.component.rpc_echo import EchoImpl, load_schema  # noqa: E402
from llmgw.rpc.connection import serve_stream  # noqa: E402
from llmgw.rpc.kjtrio import capnp_runtime  # noqa: E402


async def main() -> None:
    schema = load_schema()
    async with capnp_runtime():
        async def handler(stream: trio.SocketStream) -> None:
            await serve_stream(stream, EchoImpl(schema))

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            print(f"port {port}", flush=True)


if __name__ == "__main__":
    trio.run(main)
