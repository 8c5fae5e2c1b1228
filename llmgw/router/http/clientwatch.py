"""Noticing the fast lane's clients that go away while their connection is busy answering them.

The HTTP/1.1 lane (:mod:`.h1lane`) runs a request's exchange in the connection's reading
task, so while a response is being made nobody reads the client's socket, and a client
that leaves would go unnoticed until the response is written (for a long generation,
minutes of engine time for nobody). :class:`ClientWatch` is one task per gateway process
that watches every lane connection's socket for the client's end of the stream
(``EPOLLRDHUP``, and the errors and hang-ups epoll always reports) in an epoll of its own,
and calls the connection's ``gone`` callback when it comes.

A connection is registered once, when its first lane request arrives, and stays
registered (level-triggered, for nothing but the end of the stream: arriving requests do
not wake the watch) until it closes or the watch has reported it. So the watch costs
no system call per request. When a client ends its stream while its connection is idle,
the watch reports it too and the connection's reader sees the end of the stream as
well: the callback does nothing then.

:func:`current` returns the watch of the running trio run (None outside
:meth:`ClientWatch.run`): :func:`~.serve.serve_gateway` runs one while it serves.
"""

from __future__ import annotations

import select
from typing import Callable, Final

import trio

#: Sockets read from the watch's epoll per pass; more wait for the next pass.
MAX_EVENTS_PER_PASS: Final = 256

# What the watch asks epoll for: the peer's end of the stream. Errors and hang-ups are
# always reported; no EPOLLIN, so the requests themselves never wake the watch.
_END_OF_STREAM: Final = select.EPOLLRDHUP

_CURRENT: trio.lowlevel.RunVar[ClientWatch | None] = trio.lowlevel.RunVar("llmgw_client_watch", default=None)


def current() -> ClientWatch | None:
    """Return the :class:`ClientWatch` running in this trio run, or None."""
    return _CURRENT.get()


class ClientWatch:
    """One epoll over the lane connections' sockets; :meth:`run` is its task."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._gone: dict[int, Callable[[], None]] = {}

    def watch(self, fd: int, gone: Callable[[], None]) -> None:
        """Call ``gone()`` (synchronously, from the watch's task; it must not raise) once the
        client on socket ``fd`` ends its stream, hangs up or fails. Replaces a watch of
        ``fd`` that was never forgotten (its socket was closed and the number reused)."""
        self._gone[fd] = gone
        try:
            self._epoll.register(fd, _END_OF_STREAM)
        except FileExistsError:
            self._epoll.modify(fd, _END_OF_STREAM)

    def forget(self, fd: int, gone: Callable[[], None]) -> None:
        """Stop watching ``fd`` for ``gone`` (nothing if ``fd`` is watched for another
        callback since, or not at all). Call it before the socket is closed; after, the
        kernel has already dropped the socket from the epoll and this only forgets the
        callback. Never raises."""
        if self._gone.get(fd) is not gone:
            return
        del self._gone[fd]
        try:
            self._epoll.unregister(fd)
        except (OSError, ValueError):  # closed already: the kernel dropped it
            pass

    async def run(self, *, task_status: trio.TaskStatus[ClientWatch] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled; :func:`current` returns this watch meanwhile.

        Reports itself started with ``task_status.started(self)``. Closes its epoll on the
        way out, however it ends.
        """
        token = _CURRENT.set(self)
        try:
            task_status.started(self)
            while True:
                await trio.lowlevel.wait_readable(self._epoll.fileno())
                for fd, _ in self._epoll.poll(0, MAX_EVENTS_PER_PASS):
                    gone = self._gone.pop(fd, None)
                    try:
                        self._epoll.unregister(fd)  # reported once: level-triggered would repeat it
                    except OSError:
                        pass
                    if gone is not None:
                        gone()
        finally:
            _CURRENT.reset(token)
            self._gone.clear()
            self._epoll.close()
