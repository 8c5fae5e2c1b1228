"""The least a proxy in Python on trio does per request: a floor for llmgw's gateway.

``python -m bench.trio_floor PORT HOST:PORT...`` listens on 127.0.0.1:``PORT`` and proxies
OpenAI chat requests to the engines at ``HOST:PORT...``. ``bench/gateway.py`` runs it as the
peer ``trio-floor``, beside nginx and the Rust routers, so that each run says how much of
llmgw's CPU per request is the language and the event loop, and how much is llmgw's own
layers.

It does only what any gateway must, the way llmgw's hot path does it (the socket calls of
:mod:`llmgw.router.http.eagerio`: ``os.read``/``os.write`` first, a trio wait only when
the kernel has nothing), and nothing more:

* one task per client connection, keep-alive; a request is read whole (``content-length``
  bodies only) and its JSON body parsed for the model;
* the engine with the fewest requests in flight, over a keep-alive connection from a pool
  per engine;
* a whole answer (``content-length``) is read, its JSON parsed for ``usage`` and sent on;
* a chunked answer (an event stream) is passed through as its bytes arrive, with only the
  chunk framing tracked to find its end.

No keys, admission, KV-aware routing, metrics, tracing, deadlines or error shapes: it is a
yardstick, not a gateway, and it answers a malformed request or a failed engine by closing
the connection.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Sequence

import trio

from llmgw.gctune import tune_for_serving

#: Bytes asked of the kernel per read.
READ_BYTES = 65536


class _Conn:
    """A socket and the bytes read from it that are not used yet."""

    __slots__ = ("sock", "fd", "buffer")

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.buffer = bytearray()

    async def fill(self, wait_first: bool = False) -> None:
        """Append what the socket has (waiting for it if nothing); EOFError at its end."""
        if wait_first:
            await trio.lowlevel.wait_readable(self.sock)
        while True:
            try:
                data = os.read(self.fd, READ_BYTES)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            if not data:
                raise EOFError
            self.buffer += data
            return

    async def head(self, wait_first: bool = False) -> tuple[bytes, dict[bytes, bytes]]:
        """Return the start line and the headers (lower-case names) of the next message,
        removed from the buffer."""
        if wait_first and not self.buffer:
            await self.fill(wait_first=True)
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            await self.fill()
        lines = bytes(self.buffer[:end]).split(b"\r\n")
        del self.buffer[:end + 4]
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return lines[0], headers

    async def body(self, length: int) -> bytes:
        """Return the next ``length`` bytes, removed from the buffer."""
        while len(self.buffer) < length:
            await self.fill()
        body = bytes(self.buffer[:length])
        del self.buffer[:length]
        return body

    def send(self, data: bytes) -> None:
        """Write ``data`` (the socket's buffer takes these small answers whole)."""
        sent = os.write(self.fd, data)
        if sent != len(data):
            raise OSError("short write")


class Floor:
    """The proxy: engines, their requests in flight and their idle connections."""

    def __init__(self, engines: Sequence[tuple[str, int]]) -> None:
        self.engines = list(engines)
        self.in_flight = [0] * len(engines)
        self.idle: list[list[_Conn]] = [[] for _ in engines]

    async def serve(self, stream: trio.SocketStream) -> None:
        """Serve one client connection until it closes or fails."""
        client = _Conn(stream.socket)
        try:
            while True:
                line, headers = await client.head()
                body = await client.body(int(headers.get(b"content-length", b"0")))
                json.loads(body)["model"]  # what a gateway routes by, parsed as it must be
                await self.forward(client, line, body)
                if headers.get(b"connection", b"").lower() == b"close":
                    return
        except (EOFError, OSError, ValueError, KeyError):
            return

    async def forward(self, client: _Conn, line: bytes, body: bytes) -> None:
        """Send one request to the least busy engine and its answer to ``client``."""
        pick = min(range(len(self.engines)), key=self.in_flight.__getitem__)
        self.in_flight[pick] += 1
        try:
            engine = self.idle[pick].pop() if self.idle[pick] else await self._connect(pick)
            try:
                await self._exchange(engine, client, line, body)
            except BaseException:
                engine.sock.close()  # half-used: not for the pool
                raise
            self.idle[pick].append(engine)
        finally:
            self.in_flight[pick] -= 1

    async def _exchange(self, engine: _Conn, client: _Conn, line: bytes, body: bytes) -> None:
        """Send the request on ``engine`` and its answer to ``client``."""
        engine.send(b"%s\r\nhost: engine\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (line, len(body), body))
        status, headers = await engine.head(wait_first=True)
        content_type = headers.get(b"content-type", b"application/json")
        if b"content-length" in headers:
            answer = await engine.body(int(headers[b"content-length"]))
            json.loads(answer).get("usage")  # what a gateway accounts, parsed as it must be
            client.send(b"%s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                        % (status, content_type, len(answer), answer))
        else:
            client.send(b"%s\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % (status, content_type))
            await _pass_chunks(engine, client)

    async def _connect(self, pick: int) -> _Conn:
        sock = trio.socket.socket()
        await sock.connect(self.engines[pick])
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Conn(sock)


async def _pass_chunks(engine: _Conn, client: _Conn) -> None:
    """Pass a chunked body from ``engine`` to ``client`` as it arrives, through its last chunk."""
    # Bytes of chunk data (and its CRLF) still to pass before the next size line; -1: in a size line.
    left = 0
    while True:
        if not engine.buffer:
            await engine.fill(wait_first=True)
        data = bytes(engine.buffer)
        engine.buffer.clear()
        at, done = 0, False
        while at < len(data):
            if left > 0:
                step = min(left, len(data) - at)
                left -= step
                at += step
                continue
            end = data.find(b"\r\n", at)
            if end < 0:  # a size line split over reads: keep it for the next
                engine.buffer += data[at:]
                data = data[:at]
                break
            size = int(data[at:end].split(b";")[0], 16)
            if size == 0 and len(data) < end + 4:  # the last chunk's CRLF not here yet
                engine.buffer += data[at:]
                data = data[:at]
                break
            at = end + 2
            if size == 0:
                done = True
                at += 2  # the empty trailer's CRLF
                break
            left = size + 2
        client.send(data[:at] if done else data)
        if done:
            return


async def main(port: int, engines: Sequence[tuple[str, int]]) -> None:
    tune_for_serving()  # the garbage collector as llmgw's gateway runs it
    floor = Floor(engines)
    await trio.serve_tcp(floor.serve, port, host="127.0.0.1")


if __name__ == "__main__":
    targets = [(host, int(p)) for host, _, p in (arg.rpartition(":") for arg in sys.argv[2:])]
    trio.run(main, int(sys.argv[1]), targets)
