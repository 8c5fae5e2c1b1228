"""Release wheels of llmgw in transit: their names, their pieces, their digests.

Shared by ``llmgw ctl upgrade`` (which uploads a wheel to the leader), the leader (which
keeps it and sends it to each standby and agent) and those (which install it:
llmgw/releases.py). A piece is written at the offset it names, so a transfer that
broke resumes where the receiver's answer says it stands.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Awaitable, Callable

#: Pieces a release is sent in (bytes); a wheel of llmgw is about a megabyte.
CHUNK_BYTES = 1024 * 1024
#: Largest release accepted (bytes): far above llmgw's wheel, far below a full disk.
MAX_RELEASE_BYTES = 256 * 1024 * 1024
#: An llmgw wheel's file name: ``llmgw-VERSION-py3-none-any.whl`` (VERSION per PEP 440, as a
#: wheel spells it).
WHEEL_NAME = re.compile(r"^llmgw-(?P<version>[0-9][A-Za-z0-9_.+!]*)-py3-none-any\.whl$")


class ReleaseError(RuntimeError):
    """A release cannot be received, installed or rolled back; the message says why."""


def wheel_version(name: str) -> str:
    """Return the version in an llmgw wheel's file ``name``; raises ReleaseError for any other name."""
    match = WHEEL_NAME.match(name)
    if match is None:
        raise ReleaseError(f"{name!r} is not an llmgw wheel's file name (llmgw-VERSION-py3-none-any.whl)")
    return match["version"]


def sha256_file(path: Path) -> str:
    """Return the SHA-256 of the file at ``path``, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


async def send_pieces(path: Path, send: Callable[[int, bytes], Awaitable[int]]) -> None:
    """Send the file at ``path`` through ``send(offset, chunk)``, which returns the bytes the
    receiver holds then, in :data:`CHUNK_BYTES` pieces (the last one shorter: empty for an
    empty file or an exact multiple). Raises ReleaseError when the receiver's count is not
    what was sent, OSError when the file cannot be read; ``send``'s errors propagate."""
    offset = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK_BYTES)
            held = await send(offset, chunk)
            offset += len(chunk)
            if held != offset:
                raise ReleaseError(f"the receiver holds {held} bytes of {path.name}; {offset} were sent")
            if len(chunk) < CHUNK_BYTES:
                return


class ReleaseInbox:
    """Release wheels being received, in ``directory`` (one file per name, written at the
    offsets given). Not thread-safe; used from one trio thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, name: str) -> Path:
        """Return where the wheel ``name`` is kept (ReleaseError for a name that is no wheel's)."""
        wheel_version(name)
        return self.directory / name

    def write(self, name: str, offset: int, chunk: bytes) -> int:
        """Write ``chunk`` at ``offset`` of wheel ``name`` (offset 0 starts it afresh); return
        the bytes held. Raises ReleaseError for a gap, a release over the size bound, or a
        full disk (the partial file is then removed)."""
        path = self.path(name)
        held = path.stat().st_size if offset and path.exists() else 0
        if offset != held:
            raise ReleaseError(f"piece at byte {offset} of {name}, but {held} bytes are held: send from {held}")
        if offset + len(chunk) > MAX_RELEASE_BYTES:
            raise ReleaseError(f"{name} is over {MAX_RELEASE_BYTES} bytes")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(path, "r+b" if offset else "wb") as f:
                f.seek(offset)
                f.write(chunk)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise ReleaseError(f"cannot keep {name} in {self.directory}: {exc.strerror}") from None
        return offset + len(chunk)
