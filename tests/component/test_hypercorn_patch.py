"""Hypercorn as patched by llmgw.router.http.hypercorn_patch, served by serve_gateway on real sockets.

Checks what the patch must not change: keep-alive connections serve many requests and
close once idle past the keep-alive timeout (never while a request is in progress),
shutdown closes idle connections, a response with content-length arrives whole and
well-formed, and a streamed response's head is not held back until its first chunk. And
what it adds: a response that leaves its request's body unread says the connection closes.
"""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from llmgw.router.http import hypercorn_patch, serve
from llmgw.router.http.serve import serve_gateway

DEADLINE_S = 20
SHORT_KEEP_ALIVE_S = 0.3


async def serve_lifespan(receive: Any, send: Any) -> None:
    """Answer an ASGI lifespan scope: complete startup and shutdown; return after shutdown."""
    while True:
        message = await receive()
        await send({"type": message["type"] + ".complete"})
        if message["type"] == "lifespan.shutdown":
            return


class App:
    """ASGI app: ``/len`` answers with content-length, ``/slow`` the same after a pause,
    ``/stream`` sends its head and then one chunk once ``release`` is set, ``/early``
    answers (chunked) without reading the request's body."""

    def __init__(self) -> None:
        self.release = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        if scope["path"] == "/early":  # answers at the head, its body unread
            await send({"type": "http.response.start", "status": 403, "headers": []})
            await send({"type": "http.response.body", "body": b"refused"})
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await self.release.wait()
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if scope["path"] == "/held":
            await self.release.wait()
        if scope["path"] == "/slow":
            await trio.sleep(SHORT_KEEP_ALIVE_S * 3)  # a slow answer, longer than the keep-alive
        body = b'{"ok": true}'
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})


async def read_response(stream: trio.SocketStream, buffer: bytearray) -> tuple[bytes, bytes]:
    """Return (head, body) of one content-length response from ``stream``."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        assert data, "the server closed the connection before answering"
        buffer += data
    end = buffer.index(b"\r\n\r\n")
    head = bytes(buffer[:end])
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")[1:]
                  if line.lower().startswith(b"content-length:"))
    while len(buffer) < end + 4 + length:
        data = await stream.receive_some(65536)
        assert data, "the server closed the connection in the middle of a body"
        buffer += data
    body = bytes(buffer[end + 4:end + 4 + length])
    del buffer[:end + 4 + length]
    return head, body


async def expect_eof(stream: trio.SocketStream) -> None:
    """Return when the server closes ``stream`` (anything it sends first is an error)."""
    while True:
        try:
            data = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            return
        if not data:
            return
        raise AssertionError(f"unexpected bytes from the server: {data!r}")


def _request(path: str) -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}" % path.encode()


def test_apply_installs_every_patch_and_is_idempotent() -> None:
    from hypercorn import protocol
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.trio import tcp_server

    from llmgw.router.http.h1lane import FastLaneProtocol

    hypercorn_patch.apply()
    send, stream_send = tcp_server.TCPServer.protocol_send, H11Protocol.stream_send
    hypercorn_patch.apply()
    assert getattr(H11Protocol, hypercorn_patch._MARK)
    assert tcp_server.TrioSingleTask is hypercorn_patch.IdleTimer
    assert getattr(tcp_server.TCPServer.protocol_send, hypercorn_patch._CLOSE_RACE_MARK)
    assert protocol.H11Protocol is FastLaneProtocol
    assert (tcp_server.TCPServer.protocol_send, H11Protocol.stream_send) == (send, stream_send)  # not wrapped twice


def test_an_unchecked_hypercorn_release_is_refused_with_both_versions_named() -> None:
    for checked in ("0.18", "0.18.0", "0.18.7"):
        hypercorn_patch.check_version(checked)
    for unchecked in ("0.19.0", "0.17.3", "0.180.1", "1.0"):
        with pytest.raises(hypercorn_patch.HypercornUnchecked) as caught:
            hypercorn_patch.check_version(unchecked)
        message = str(caught.value)
        assert f"hypercorn {unchecked} is installed" in message
        assert f"hypercorn {hypercorn_patch.CHECKED_HYPERCORN}.x" in message
        assert "pip install" in message


# Python that fails (an AssertionError) if anything of Hypercorn's that apply() patches is patched.
ASSERT_UNPATCHED = (
    "from hypercorn import protocol\n"
    "from hypercorn.protocol.h11 import H11Protocol\n"
    "from hypercorn.protocol.http_stream import HTTPStream\n"
    "from hypercorn.trio import tcp_server\n"
    "assert protocol.H11Protocol is H11Protocol, protocol.H11Protocol\n"
    "assert tcp_server.TrioSingleTask.__module__.startswith('hypercorn.'), tcp_server.TrioSingleTask\n"
    "for method in (tcp_server.TCPServer.protocol_send, tcp_server.TCPServer._close,\n"
    "               tcp_server.TCPServer._read_data, H11Protocol.stream_send, HTTPStream.handle):\n"
    "    assert method.__module__.startswith('hypercorn.'), method\n"
)


def _run_fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter (in this one, other tests have served, and so
    patched, already); return its output, failing the test if it fails."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_the_gateway_patches_nothing() -> None:
    _run_fresh("import llmgw.router, llmgw.router.app, llmgw.router.kvrouting\n" + ASSERT_UNPATCHED)


def test_serving_on_an_unchecked_hypercorn_is_refused_before_anything_is_patched() -> None:
    out = _run_fresh(
        "import importlib.metadata, trio\n"
        "real = importlib.metadata.version\n"
        "importlib.metadata.version = lambda name: '0.19.0' if name == 'hypercorn' else real(name)\n"
        "from llmgw.router import ReplicaTable, create_app, serve_gateway\n"
        "from llmgw.router.http.hypercorn_patch import HypercornUnchecked\n"
        "try:\n"
        "    trio.run(serve_gateway, create_app(ReplicaTable()), '127.0.0.1', 0)\n"
        "except HypercornUnchecked as error:\n"
        "    print(error)\n"
        "else:\n"
        "    raise SystemExit('served on an unchecked hypercorn')\n" + ASSERT_UNPATCHED
    )
    assert "hypercorn 0.19.0 is installed" in out


async def test_keep_alive_serves_many_then_closes_when_idle_but_not_while_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(serve, "KEEP_ALIVE_S", SHORT_KEEP_ALIVE_S)
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_gateway, App(), "127.0.0.1", 0))
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            buffer = bytearray()
            for path in ("/len", "/slow", "/len"):
                await stream.send_all(_request(path))
                head, body = await read_response(stream, buffer)
                assert head.startswith(b"HTTP/1.1 200 ")
                assert b"\r\ndate: " in head.lower()
                assert body == b'{"ok": true}'
            await expect_eof(stream)  # idle past the keep-alive: closed by the server
            await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_shutdown_closes_an_idle_keep_alive_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "KEEP_ALIVE_S", 3600.0)  # only the shutdown can close it
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            server = trio.CancelScope()

            async def run(task_status: trio.TaskStatus[int]) -> None:
                with server:
                    await serve_gateway(App(), "127.0.0.1", 0, graceful_timeout=1.0, task_status=task_status)

            port = await nursery.start(run)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(_request("/len"))
            await read_response(stream, bytearray())
            server.cancel()
            await expect_eof(stream)
            await stream.aclose()


#: A request h11 parses (a chunked body keeps it off the fast lane), and one the lane takes.
HELD_REQUESTS = {
    "h11": b"POST /held HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "lane": _request("/held"),
}


#: The grace of the gateway that must stop early: longer than the test waits for it, and
#: finite, so a gateway that waits it out fails the test instead of hanging it.
LONG_GRACE_S = 2 * DEADLINE_S


@pytest.mark.parametrize("first", sorted(HELD_REQUESTS))
async def test_shutdown_ends_a_connection_whose_next_request_arrived_early(
    monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    """A request that arrives before the previous response is done waits (h11: PAUSED).
    When the gateway is stopping, the connection closes after that response, and the
    waiting reader must end with it: the gateway stops without waiting out its grace
    (before the fix it waited for all of it)."""
    monkeypatch.setattr(serve, "KEEP_ALIVE_S", 3600.0)
    app = App()
    async with trio.open_nursery() as nursery:
        server, stopped = trio.CancelScope(), trio.Event()

        async def run(task_status: trio.TaskStatus[int]) -> None:
            with server:
                await serve_gateway(app, "127.0.0.1", 0, graceful_timeout=LONG_GRACE_S, task_status=task_status)
            stopped.set()

        port = await nursery.start(run)
        with trio.fail_after(DEADLINE_S):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(HELD_REQUESTS[first] + _request("/len"))  # the second one early
            await trio.testing.wait_all_tasks_blocked()
            server.cancel()
            await trio.testing.wait_all_tasks_blocked()
            app.release.set()
            head, body = await read_response(stream, bytearray())
            assert head.startswith(b"HTTP/1.1 200 ") and body == b'{"ok": true}'
            await expect_eof(stream)  # the early request is not served by a stopping gateway
            await stream.aclose()
        with trio.move_on_after(DEADLINE_S):
            await stopped.wait()
        assert stopped.is_set(), f"the stopping gateway waited out its {LONG_GRACE_S:g} s grace"


async def test_a_streamed_response_head_is_sent_before_its_first_chunk() -> None:
    app = App()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_gateway, app, "127.0.0.1", 0))
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(_request("/stream"))
            received = b""
            while b"\r\n\r\n" not in received:  # the head arrives while the app still waits
                received += await stream.receive_some(65536)
            assert received.startswith(b"HTTP/1.1 200 ")
            assert b"transfer-encoding: chunked" in received.lower()
            app.release.set()
            while not received.endswith(b"0\r\n\r\n"):
                received += await stream.receive_some(65536)
            assert b"data: 1\n\n" in received
            await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_a_client_leaving_a_non_streamed_request_cancels_it() -> None:
    """The gateway's forward learns of the disconnect from Hypercorn's on_close (no watcher task)."""
    import json

    from tests.component.test_gateway import MODEL, gateway

    async with gateway(replicas=1) as env:
        upstream = env.upstreams[0]
        upstream.hold = trio.Event()  # the engine never answers unless told to
        port = int(env.url.rsplit(":", 1)[1])
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
        with trio.fail_after(DEADLINE_S):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await upstream.wait_for(lambda u: len(u.requests) == 1)
            assert env.load.total() == 1
            await stream.aclose()  # the client goes away while the engine is still working
            await env.wait_idle()  # the request was cancelled and its lease released
        assert not upstream.hold.is_set()


#: A request without a body that h11 parses (``te`` keeps it off the fast lane).
H11_GET = b"GET /len HTTP/1.1\r\nhost: x\r\nte: trailers\r\n\r\n"


async def test_a_response_that_leaves_the_body_unread_says_the_connection_closes() -> None:
    """Hypercorn closes a connection whose request body is unread when the response ends;
    the response must say so, or a keep-alive client sends its next request into it."""
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_gateway, App(), "127.0.0.1", 0))
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"POST /early HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n")  # head alone
            received = b""
            while not received.endswith(b"0\r\n\r\n"):  # the whole chunked answer, body still unsent
                data = await stream.receive_some(65536)
                assert data, f"closed before the answer ended: {received!r}"
                received += data
            assert received.startswith(b"HTTP/1.1 403 ") and b"refused" in received
            assert b"\r\nconnection: close\r\n" in received.lower(), received
            await stream.send_all(b"{}")
            await expect_eof(stream)  # closed, as it said
            await stream.aclose()
            # Bodiless requests on h11's path are read whole before the app answers: kept alive.
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            buffer = bytearray()
            for _ in range(2):
                await stream.send_all(H11_GET)
                head, body = await read_response(stream, buffer)
                assert head.startswith(b"HTTP/1.1 200 ") and body == b'{"ok": true}'
                assert b"connection: close" not in head.lower()
            await stream.aclose()
            nursery.cancel_scope.cancel()
