"""Reads a profile's engine arguments the way the engine's parser would, against its table.

:func:`read` walks the arguments as the engine does (see :class:`~llmgw.catalog.engine_flags.Table`
``style``) and returns every option it would set (:class:`Use`) and every argument llmgw
refuses (:class:`Problem`): options classified as refused, options the table does not know,
values outside a safe option's allowed ones, values with no option before them (the engine
would take them as its model), missing values, and spellings that could mean another option
in another engine version (argparse abbreviations, short options with the value attached).
"""

from __future__ import annotations

import re
from typing import Sequence

import attrs

from llmgw.catalog.engine_flags import MANY, OPTIONAL, Opt, Table

__all__ = ["DOCS", "Problem", "Use", "read"]

#: Where an operator reads how the allowlist works (named in refusals of unknown options).
DOCS = "docs/engine-options.md"
#: What argparse reads as a negative number (a value, not an option).
_NEGATIVE = re.compile(r"^-\d+$|^-\d*\.\d+$")
#: vLLM turns ``-O3``/``-O=3``/``-O 3`` into ``--optimization-level 3``.
_VLLM_O_LEVEL = "--optimization-level"
_VLLM_O_VALUES = frozenset({"0", "1", "2", "3"})


@attrs.frozen
class Use:
    """An option the engine would read: at ``index`` in the arguments, written ``written``, its values."""

    index: int
    written: str
    opt: Opt
    values: tuple[str, ...]


@attrs.frozen
class Problem:
    """A refused argument: at ``index``; ``subject``: the option as written; ``reason``: a
    sentence starting with the subject."""

    index: int
    subject: str
    reason: str


@attrs.define
class _Reader:
    table: Table
    running: str | None
    items: list[tuple[int, str]]
    uses: list[Use] = attrs.Factory(list)
    problems: list[Problem] = attrs.Factory(list)

    def refuse(self, index: int, subject: str, why: str, *, as_: str | None = None) -> None:
        shown = subject if as_ is None else f"{subject} ({as_})"
        self.problems.append(Problem(index, subject, f"{shown} is not allowed: {why}"))

    def unclassified(self, index: int, subject: str) -> None:
        self.refuse(index, subject, (
            f"it is not classified for {self.table.describe(self.running)}; llmgw passes an engine only the "
            f"options classified safe (see {DOCS})"))

    def stray(self, index: int, token: str) -> None:
        if token.startswith("-") and " " in token:
            head, _, rest = token.partition(" ")
            why = (f"it is one argument with a space in it, which {self.table.engine} does not read as the option "
                   f"{head} (an option and its value are separate arguments: {head!r}, {rest!r})")
        else:
            why = f"a value with no option before it ({self.table.engine} would read it as its model)"
        self.problems.append(Problem(index, token, f"{token!r} is not allowed: {why}"))

    def too_few(self, index: int, key: str, least: int) -> None:
        self.refuse(index, key, "it needs a value after it" if least == 1 else f"it needs {least} values after it")

    def use(self, index: int, written: str, option: Opt, values: Sequence[str]) -> None:
        """Records ``option`` set to ``values``, refusing it if it is refused or a value is not allowed."""
        if option.refused is not None:
            self.refuse(index, written, option.refused)
            return
        if option.allowed_values is not None:
            for value in values:
                if value not in option.allowed_values:
                    self.refuse(index, written, (
                        f"the value {value!r} is not one of the safe ones "
                        f"({', '.join(option.allowed_values)})"))
                    return
        self.uses.append(Use(index, written, option, tuple(values)))

    # -- argparse (vLLM, SGLang, the simulator) -----------------------------------------

    def abbreviations(self, key: str) -> list[str]:
        """Returns the option names argparse could read ``key`` as (prefixes and short+value)."""
        found = {name for name in self.table.by_name if name.startswith(key) and name != key}
        if not key.startswith("--") and len(key) > 2 and key[:2] in self.table.by_name:
            found.add(key[:2])
        return sorted(found)

    def classify(self, token: str) -> tuple[str, str, str | None] | None:
        """Returns (kind, key, explicit value) as argparse sees ``token``; None: a value.

        kind: ``"known"`` (``key`` is a table name), ``"unknown"`` (an option-looking token).
        """
        if not token.startswith("-") or token == "-":
            return None
        key, eq, explicit = token.partition("=")
        key = self.normalise(key)
        if self.normalise(token) in self.table.by_name:
            return "known", self.normalise(token), None
        if eq and key in self.table.by_name:
            return "known", key, explicit
        if self.abbreviations(key):
            return "unknown", key, explicit if eq else None
        if _NEGATIVE.match(token) or " " in token:
            return None
        return "unknown", key, explicit if eq else None

    def normalise(self, key: str) -> str:
        """Returns ``key`` as the parser compares it (vLLM reads ``_`` as ``-`` in long names)."""
        if self.table.style == "vllm" and key.startswith("--"):
            head, dot, tail = key.partition(".")
            return head.replace("_", "-") + dot + tail
        return key

    def argparse(self) -> None:
        items = self.items
        i = 0
        while i < len(items):
            index, token = items[i]
            i += 1
            if token == "--":
                self.refuse(index, token, "it ends the options: what follows would be read as positional arguments")
                continue
            seen = self.classify(token)
            if seen is None:
                self.stray(index, token)
                continue
            kind, key, explicit = seen
            if kind == "unknown":
                self.unknown_argparse(index, key)
                if explicit is None:  # skip the values the engine would give it, to report each problem once
                    while i < len(items) and self.classify(items[i][1]) is None:
                        i += 1
                continue
            option = self.table.by_name[key]
            if explicit is not None:
                if option.values == 0:
                    self.refuse(index, key, "it is a flag and takes no value")
                elif isinstance(option.values, int) and option.values > 1:
                    self.refuse(index, key, f"it takes {option.values} values: write them as separate arguments")
                else:
                    self.use(index, key, option, [explicit])
                continue
            values: list[str] = []
            want = option.values
            limit = want if isinstance(want, int) else (1 if want == OPTIONAL else len(items))
            while len(values) < limit and i < len(items) and self.classify(items[i][1]) is None:
                values.append(items[i][1])
                i += 1
            least = want if isinstance(want, int) else (1 if want == MANY else 0)
            if len(values) < least:
                self.too_few(index, key, least)
                continue
            self.use(index, key, option, values)

    def unknown_argparse(self, index: int, key: str) -> None:
        names = self.abbreviations(key)
        if not names:
            self.unclassified(index, key)
            return
        if len(names) > 1:
            self.refuse(index, key, f"it abbreviates several options ({', '.join(names)}); write the option in full")
            return
        (name,) = names
        option = self.table.by_name[name]
        if not key.startswith("--") and key[:2] == name:
            why = option.refused or f"write the option and its value as separate arguments ({name} {key[2:]})"
            self.refuse(index, key, why, as_=f"read as {name} {key[2:]}")
            return
        why = option.refused or (
            f"write the option in full: an abbreviation can mean another option in another {self.table.engine} version")
        self.refuse(index, key, why, as_=f"an abbreviation of {name}")

    # -- vLLM's own pass before argparse ---------------------------------------------------

    def vllm_prepass(self) -> None:
        """Applies vLLM's rewriting (``-O3``, ``--opt.key value`` JSON keys), then argparse."""
        rewritten: list[tuple[int, str]] = []
        items = self.items
        i = 0
        while i < len(items):
            index, token = items[i]
            if token.startswith("--help="):
                rewritten.append((index, "--help"))
            elif not token.startswith("--") and token.startswith("-O") and token != "-O":
                rewritten += [(index, _VLLM_O_LEVEL), (index, token[3:] if token[2:3] == "=" else token[2:])]
            elif token == "-O" and i + 1 < len(items) and items[i + 1][1] in _VLLM_O_VALUES:
                rewritten.append((index, _VLLM_O_LEVEL))
            elif token.startswith("--"):
                head, eq, tail = token.partition("=")
                rewritten.append((index, self.normalise(head) + eq + tail))
            else:
                rewritten.append((index, token))
            i += 1
        rest: list[tuple[int, str]] = []
        skip: set[int] = set()
        for k, (index, token) in enumerate(rewritten):
            if k in skip:
                continue
            if not (token.startswith("-") and "." in token):  # vLLM's test for a --option.key argument
                rest.append((index, token))
                continue
            key, eq, value = token.partition("=")
            if eq and "." not in key:
                rest.append((index, token))
                continue
            if not eq:
                if k + 1 >= len(rewritten):
                    self.refuse(index, key, "vLLM reads it as a JSON key (--option.key VALUE) and it has no value")
                    continue
                value = rewritten[k + 1][1]
                skip.add(k + 1)
            self.dotted(index, key, value)
        self.items = rest
        self.argparse()

    def dotted(self, index: int, key: str, value: str) -> None:
        """Checks ``--option.key VALUE`` (vLLM sets one key of the JSON option ``--option``)."""
        base = key.rstrip("+").split(".", 1)[0]
        if base not in self.table.by_name:
            self.unknown_argparse(index, base) if self.abbreviations(base) else self.refuse(
                index, key, f"vLLM reads it as a key of the JSON option {base}, which is not classified for "
                f"{self.table.describe(self.running)} (see {DOCS})")
            return
        option = self.table.by_name[base]
        if option.refused is not None:
            self.refuse(index, key, option.refused, as_=f"a key of {base}")
        elif option.values == 0 or option.allowed_values is not None:
            self.refuse(index, key, f"{base} takes no JSON keys", as_=f"a key of {base}")
        else:
            self.uses.append(Use(index, key, option, (value,)))

    # -- llama.cpp ------------------------------------------------------------------------

    def llama(self) -> None:
        items = self.items
        i = 0
        while i < len(items):
            index, token = items[i]
            i += 1
            key = token.replace("_", "-") if token.startswith("--") else token
            option = self.table.by_name.get(key)
            if option is None:
                head = key.partition("=")[0]
                if not token.startswith("-"):
                    self.stray(index, token)
                elif "=" in key and head in self.table.by_name:
                    self.refuse(index, head, (
                        f"llama-server reads {token!r} as one unknown argument: write {head} and its value "
                        "as separate arguments"))
                else:
                    self.unclassified(index, head)
                continue
            want = option.values if isinstance(option.values, int) else 1
            values = [t for _, t in items[i:i + want]]
            i += want
            if len(values) < want:
                self.too_few(index, key, want)
                continue
            self.use(index, key, option, values)


def read(table: Table, items: Sequence[tuple[int, str]], *, running: str | None = None) -> tuple[list[Use], list[Problem]]:
    """Returns (the options the engine would read, the refused arguments) of ``items``.

    ``items``: (index in the profile's arguments, argument) pairs, in order; ``running``: the
    engine version that will read them, when known (named in refusals of unknown options).
    """
    reader = _Reader(table, running, list(items))
    if table.style == "llama":
        reader.llama()
    elif table.style == "vllm":
        reader.vllm_prepass()
    else:
        reader.argparse()
    reader.problems.sort(key=lambda p: p.index)
    return reader.uses, reader.problems
