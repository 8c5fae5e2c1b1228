"""Node labels: ``key=value`` pairs an operator gives a node, and a model's profile asks for.

A node carries labels (agent.yaml ``labels``, or ``llmgw ctl nodes add --labels`` for a node
that joins with the token); a model's ``profile.node_labels`` places its replicas only on
nodes carrying every one of them. Pure functions, no I/O; every parser raises ValueError
with the reason, which callers prefix with where the value came from.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

#: A label key: starts with a letter or digit; letters, digits, '.', '_', '-' and '/' after
#: (so ``gpu.vendor`` and ``example.com/rack`` both work); at most 63 characters.
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,62}")
#: A label value: letters, digits, '.', '_' and '-', at most 63 characters (may be empty).
_VALUE = re.compile(r"[A-Za-z0-9._-]{0,63}")
#: More labels than this on one node or one profile is a mistake, not a taxonomy.
MAX_LABELS = 32
RULE = ("label keys are letters, digits, '.', '_', '-' and '/' (starting with a letter or digit), values letters, "
        "digits, '.', '_' and '-', each at most 63 characters")


def check_labels(labels: Mapping[Any, Any]) -> dict[str, str]:
    """Returns ``labels`` as a plain ``{key: value}`` dict of strings, sorted by key.

    Raises ValueError naming the first key or value that breaks :data:`RULE`, or when there
    are more than :data:`MAX_LABELS`.
    """
    if not isinstance(labels, Mapping):
        raise ValueError(f"expected a mapping of label: value, got {labels!r}")
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels, got {len(labels)}")
    checked: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"{key!r} cannot be a label key: {RULE}")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"label {key}: expected a text value, got {value!r}")
        text = str(value)
        if not _VALUE.fullmatch(text):
            raise ValueError(f"label {key}: {text!r} cannot be a label value: {RULE}")
        checked[key] = text
    return dict(sorted(checked.items()))


def parse_pairs(items: Iterable[str]) -> dict[str, str]:
    """Returns the labels of ``items``, each ``key=value`` or a comma-separated list of them
    (``--labels gpu=a100,rack=r1``, or the wire form: one pair per item).

    Raises ValueError for an item without '=', a key given twice, or what :func:`check_labels` refuses.
    """
    labels: dict[str, str] = {}
    for item in items:
        for pair in (p.strip() for p in item.split(",")):
            if not pair:
                continue
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"{pair!r} is not key=value")
            if key in labels:
                raise ValueError(f"label {key} is given twice")
            labels[key] = value
    return check_labels(labels)


def to_pairs(labels: Mapping[str, str]) -> list[str]:
    """Returns ``labels`` as ``["key=value", ...]`` sorted by key (the wire form, :func:`parse_pairs`'s input)."""
    return [f"{key}={value}" for key, value in sorted(labels.items())]


def describe(labels: Mapping[str, str]) -> str:
    """Returns ``labels`` in words for tables and messages: ``gpu=a100,rack=r1``, or "-" for none."""
    return ",".join(to_pairs(labels)) or "-"


def matches(node_labels: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    """Returns whether a node carrying ``node_labels`` has every label in ``wanted`` with the same value."""
    return all(node_labels.get(key) == value for key, value in wanted.items())
