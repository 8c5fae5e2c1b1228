"""The RPC listener under a flood of refused connections writes one line, then one per
interval with a count (llmgw/logthrottle.py), not one line per connection.

Real sockets: a mutual-TLS listener on loopback and plain-TCP clients that speak HTTP
to it (each is refused during the handshake). The throttle's clock is a fake one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Hashable

import pytest
import trio

from llmgw.logthrottle import LogThrottle
from llmgw.rpc import net
from llmgw.rpc.tls import ClusterCA, server_ssl_context

FLOOD = 40
INTERVAL = 60.0
DEADLINE_S = 30


class CountingThrottle(LogThrottle):
    """A LogThrottle that lets a test wait until it has seen a number of failures."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen = 0
        self._changed = trio.Event()

    def failure(self, key: Hashable, level: int, msg: str, *args: Any, exc_info: Any = None) -> bool:
        self.seen += 1
        self._changed.set()
        self._changed = trio.Event()
        return super().failure(key, level, msg, *args, exc_info=exc_info)

    async def wait_seen(self, count: int) -> None:
        while self.seen < count:
            await self._changed.wait()


async def _refused(port: int) -> None:
    """One plain-TCP client speaking HTTP to the TLS port, until the server hangs up."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            while await stream.receive_some(4096):
                pass
        except trio.BrokenResourceError:
            pass


async def test_a_flood_of_refused_connections_writes_one_line_then_one_per_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]  # the throttle's fake clock
    throttle = CountingThrottle(net.log, interval=INTERVAL, clock=lambda: now[0])
    monkeypatch.setattr(net, "_refusals", throttle)
    caplog.set_level(logging.INFO, logger=net.log.name)
    ca = ClusterCA.create(tmp_path / "ca")
    issued = ca.issue("control", "cp1", sans=["127.0.0.1"])
    context = server_ssl_context(ca.cert_pem, issued.cert_pem, issued.key_pem)

    async def never(*_: Any) -> None:
        raise AssertionError("a refused connection reached the handler")

    async with trio.open_nursery() as nursery:
        with trio.fail_after(DEADLINE_S):
            port = await nursery.start(net.listen, never, "127.0.0.1", 0, context)
            for _ in range(FLOOD):
                await _refused(port)
            await throttle.wait_seen(FLOOD)
            now[0] += INTERVAL
            await _refused(port)
            await throttle.wait_seen(FLOOD + 1)
        nursery.cancel_scope.cancel()

    lines = [r.getMessage() for r in caplog.records if r.name == net.log.name]
    assert len(lines) == 2, lines  # not FLOOD + 1
    assert lines[0].startswith("rpc: refused a connection: ")
    assert f"(again; {FLOOD - 1} more not logged in the last 60s)" in lines[1]
