"""A message channel between the control plane and one gateway worker process.

Messages are dicts packed with msgpack, back to back on a stream socket (a Unix
socketpair whose child end the worker inherits); msgpack's streaming unpacker finds the
boundaries, so there is no framing of our own. Either side may send from several tasks
(a lock keeps messages whole). Closing either end is seen by the other as EOF.
"""

from __future__ import annotations

import socket
from typing import Any

import msgpack
import trio

#: Largest message accepted. The biggest is a state snapshot: about 150 bytes per API
#: key and per replica, so 64 MiB is far beyond any real cluster while still bounding
#: what a confused peer can make us buffer.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Bytes read from the socket at a time.
RECEIVE_CHUNK = 65536

Message = dict[str, Any]


class ChannelClosed(Exception):
    """The other end closed the channel (it exited or was killed)."""


class Channel:
    """Sends and receives msgpack dicts over a trio stream. Owns ``stream``: :meth:`aclose` closes it."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._send_lock = trio.Lock()
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_MESSAGE_BYTES, strict_map_key=False)

    @classmethod
    def from_socket(cls, sock: socket.socket) -> Channel:
        """Return a channel over a connected stdlib socket (it becomes non-blocking and ours)."""
        return cls(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))

    async def send(self, message: Message) -> None:
        """Send one message. Raises :class:`ChannelClosed` if the other end is gone.

        Cancellation mid-send leaves the channel unusable (a partial message); callers
        treat a cancelled send as the end of the channel.
        """
        data = msgpack.packb(message, use_bin_type=True)
        async with self._send_lock:
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
                raise ChannelClosed(str(error)) from error

    async def receive(self) -> Message:
        """Return the next message. Raises :class:`ChannelClosed` at EOF or on a broken socket,
        ``ValueError`` if the peer sent something that is not a msgpack dict."""
        while True:
            try:
                message = next(self._unpacker)
            except StopIteration:
                pass
            else:
                if not isinstance(message, dict):
                    raise ValueError(f"gateway channel: expected a map, got {type(message).__name__}")
                return message
            try:
                data = await self._stream.receive_some(RECEIVE_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
                raise ChannelClosed(str(error)) from error
            if not data:
                raise ChannelClosed("end of stream")
            self._unpacker.feed(data)

    async def aclose(self) -> None:
        """Close the socket (the other end sees EOF)."""
        await self._stream.aclose()
