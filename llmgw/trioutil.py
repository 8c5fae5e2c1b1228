"""Small trio helpers every part may use (a neutral module: it imports nothing of llmgw's)."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def unwrap_single_group() -> Iterator[None]:
    """Re-raise a lone exception out of a trio ExceptionGroup as itself.

    For context managers whose ``yield`` sits inside a nursery: an error of the
    caller's block should reach the caller as it was raised, not wrapped.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        while isinstance(group, BaseExceptionGroup) and len(group.exceptions) == 1:
            group = group.exceptions[0]  # type: ignore[assignment]
        if isinstance(group, BaseExceptionGroup):
            raise
        raise group from group.__cause__
