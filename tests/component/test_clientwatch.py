"""ClientWatch on real sockets: a client's end of the stream, a reset and a hang-up are
reported once each; data, a forgotten socket and a reused descriptor are not."""

from __future__ import annotations

import os
import socket
from typing import Callable

import trio
import trio.testing

from llmgw.router.http import clientwatch
from llmgw.router.http.clientwatch import ClientWatch

DEADLINE_S = 10  # whole-test bound: a report that never comes fails instead of hanging


def _pair() -> tuple[socket.socket, socket.socket]:
    """Return (server side, client side) of a connected TCP pair on loopback."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    server.setblocking(False)
    return server, client


def _recorder(log: list[str], name: str, done: trio.Event | None = None) -> Callable[[], None]:
    def gone() -> None:
        log.append(name)
        if done is not None:
            done.set()
    return gone


async def test_the_watch_reports_a_client_that_closed_or_reset_and_nothing_else() -> None:
    log: list[str] = []
    closed, reset = trio.Event(), trio.Event()
    pairs = {name: _pair() for name in ("talks", "closes", "resets", "forgotten")}
    try:
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                assert clientwatch.current() is None
                watch = await nursery.start(ClientWatch().run)
                assert clientwatch.current() is watch
                for name, (server, _) in pairs.items():
                    done = {"closes": closed, "resets": reset}.get(name)
                    watch.watch(server.fileno(), _recorder(log, name, done))
                forgotten_server, forgotten_client = pairs["forgotten"]
                watch.forget(forgotten_server.fileno(), lambda: None)  # not its callback: still watched
                watch.forget(forgotten_server.fileno(), watch._gone[forgotten_server.fileno()])
                forgotten_client.close()
                pairs["talks"][1].sendall(b"POST / HTTP/1.1\r\n")  # a request is not the end
                pairs["closes"][1].close()
                await closed.wait()
                client = pairs["resets"][1]
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                client.close()  # linger 0: a reset
                await reset.wait()
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
        assert log == ["closes", "resets"]  # once each; the talker and the forgotten one never
        assert clientwatch.current() is None
    finally:
        for server, client in pairs.values():
            server.close()
            client.close()


async def test_a_reused_descriptor_is_watched_for_its_new_connection() -> None:
    log: list[str] = []
    done = trio.Event()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            watch = await nursery.start(ClientWatch().run)
            first, first_client = _pair()
            fd = first.fileno()
            old = _recorder(log, "old")
            watch.watch(fd, old)
            first.close()  # closed without forget: the kernel drops it from the epoll
            first_client.close()
            second, second_client = _pair()
            if second.fileno() != fd:  # the number comes back for a new connection
                os.dup2(second.fileno(), fd)
                second.close()
                second = socket.socket(fileno=fd)
            try:
                watch.watch(fd, _recorder(log, "new", done))
                watch.forget(fd, old)  # the old owner's late forget leaves the new watch alone
                second_client.close()
                await done.wait()
            finally:
                second.close()
                second_client.close()
            nursery.cancel_scope.cancel()
    assert log == ["new"]
