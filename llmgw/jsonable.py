"""Plain JSON values of llmgw's own: what ``llmgw ctl --json`` and ``llmgw doctor --json`` print and ``/api/v1/*`` answers."""

from __future__ import annotations

from typing import Any

import attrs


def to_jsonable(value: Any) -> Any:
    """Returns attrs classes (as mappings of their fields), enums (their values), tuples, sets
    (sorted) and mappings as plain JSON values, at every depth; anything else as it is."""
    if attrs.has(type(value)):
        return {k: to_jsonable(v) for k, v in attrs.asdict(value, recurse=False).items()}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(to_jsonable(v) for v in value)
    if hasattr(value, "value") and value.__class__.__module__ != "builtins":
        return value.value
    return value
