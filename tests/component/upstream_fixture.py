"""A tiny OpenAI-like engine for gateway tests: raw trio + h11 on a real 127.0.0.1 socket.

It answers ``/v1/chat/completions``, ``/v1/completions`` (JSON or SSE) and
``/v1/embeddings``, records every request it receives (method, path, headers, exact
body bytes), and lets a test steer it from the same trio run:

* ``gated = True``: a stream sends its first chunk, then waits for :meth:`allow_chunk`
  before each further chunk, so a test can prove the gateway does not buffer.
* ``hold``: when set to a ``trio.Event``, non-streaming answers wait for it, so requests
  stay in flight.
* ``break_stream_after = k``: the connection is dropped after ``k`` chunks of a stream.
* a request body with ``"upstream_status": N`` gets an OpenAI-shaped error with status N.
* ``disconnected`` is set when a client hangs up in the middle of a stream.

``llmgw.sim`` (the full simulated engine) replaces this in system tests.
"""

from __future__ import annotations

import json
import math
import socket
from typing import Any, Callable, Iterator

import attrs
import h11
import pytest
import trio

# Seconds an idle keep-alive connection is kept before the fixture closes it; every
# fixture wait is bounded so a broken test fails instead of hanging.
IDLE_TIMEOUT_S = 30.0
MAX_WAIT_S = 30.0
CHUNK_TOKENS = ("Hel", "lo", " there", "!")


@attrs.frozen
class ReceivedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class FakeUpstream:
    """One fake engine replica; start it with ``port = await nursery.start(upstream.serve)``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = 0
        self.requests: list[ReceivedRequest] = []
        self.gated = False
        self.first_chunk_gate: trio.Event | None = None  # set: a stream's first chunk waits for it
        self.hold: trio.Event | None = None
        self.break_stream_after: int | None = None
        self.always_stream = False  # answer every chat or completion with a stream, asked for or not
        self.chunks_sent = 0  # stream chunks handed to the socket
        self.disconnected = trio.Event()
        self._permits_in, self._permits_out = trio.open_memory_channel[None](math.inf)
        self._changed = trio.Event()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def allow_chunk(self) -> None:
        """Let one more gated stream chunk go out."""
        self._permits_in.send_nowait(None)

    async def wait_for(self, predicate: Callable[[FakeUpstream], bool]) -> None:
        """Return once ``predicate(self)`` holds (re-checked on every change); fail after MAX_WAIT_S."""
        with trio.fail_after(MAX_WAIT_S):
            while not predicate(self):
                await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    # -- HTTP plumbing ----------------------------------------------------------------------

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                with trio.move_on_after(IDLE_TIMEOUT_S) as idle:
                    got = await self._read_request(stream, conn)
                if idle.cancelled_caught or got is None:
                    return
                keep_open = await self._respond(stream, conn, got)
                if not keep_open or conn.our_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            return
        finally:
            await stream.aclose()

    async def _read_request(self, stream: trio.SocketStream, conn: h11.Connection) -> ReceivedRequest | None:
        head: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return None
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                headers = {k.decode().lower(): v.decode() for k, v in head.headers}
                got = ReceivedRequest(head.method.decode(), head.target.decode(), headers, bytes(body))
                self.requests.append(got)
                self._notify()
                return got
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def _send(self, stream: trio.SocketStream, conn: h11.Connection, event: Any) -> None:
        data = conn.send(event)
        if data:
            await stream.send_all(data)

    async def _send_json(
        self, stream: trio.SocketStream, conn: h11.Connection, status: int, value: Any
    ) -> None:
        body = json.dumps(value).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
        await self._send(stream, conn, h11.Response(status_code=status, headers=headers))
        await self._send(stream, conn, h11.Data(data=body))
        await self._send(stream, conn, h11.EndOfMessage())

    # -- behaviour --------------------------------------------------------------------------

    async def _respond(self, stream: trio.SocketStream, conn: h11.Connection, got: ReceivedRequest) -> bool:
        """Answer ``got``; return whether the connection may serve another request."""
        try:
            body = got.json()
        except ValueError:
            await self._send_json(stream, conn, 400, _error("bad json from gateway"))
            return True
        if "upstream_status" in body:
            await self._send_json(stream, conn, int(body["upstream_status"]), _error("asked to fail"))
            return True
        model = body.get("model", "")
        if got.path == "/v1/embeddings":
            await self._send_json(stream, conn, 200, self._embedding(model))
            return True
        if got.path not in ("/v1/chat/completions", "/v1/completions"):
            await self._send_json(stream, conn, 404, _error(f"no route {got.path}"))
            return True
        chat = got.path == "/v1/chat/completions"
        if body.get("stream") is True or self.always_stream:
            await self._stream(stream, conn, model, chat)
            return False
        if self.hold is not None:
            with trio.fail_after(MAX_WAIT_S):
                await self.hold.wait()
        await self._send_json(stream, conn, 200, self._completion(model, chat))
        return True

    async def _stream(self, stream: trio.SocketStream, conn: h11.Connection, model: str, chat: bool) -> None:
        """Send an SSE stream, watching for the client hanging up; closes the connection after."""
        headers = [("content-type", "text/event-stream"), ("connection", "close")]
        await self._send(stream, conn, h11.Response(status_code=200, headers=headers))
        finished = False  # once the last bytes are out, the client closing is not a hang-up

        async def watch_hangup(scope: trio.CancelScope) -> None:
            try:
                data = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data and not finished:
                self.disconnected.set()
                self._notify()
                scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_hangup, nursery.cancel_scope)
            for index, token in enumerate(CHUNK_TOKENS):
                if index == 0 and self.first_chunk_gate is not None:
                    with trio.fail_after(MAX_WAIT_S):
                        await self.first_chunk_gate.wait()
                if index > 0 and self.gated:
                    with trio.fail_after(MAX_WAIT_S):
                        await self._permits_out.receive()
                if self.break_stream_after is not None and index >= self.break_stream_after:
                    nursery.cancel_scope.cancel()
                    return  # the caller closes the socket mid-body
                event = self._chunk(model, chat, token, last=index == len(CHUNK_TOKENS) - 1)
                # Counted before the write: the gateway may relay the chunk, and the client
                # read it, before this task runs again after its write.
                self.chunks_sent += 1
                await self._send(stream, conn, h11.Data(data=b"data: " + json.dumps(event).encode() + b"\n\n"))
                self._notify()
            finished = True
            await self._send(stream, conn, h11.Data(data=b"data: [DONE]\n\n"))
            await self._send(stream, conn, h11.EndOfMessage())
            nursery.cancel_scope.cancel()

    def _completion(self, model: str, chat: bool) -> dict[str, Any]:
        text = f"hello from {self.name}"
        usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
            kind = "text_completion"
        return {
            "id": f"cmpl-{self.name}-{len(self.requests)}",
            "object": kind,
            "created": 1700000000,
            "model": model,
            "system_fingerprint": self.name,
            "choices": [choice],
            "usage": usage,
        }

    def _chunk(self, model: str, chat: bool, token: str, *, last: bool) -> dict[str, Any]:
        finish = "stop" if last else None
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": token}, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": token, "finish_reason": finish, "logprobs": None}
            kind = "text_completion"
        return {
            "id": f"cmpl-{self.name}-stream",
            "object": kind,
            "created": 1700000000,
            "model": model,
            "system_fingerprint": self.name,
            "choices": [choice],
        }

    def _embedding(self, model: str) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5, 1.0]}],
            "model": model,
            "usage": {"prompt_tokens": 2, "total_tokens": 2},
        }


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


def expected_stream_text() -> str:
    """The text a full stream from :class:`FakeUpstream` adds up to."""
    return "".join(CHUNK_TOKENS)


@pytest.fixture
def refused_endpoint() -> Iterator[str]:
    """An endpoint that refuses connections: a bound socket that never listens."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
