"""The Echo test service shared by the RPC backend tests and their subprocess peer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import capnp
import trio

SCHEMA_PATH = Path(__file__).with_name("rpc_test.capnp")


def load_schema() -> Any:
    return capnp.load(str(SCHEMA_PATH))


class EchoImpl:
    """Factory for an Echo server object that records what its methods saw."""

    def __new__(cls, schema: Any, name: str = "root") -> Any:
        class Impl(schema.Echo.Server):
            def __init__(self) -> None:
                self.name_ = name
                self.hanging = 0  # hang() bodies currently running
                self.started = 0  # hang() bodies ever started
                self.cancelled = 0  # hang() bodies that saw trio.Cancelled
                self.hang_entered = trio.Event()

            async def echo(self, text: str, **_: Any) -> str:
                return text.upper()

            async def hang(self, token: str, **_: Any) -> None:
                self.started += 1
                self.hanging += 1
                self.hang_entered.set()
                try:
                    await trio.sleep_forever()
                except trio.Cancelled:
                    self.cancelled += 1
                    raise
                finally:
                    self.hanging -= 1

            async def callback(self, cb: Any, value: int, **_: Any) -> int:
                result = await cb.call(value)
                return result.result + 1

            async def child(self, name: str, **_: Any) -> Any:
                return EchoImpl(schema, name)

            async def blob(self, data: bytes, **_: Any) -> int:
                return len(data)

            async def fail(self, message: str, **_: Any) -> None:
                raise ValueError(message)

            async def name(self, **_: Any) -> str:
                return self.name_

        return Impl()
