"""The one error type of configuration loading."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration file (or override) is unreadable or has a wrong key or value.
    The message is ``<file>: <key path>: <reason>``, ready to show to the operator."""
