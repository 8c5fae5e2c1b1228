"""llmgw.router.http.eagerio on real socket pairs: same results and errors as trio's stream methods,
no schedule point when the kernel can answer at once, and waiting when it cannot."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from llmgw.router.http import eagerio

DEADLINE_S = 10


def _pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


async def test_bytes_already_there_are_read_and_written_without_a_schedule_point() -> None:
    left, right = _pair()
    with trio.fail_after(DEADLINE_S):
        with trio.testing.assert_no_checkpoints():
            await eagerio.send_all(left, b"hello")
            assert await eagerio.receive_some(right, 100) == b"hello"
        await left.aclose()
        with trio.testing.assert_no_checkpoints():
            assert await eagerio.receive_some(right, 100) == b""  # end of stream
        await right.aclose()


async def test_a_read_waits_for_bytes() -> None:
    left, right = _pair()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            got: list[bytes] = []

            async def read() -> None:
                got.append(await eagerio.receive_some(right, 100))

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []  # the reader is waiting
            await left.send_all(b"x")
        assert got == [b"x"]
    await left.aclose()
    await right.aclose()


async def test_wait_first_waits_even_when_bytes_are_there() -> None:
    left, right = _pair()
    with trio.fail_after(DEADLINE_S):
        await left.send_all(b"ab")
        with trio.testing.assert_checkpoints():  # it waited for readability before reading
            assert await eagerio.receive_some(right, 1, wait_first=True) == b"a"
        with trio.testing.assert_no_checkpoints():
            assert await eagerio.receive_some(right, 1) == b"b"
    await left.aclose()
    await right.aclose()


async def test_a_write_larger_than_the_socket_buffers_waits_for_the_reader() -> None:
    left, right = _pair()
    payload = bytes(range(256)) * (32 * 1024)  # 8 MiB
    received = bytearray()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            async def drain() -> None:
                while len(received) < len(payload):
                    received.extend(await eagerio.receive_some(right, 1 << 20))

            nursery.start_soon(drain)
            await eagerio.send_all(left, payload)
    assert bytes(received) == payload
    await left.aclose()
    await right.aclose()


async def test_errors_are_trios() -> None:
    left, right = _pair()
    await left.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await eagerio.receive_some(left, 10)
    with pytest.raises(trio.ClosedResourceError):
        await eagerio.send_all(left, b"x")
    with pytest.raises(trio.BrokenResourceError):  # the peer is gone
        for _ in range(100):
            await eagerio.send_all(right, b"x" * 65536)
    await right.aclose()


async def test_a_read_waiting_when_its_stream_is_closed_raises_closed() -> None:
    left, right = _pair()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            async def read() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await eagerio.receive_some(right, 10)

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            await right.aclose()
    await left.aclose()


async def test_other_streams_use_their_own_methods() -> None:
    send, receive = trio.testing.memory_stream_pair()
    with trio.fail_after(DEADLINE_S):
        await eagerio.send_all(send, b"abc")
        assert await eagerio.receive_some(receive, 10, wait_first=True) == b"abc"


async def test_try_send_writes_what_fits_and_never_waits_or_raises() -> None:
    left, right = _pair()
    with trio.testing.assert_no_checkpoints():
        assert eagerio.try_send(left, b"abc") == 3
        big = b"x" * (64 * 1024 * 1024)
        taken = eagerio.try_send(left, big)
        assert 0 < taken < len(big)  # the socket buffers filled up
        assert eagerio.try_send(left, b"more") == 0  # no room left
    await left.aclose()
    assert eagerio.try_send(left, b"x") == 0  # closed: the caller's send_all raises
    send, _ = trio.testing.memory_stream_pair()
    assert eagerio.try_send(send, b"x") == 0  # not a socket: all of it is the caller's
    await right.aclose()
