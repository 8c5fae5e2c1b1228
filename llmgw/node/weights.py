"""The node's weights directory: where fetched model weights live, and how full its disk is.

The agent creates the directory at start (:func:`prepare_weights_dir`) and reports the
free and total space of the file system holding it in every heartbeat
(:func:`disk_usage`), so an operator sees a filling disk before a fetch fails on it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["WeightsDirError", "disk_usage", "prepare_weights_dir"]

_MB = 1024 * 1024


class WeightsDirError(OSError):
    """The weights directory cannot be created or written; the message says which and what to do."""


def prepare_weights_dir(path: Path) -> Path:
    """Creates ``path`` (and parents) if needed and returns it resolved.

    Raises :class:`WeightsDirError` naming the directory when it cannot be created or
    is not a writable directory, so the agent refuses to start with a clear reason
    rather than failing the first fetch.
    """
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".llmgw-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise WeightsDirError(
            f"weights directory {path} is not usable ({exc.strerror or exc}); "
            "set weights_dir in agent.yaml to a writable directory with room for model weights"
        ) from exc
    return path.resolve()


def disk_usage(path: Path) -> tuple[int, int]:
    """Returns ``(free_mb, total_mb)`` of the file system holding ``path``; (0, 0) if it cannot be read."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return 0, 0
    return usage.free // _MB, usage.total // _MB
