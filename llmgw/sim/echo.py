"""Client values quoted back in the simulated engine's errors, bounded (a 1 MB model name is not sent back whole)."""

from __future__ import annotations

__all__ = ["MAX_ECHO_CHARS", "echo"]

#: Characters of a client's value quoted back in an error: enough to recognise it.
MAX_ECHO_CHARS = 200


def echo(value: object) -> str:
    """Returns ``value`` as quoted back: a string as it is, anything else as its ``repr``, cut
    to :data:`MAX_ECHO_CHARS` characters (``...`` marks the cut)."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[: MAX_ECHO_CHARS - 3] + "..."
