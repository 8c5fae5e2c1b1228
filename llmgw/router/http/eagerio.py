"""Socket reads and writes for the gateway's hot path that yield only when they must wait.

trio makes every successful ``send``/``recv`` on a socket a schedule point
(``cancel_shielded_checkpoint``): the task goes back to the run queue and waits for the
next pass of the scheduler, which costs an ``epoll_wait`` and trio's loop. A proxied
request makes four such calls that succeed at once (read the request, write it
upstream, read the answer, write it back), so at concurrency 1 the gateway ran about 4.5
scheduler passes per request (``strace -c``), most of them only to yield. These
helpers call the kernel directly (``os.read``/``os.write`` on the socket's descriptor,
non-blocking) and wait with :func:`trio.lowlevel.wait_readable` (or trio's own
``send_all``) only when the kernel has nothing to give or no room to take.

They apply to plain :class:`trio.SocketStream` objects only; any other stream (TLS)
goes through its own methods unchanged. Errors are trio's: a failure of the direct call
falls back to the stream's method, which raises ``trio.BrokenResourceError`` or
``trio.ClosedResourceError`` as it always does. Waiting is still a checkpoint, so
cancellation reaches a task that has to wait; a call that succeeds at once neither
checks for cancellation nor yields, so a caller that could loop without ever waiting
must yield by itself (the gateway's loops all wait for the peer between rounds). Each
stream must have one reader and one writer at a time, as trio requires.
"""

from __future__ import annotations

import os

import trio


def try_send(stream: trio.abc.SendStream, data: bytes) -> int:
    """Write what the kernel takes of ``data`` at once; return how many bytes that was.

    Returns 0 for a stream that is not a plain ``trio.SocketStream``, when the socket
    buffer is full, and when the socket is closed or broken (the caller's
    ``stream.send_all`` of the rest then raises trio's error). Never waits or raises.
    """
    if type(stream) is not trio.SocketStream:
        return 0
    try:
        return os.write(stream.socket.fileno(), data)
    except OSError:  # BlockingIOError: no room; others: closed or broken
        return 0


async def send_all(stream: trio.abc.SendStream, data: bytes) -> None:
    """Write all of ``data`` to ``stream``, as ``stream.send_all(data)`` does.

    Returns without yielding when the kernel takes ``data`` in one write
    (:func:`try_send`); otherwise the rest goes through ``stream.send_all``. Raises as
    ``send_all`` does.
    """
    sent = try_send(stream, data)
    if sent == len(data):
        return
    await stream.send_all(memoryview(data)[sent:] if sent else data)


def try_receive(stream: trio.SocketStream, max_bytes: int) -> bytes | None:
    """Read up to ``max_bytes`` that the kernel has for ``stream`` (a plain
    ``trio.SocketStream``) at once: the bytes, b"" at the end of the stream, or None when
    nothing is there yet. Never waits; raises ``OSError`` when the socket is closed or broken.
    """
    try:
        return os.read(stream.socket.fileno(), max_bytes)
    except BlockingIOError:
        return None


async def receive_some(stream: trio.abc.ReceiveStream, max_bytes: int, *, wait_first: bool = False) -> bytes:
    """Return up to ``max_bytes`` from ``stream`` (b"" at end of stream), as ``receive_some`` does.

    Returns without yielding when bytes (or the end of the stream) are already there
    (:func:`try_receive`). With ``wait_first`` it waits for readability before the first
    read: for a reply that cannot have come yet, this saves a read that would find nothing.
    Raises as ``receive_some`` does.
    """
    if type(stream) is trio.SocketStream:
        sock = stream.socket
        if wait_first:
            await trio.lowlevel.wait_readable(sock)
        while True:
            try:
                data = try_receive(stream, max_bytes)
            except OSError:
                break  # closed or broken: receive_some below raises trio's error for it
            if data is not None:
                return data
            await trio.lowlevel.wait_readable(sock)  # nothing there yet
    return await stream.receive_some(max_bytes)
