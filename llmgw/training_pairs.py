"""The training pairs file of a LoRA job: what it holds, and the checks every line must pass.

One JSON object per line (UTF-8), in either of two forms:

- ``{"prompt": "...", "completion": "..."}``: one user turn and the answer to learn;
  the same as ``{"messages": [{"role": "user", "content": PROMPT},
  {"role": "assistant", "content": COMPLETION}]}``.
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: a conversation whose LAST
  message is the assistant's answer to learn. Roles are ``system`` (first message only),
  ``user`` and ``assistant``; at least one ``user`` message comes before the answer.
  Earlier turns, earlier assistant turns included, are context: the loss is taken on
  the last message alone.

Blank lines are skipped; keys other than these are ignored (ids, metadata). The
prompt, the answer and every content are strings; the prompt and the answer are not
empty. A line that is not valid JSON, not an object, mixes the two forms, or breaks
one of these rules is refused with its line number (1-based, blank lines counted).

Standard library only, on purpose: ``llmgw ctl`` and the control plane check a file with
it before it is sent (:func:`llmgw.training.check_pairs`), and
:mod:`llmgw.node.training.trainer` loads it by file path inside the engine's environment,
where llmgw itself is not importable.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_PAIRS",
    "MAX_PROBLEMS_SHOWN",
    "Pair",
    "PairsError",
    "ROLES",
    "parse_pair",
    "parse_pairs",
    "read_pairs",
]

#: Roles a message may have: what every chat template knows (tool calls are not trained here).
ROLES = ("system", "user", "assistant")
#: A longer line is refused before it is parsed: far beyond any sequence a LoRA job trains on
#: (a million bytes is hundreds of thousands of tokens); such a line is not parsed.
MAX_LINE_BYTES = 1024 * 1024
#: More pairs than this are refused: the trainer keeps every tokenized pair in memory, and
#: LoRA jobs learn from hundreds to tens of thousands of pairs.
MAX_PAIRS = 1_000_000
#: How many bad lines an error names (it counts them all): enough to see the pattern.
MAX_PROBLEMS_SHOWN = 10


@dataclasses.dataclass(frozen=True)
class Pair:
    """One training example from line ``line``: ``messages`` as (role, content) pairs, the
    last of which is the assistant's answer the loss is taken on."""

    line: int
    messages: tuple[tuple[str, str], ...]

    @property
    def answer(self) -> str:
        """Returns the text learnt: the last message's content."""
        return self.messages[-1][1]

    def as_messages(self) -> list[dict[str, str]]:
        """Returns the conversation as chat-template input: ``[{"role": ..., "content": ...}]``."""
        return [{"role": role, "content": content} for role, content in self.messages]


class PairsError(ValueError):
    """A pairs file was refused. ``problems`` lists (line number, reason) for every bad
    line (line 0: the file as a whole); ``str()`` names the first
    :data:`MAX_PROBLEMS_SHOWN` and says how many more there are."""

    def __init__(self, source: str, problems: list[tuple[int, str]]) -> None:
        self.source = source
        self.problems = problems
        shown = "; ".join(f"line {n}: {why}" if n else why for n, why in problems[:MAX_PROBLEMS_SHOWN])
        more = len(problems) - MAX_PROBLEMS_SHOWN
        bad = sum(1 for n, _ in problems if n)
        head = f"{source}: {bad} bad line{'s' if bad != 1 else ''}: " if bad else f"{source}: "
        super().__init__(head + shown + (f"; and {more} more" if more > 0 else ""))


def parse_pair(data: Any, line: int) -> Pair:
    """Returns the :class:`Pair` a decoded JSON line ``data`` holds (``line``: its number).

    Raises ValueError with the reason, in words, when it breaks a rule of the module docstring.
    """
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {_kind(data)}, not an object with \"prompt\" and \"completion\" or \"messages\"")
    has_messages = "messages" in data
    has_prompt = "prompt" in data or "completion" in data
    if has_messages and has_prompt:
        raise ValueError("has both \"messages\" and \"prompt\"/\"completion\": use one form")
    if has_messages:
        return Pair(line, _messages(data["messages"]))
    if not has_prompt:
        raise ValueError("has neither \"prompt\" and \"completion\" nor \"messages\"")
    prompt, completion = data.get("prompt"), data.get("completion")
    for key, value in (("prompt", prompt), ("completion", completion)):
        if value is None:
            raise ValueError(f"has no \"{key}\"")
        if not isinstance(value, str):
            raise ValueError(f"\"{key}\" is a JSON {_kind(value)}, not a string")
        if not value.strip():
            raise ValueError(f"\"{key}\" is empty")
    return Pair(line, (("user", prompt), ("assistant", completion)))


def _messages(value: Any) -> tuple[tuple[str, str], ...]:
    """Returns the checked ``messages`` list as (role, content) pairs; raises ValueError."""
    if not isinstance(value, list):
        raise ValueError(f"\"messages\" is a JSON {_kind(value)}, not a list")
    if len(value) < 2:
        raise ValueError("\"messages\" needs at least a user message and the assistant's answer after it")
    out = []
    for i, message in enumerate(value):
        where = f"message {i + 1}"
        if not isinstance(message, dict):
            raise ValueError(f"{where} is a JSON {_kind(message)}, not an object with \"role\" and \"content\"")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{where} has role {role!r}; roles are {', '.join(ROLES)}")
        if role == "system" and i != 0:
            raise ValueError(f"{where} is a system message; only the first message may be one")
        if not isinstance(content, str):
            raise ValueError(f"{where} has {'no content' if content is None else 'content that is not a string'}")
        out.append((role, content))
    if out[-1][0] != "assistant":
        raise ValueError("the last message must be the assistant's answer (the text the adapter learns)")
    if not out[-1][1].strip():
        raise ValueError("the last message (the answer) is empty")
    if not any(role == "user" for role, _ in out[:-1]):
        raise ValueError("no user message comes before the answer")
    return tuple(out)


def _kind(value: Any) -> str:
    """Returns the JSON name of ``value``'s type, for messages."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}.get(
        type(value), type(value).__name__)


def parse_pairs(lines: Iterable[str | bytes], *, source: str = "the pairs file") -> list[Pair]:
    """Returns the pairs of ``lines`` (a JSONL text split into lines, str or bytes).

    Every line is checked; raises :class:`PairsError` naming the bad lines (all of them
    are counted, not only the first) when any is bad, when there is no pair at all or
    more than :data:`MAX_PAIRS`. ``source`` names the file in the message.
    """
    pairs: list[Pair] = []
    problems: list[tuple[int, str]] = []
    for number, raw in enumerate(lines, start=1):
        if isinstance(raw, bytes):
            if len(raw) > MAX_LINE_BYTES:
                problems.append((number, f"longer than {MAX_LINE_BYTES} bytes"))
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                problems.append((number, f"not UTF-8 (byte {exc.start + 1})"))
                continue
        else:
            text = raw
            if len(text) > MAX_LINE_BYTES:
                problems.append((number, f"longer than {MAX_LINE_BYTES} bytes"))
                continue
        if not text.strip():
            continue
        try:
            data = json.loads(text)
        except ValueError as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            column = f" at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
            problems.append((number, f"not JSON ({reason}{column})"))
            continue
        try:
            pairs.append(parse_pair(data, number))
        except ValueError as exc:
            problems.append((number, str(exc)))
        if len(pairs) > MAX_PAIRS:
            problems.append((0, f"more than {MAX_PAIRS} pairs; split the job"))
            break
    if problems:
        raise PairsError(source, problems)
    if not pairs:
        raise PairsError(source, [(0, "no pairs: the file is empty or has only blank lines")])
    return pairs


def read_pairs(path: str | os.PathLike[str]) -> list[Pair]:
    """Returns the pairs of the JSONL file ``path`` (see :func:`parse_pairs`).

    Blocking (reads the whole file): call it in a thread from trio. Raises PairsError for
    bad content and OSError when the file cannot be read.
    """
    with open(path, "rb") as f:
        return parse_pairs((line.rstrip(b"\r\n") for line in f), source=str(Path(path)))
