"""Usage accounting: tokens per tenant and model, read from the engines' ``usage`` fields.

* :func:`usage_from_body` reads ``usage`` from a whole JSON answer without parsing all
  of it (embedding answers are mostly numbers).
* :class:`StreamUsage` watches an SSE stream on its way to the client: it picks up the
  final usage chunk that ``stream_options.include_usage`` makes the engine send, and
  drops that chunk when the gateway asked for it and the client did not.
* :class:`UsageMeter` adds usage up in memory; the control plane drains it into the
  store every few seconds (:meth:`UsageMeter.drain`, :meth:`UsageMeter.restore` if the
  write fails).

Everything here is synchronous and does no I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

import attrs

#: An SSE stream whose events never end (no blank line) is passed on once this much is
#: held, so a non-conforming engine cannot make the gateway buffer without bound.
MAX_HELD_BYTES = 1 << 20

_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_DECODER = json.JSONDecoder()


@attrs.frozen
class Usage:
    """Tokens one request used."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

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
    if not isinstance(value, Mapping):
        return None
    return Usage(_tokens(value.get("prompt_tokens")), _tokens(value.get("completion_tokens")))


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


class UsageMeter:
    """Requests and tokens per (tenant, model) since the last :meth:`drain`."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], UsageCounts] = {}

    def record(self, tenant: str, model: str, usage: Usage | None) -> None:
        """Count one finished request of ``tenant`` on ``model`` and the tokens it used (if known)."""
        counts = self._counts.get((tenant, model))
        if counts is None:
            counts = self._counts[(tenant, model)] = UsageCounts()
        counts.requests += 1
        if usage is not None:
            counts.prompt_tokens += usage.prompt_tokens
            counts.completion_tokens += usage.completion_tokens

    def drain(self) -> dict[tuple[str, str], UsageCounts]:
        """Return the counts since the last drain and start again from zero."""
        counts, self._counts = self._counts, {}
        return counts

    def restore(self, drained: Mapping[tuple[str, str], UsageCounts]) -> None:
        """Add back counts from :meth:`drain` that could not be stored."""
        for key, counts in drained.items():
            self._counts.setdefault(key, UsageCounts()).add(counts)

    def pending(self) -> dict[tuple[str, str], UsageCounts]:
        """Return a copy of the counts not yet drained."""
        return {key: attrs.evolve(counts) for key, counts in self._counts.items()}
