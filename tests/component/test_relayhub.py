"""RelayHub on its own: streams stepped when readable, handed back when their step says so,
when detached, when their owner is cancelled and when the hub stops."""

from __future__ import annotations

import logging
import socket

import pytest
import trio
import trio.testing

from llmgw.router.http.relayhub import RelayHub

DEADLINE_S = 10  # whole-test bound: a stream never handed back fails instead of hanging


class Reader:
    """A step that reads what its socket holds; hands back on b"end"."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.got = b""

    def __call__(self, now: float) -> bool:
        try:
            self.got += self.sock.recv(4096)
        except BlockingIOError:
            return True
        return not self.got.endswith(b"end")


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    return a, b


async def test_streams_are_stepped_until_their_step_hands_them_back() -> None:
    hub = RelayHub()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(hub.run)
            ends = [pair() for _ in range(3)]
            readers = [Reader(ours) for ours, _ in ends]
            async with trio.open_nursery() as owners:
                for (ours, _), reader in zip(ends, readers):
                    owners.start_soon(hub.relay, ours.fileno(), reader)
                await trio.testing.wait_all_tasks_blocked()
                for i, (_, theirs) in enumerate(ends):
                    theirs.send(b"piece %d " % i)
                    theirs.send(b"end")
            assert [r.got for r in readers] == [b"piece 0 end", b"piece 1 end", b"piece 2 end"]
            assert hub.steps >= 3
            nursery.cancel_scope.cancel()
    for ours, theirs in ends:
        ours.close()
        theirs.close()


async def test_detach_cancel_and_stop_each_hand_streams_back() -> None:
    hub = RelayHub()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(hub.run)
            (detached, _), (cancelled, peer), (stopped, _) = ends = [pair() for _ in range(3)]
            returned: list[str] = []

            async def owner(name: str, sock: socket.socket) -> None:
                await hub.relay(sock.fileno(), Reader(sock))
                returned.append(name)

            nursery.start_soon(owner, "detached", detached)
            nursery.start_soon(owner, "stopped", stopped)
            with trio.CancelScope() as scope:

                async def cancel_when_waiting() -> None:
                    await trio.testing.wait_all_tasks_blocked()
                    scope.cancel()

                nursery.start_soon(cancel_when_waiting)
                await hub.relay(cancelled.fileno(), Reader(cancelled))
            assert scope.cancelled_caught
            await trio.testing.wait_all_tasks_blocked()
            steps = hub.steps
            peer.send(b"no one steps this")  # the cancelled owner took its stream back
            hub.detach(detached.fileno())
            await trio.testing.wait_all_tasks_blocked()
            assert returned == ["detached"] and hub.steps == steps
            hub.stop()
            await trio.testing.wait_all_tasks_blocked()
            assert returned == ["detached", "stopped"] and not hub.running
            await hub.relay(stopped.fileno(), Reader(stopped))  # a stopped hub takes nothing: returns at once
    for ours, theirs in ends:
        ours.close()
        theirs.close()


async def test_a_failing_step_is_handed_back_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    hub = RelayHub()

    def broken(now: float) -> bool:
        raise RuntimeError("a bug")

    ours, theirs = pair()
    with trio.fail_after(DEADLINE_S), caplog.at_level(logging.ERROR):
        async with trio.open_nursery() as nursery:
            await nursery.start(hub.run)
            theirs.send(b"x")
            await hub.relay(ours.fileno(), broken)
            nursery.cancel_scope.cancel()
    assert "carries on by itself" in caplog.text
    ours.close()
    theirs.close()


async def test_a_closed_descriptor_is_not_taken() -> None:
    hub = RelayHub()
    ours, theirs = pair()
    fd = ours.fileno()
    ours.close()
    theirs.close()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(hub.run)
            await hub.relay(fd, Reader(ours))  # returns at once: its owner reads and fails by itself
            nursery.cancel_scope.cancel()
