"""Usage accounting: tokens per tenant and model, read from the engines' ``usage`` fields.

* :func:`usage_from_body` reads ``usage`` from a whole JSON answer without parsing all
  of it (embedding answers are mostly numbers).
* :class:`StreamUsage` watches an SSE stream on its way to the client: it picks up the
  final usage chunk that ``stream_options.include_usage`` makes the engine send, and
  drops that chunk when the gateway asked for it and the client did not.
* :class:`UsageMeter` adds usage up in memory; the control plane drains it into the
  store every few seconds (:meth:`UsageMeter.drain`, :meth:`UsageMeter.restore` if the
  write fails). Given a :class:`~llmgw.usage_journal.UsageJournal`, it also journals each
  request, and what it drains (a :class:`UsageBatch`) names the journal's last sequence,
  so the store can tell what a replay after a crash must still add.

Everything here is synchronous; the only I/O is the journal's one ``write`` per request.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

import attrs

from llmgw.usage_journal import UsageJournal

#: An SSE stream whose events never end (no blank line) is passed on once this much is
#: held, so a non-conforming engine cannot make the gateway buffer without bound.
MAX_HELD_BYTES = 1 << 20

_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_DECODER = json.JSONDecoder()


@attrs.frozen
class Usage:
    """Tokens one request used; ``cached_tokens``: of its prompt, those the engine found in
    its prefix cache (``prompt_tokens_details.cached_tokens``; 0 when it does not say);
    ``cached_reported``: whether it said (vLLM leaves the details out, or null, unless told
    to report them; its simulator, when it found nothing)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_reported: bool = False

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.define
class UsageCounts:
    """Requests and tokens added up for one (tenant, model)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: UsageCounts) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens


def _tokens(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def usage_of(value: Any) -> Usage | None:
    """Return the :class:`Usage` in a parsed ``usage`` object, or None if it is not one."""
    # A parsed JSON object is a dict: checked first, as the ABC check costs a microsecond.
    if type(value) is not dict and not isinstance(value, Mapping):
        return None
    details = value.get("prompt_tokens_details")  # absent (None) from engines that do not count cached tokens
    held = details.get("cached_tokens") if details is not None and (
        type(details) is dict or isinstance(details, Mapping)) else None
    reported = type(held) is int and held >= 0  # type: ignore[operator]
    cached = held if reported else 0
    return Usage(_tokens(value.get("prompt_tokens")), _tokens(value.get("completion_tokens")), cached, reported)


def usage_from_body(body: bytes) -> Usage | None:
    """Return the ``usage`` of a JSON answer (chat, completion, embedding), or None if it has none.

    Looks for the last ``"usage": {`` (engines put it last) and decodes only that object;
    falls back to parsing the whole body if that fails. Never raises.
    """
    start = body.rfind(b'"usage"')
    if start >= 0:
        match = _USAGE_OBJECT.match(body, start)
        if match is not None:
            try:
                value, _ = _DECODER.raw_decode(body[match.end() - 1:].decode())
                found = usage_of(value)
                if found is not None:
                    return found
            except (ValueError, UnicodeDecodeError):
                pass
    else:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return usage_of(parsed.get("usage")) if isinstance(parsed, dict) else None


class StreamUsage:
    """Relays an SSE stream event by event, noting (and with ``strip``, removing) usage chunks.

    :meth:`feed` each chunk from the engine and send what it returns (possibly nothing:
    an event split across chunks waits for its end); at the end send :meth:`flush`.
    ``usage`` holds the last usage seen.
    """

    def __init__(self, *, strip: bool) -> None:
        self.strip = strip
        self.usage: Usage | None = None
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """Return the complete events of ``chunk`` (plus what was held) to pass on."""
        data = self._held + chunk if self._held else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            if len(data) > MAX_HELD_BYTES:
                self._held = b""
                return data
            self._held = data
            return b""
        cut += 2
        ready, self._held = data[:cut], data[cut:]
        if _USAGE_OBJECT.search(ready) is None:
            return ready
        return self._filter(ready)

    def flush(self) -> bytes:
        """Return whatever is held (an unterminated last event), as it came."""
        held, self._held = self._held, b""
        return held

    def _filter(self, ready: bytes) -> bytes:
        kept = []
        for event in ready.split(b"\n\n"):
            if event and _USAGE_OBJECT.search(event) is not None and self._is_usage_only(event):
                continue
            kept.append(event)
        return b"\n\n".join(kept)

    def _is_usage_only(self, event: bytes) -> bool:
        """Note the usage in ``event``; return whether to drop it (a usage-only chunk, when stripping)."""
        payload = b"".join(
            line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")
        )
        try:
            parsed = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            return False
        if not isinstance(parsed, dict):
            return False
        found = usage_of(parsed.get("usage"))
        if found is None:
            return False
        self.usage = found
        return self.strip and not parsed.get("choices")


@attrs.define
class UsageBatch:
    """Usage handed from a gateway to whoever stores it: ``counts`` per (tenant, model), and
    per usage journal the last sequence those counts include (``marks``: the store keeps
    them with the counts, :mod:`llmgw.usage_journal`)."""

    counts: dict[tuple[str, str], UsageCounts] = attrs.Factory(dict)
    marks: dict[str, int] = attrs.Factory(dict)

    def __bool__(self) -> bool:
        return bool(self.counts or self.marks)


class UsageMeter:
    """Requests and tokens per (tenant, model) since the last :meth:`drain`; each one also
    appended to ``journal`` when there is one."""

    def __init__(self, journal: UsageJournal | None = None) -> None:
        self.journal = journal
        self._counts: dict[tuple[str, str], UsageCounts] = {}
        self._marks: dict[str, int] = {}

    def record(self, tenant: str, model: str, usage: Usage | None) -> None:
        """Count one finished request of ``tenant`` on ``model`` and the tokens it used (if
        known), and journal it. Never raises (a journal write failure is the journal's to count)."""
        counts = self._counts.get((tenant, model))
        if counts is None:
            counts = self._counts[(tenant, model)] = UsageCounts()
        counts.requests += 1
        if usage is not None:
            counts.prompt_tokens += usage.prompt_tokens
            counts.completion_tokens += usage.completion_tokens
        if self.journal is not None:
            known = usage if usage is not None else Usage()
            self._marks[self.journal.id] = self.journal.append(
                tenant, model, known.prompt_tokens, known.completion_tokens)

    def drain(self) -> UsageBatch:
        """Return the counts (and journal marks) since the last drain and start again from zero."""
        batch = UsageBatch(self._counts, self._marks)
        self._counts, self._marks = {}, {}
        return batch

    def restore(self, drained: UsageBatch) -> None:
        """Add back a batch from :meth:`drain` that could not be stored (or a pool worker's
        batch, handed to the pool's meter); a journal's mark only goes up."""
        for key, counts in drained.counts.items():
            self._counts.setdefault(key, UsageCounts()).add(counts)
        for journal_id, seq in drained.marks.items():
            self._marks[journal_id] = max(seq, self._marks.get(journal_id, 0))

    def pending(self) -> dict[tuple[str, str], UsageCounts]:
        """Return a copy of the counts not yet drained."""
        return {key: attrs.evolve(counts) for key, counts in self._counts.items()}

    def close(self) -> None:
        """Close the journal's open segment (the gateway stopped serving). Never raises."""
        if self.journal is not None:
            self.journal.close()
