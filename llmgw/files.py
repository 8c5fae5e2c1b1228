"""Files that are either wholly old or wholly new: state, certificates and keys."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def read_json_mapping(path: Path) -> dict[str, Any] | None:
    """Return the JSON object in ``path``, or None when there is no such file.

    Raises ValueError when it is not JSON or not an object, OSError when it cannot be read:
    the caller says what an unusable file means for it.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds no JSON object")
    return data


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` so that readers and crashes see the old or the new file.

    The temporary file is created with ``mode`` before anything is written (a key is
    never readable by others, not even for a moment), fsynced, renamed over ``path``,
    and the rename is flushed to disk. Raises OSError if the disk refuses (full,
    read-only); the old file then stays intact and no temporary file is left.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
