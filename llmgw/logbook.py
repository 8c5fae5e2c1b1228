"""Log lines as llmgw keeps them: secrets taken out, and the last lines held in memory.

:func:`redact` replaces every secret a line could carry with ``[redacted]``: API keys
(``llmgw_<id>_<secret>``), admin tokens (``llmgwadmin_<id>_<secret>``) and join tokens
(``llmgwj1.<id>.<secret>.<pin>``) keep their id (so a line still says which one) but lose
their secret; a password in a URL (``postgresql://user:PASSWORD@host``), an
``Authorization: Bearer`` value, ``password=``/``token=`` style pairs and PEM private keys
lose their value. :class:`RedactingFormatter` applies it to every formatted record (message,
arguments and traceback alike), so no handler llmgw installs writes a secret.

:class:`LogRing` is a handler keeping the last :data:`RING_LINES` formatted lines: the
agent's, for ``llmgw ctl logs NODE`` (read over the session the agent already holds).
"""

from __future__ import annotations

import collections
import logging
import re
import threading
from typing import Sequence

#: Lines the agent keeps in memory for ``llmgw ctl logs NODE --source agent``.
RING_LINES = 2000
REDACTED = "[redacted]"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # PEM private keys, whole (multi-line in tracebacks or dumped files).
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.S),
     f"-----BEGIN PRIVATE KEY----- {REDACTED}"),
    # Join tokens: keep the prefix and id, drop the secret and the pin.
    (re.compile(r"\b(llmgwj1\.[0-9a-f]+)\.[A-Za-z0-9_-]+(?:\.[0-9a-f]+)?"), rf"\1.{REDACTED}"),
    # API keys and admin tokens: keep the prefix and id, drop the secret.
    (re.compile(r"\b(llmgw(?:admin)?_[0-9a-f]+)_[A-Za-z0-9_-]+"), rf"\1_{REDACTED}"),
    # A password in a URL's user info (postgresql://user:secret@host).
    (re.compile(r"(\b[a-z][a-z0-9+.-]*://[^\s:/@]+:)[^\s@/]+@"), rf"\1{REDACTED}@"),
    # Bearer credentials in headers.
    (re.compile(r"(?i)(\bbearer\s+)[^\s'\",]+"), rf"\1{REDACTED}"),
    # key=value / key: value pairs that name a secret (DSNs in key=value form, env dumps, JSON).
    (re.compile(r"(?i)(\b(?:password|passwd|secret|token|api[_-]?key|hf_token)[\"']?\s*[=:]\s*[\"']?)[^\s\"',;&}]+"),
     rf"\1{REDACTED}"),
)


def redact(text: str) -> str:
    """Returns ``text`` with every secret llmgw knows the shape of replaced (see the module docstring)."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class RedactingFormatter(logging.Formatter):
    """A formatter whose output never carries a secret: :func:`redact` over the whole record."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class LogRing(logging.Handler):
    """Keeps the last ``capacity`` formatted lines (a record with a traceback counts as its
    lines). Thread-safe: records may come from any thread."""

    def __init__(self, capacity: int = RING_LINES) -> None:
        super().__init__()
        self._lines: collections.deque[str] = collections.deque(maxlen=capacity)
        #: Lines ever added: the cursor a follower passes back (:meth:`after`).
        self.total = 0
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)
            return
        added = text.splitlines() or [""]
        with self._guard:
            self._lines.extend(added)
            self.total += len(added)

    def after(self, cursor: int, limit: int) -> tuple[list[str], int]:
        """Returns the lines added since ``cursor`` and the new cursor (:func:`lines_after`)."""
        with self._guard:
            kept, total = list(self._lines), self.total
        return lines_after(kept, total, cursor, limit)


def lines_after(kept: Sequence[str], total: int, cursor: int, limit: int) -> tuple[list[str], int]:
    """Returns the lines added after ``cursor`` (a ``total`` returned earlier) to a buffer that
    keeps the last lines ``kept`` of ``total`` ever added, at most the newest ``limit`` of
    them, and the new cursor. Cursor 0 (a first read) gets the last ``limit`` lines kept.
    Lines that left the buffer (or were skipped past ``limit``) are said in one line; a
    cursor beyond ``total`` (the buffer started again: a restarted agent) starts over from
    what is kept."""
    if cursor == 0:
        return list(kept)[-limit:] if limit > 0 else [], total
    first_kept = total - len(kept)
    if cursor > total:
        cursor, note = first_kept, ["(the log started again)"]
    else:
        note = []
    start = max(cursor, first_kept, total - limit)
    skipped = start - cursor
    new = list(kept)[start - first_kept:]
    if skipped > 0:
        note.append(f"({skipped} lines skipped)")
    return note + new, total


#: The ring of this process's log, once :func:`keep_in_memory` installed it (None: not kept).
PROCESS_RING: LogRing | None = None


def keep_in_memory(capacity: int = RING_LINES) -> LogRing:
    """Install (once) a :class:`LogRing` on the root logger, formatted like the process's log
    (redacted), and return it."""
    global PROCESS_RING
    if PROCESS_RING is None:
        ring = LogRing(capacity)
        root = logging.getLogger()
        template = root.handlers[0].formatter if root.handlers else None
        ring.setFormatter(RedactingFormatter(template._fmt if template is not None else None))
        root.addHandler(ring)
        PROCESS_RING = ring
    return PROCESS_RING
