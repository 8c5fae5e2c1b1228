"""Repeated failures in the log: the first of a kind once, then at most one line per interval.

A failure that repeats (an agent cut off from its control plane, a port scanner on the RPC
port, an engine that keeps crashing) must not write a line, let alone a traceback, each
time. :class:`LogThrottle` writes the first failure of a *kind* (any hashable key, e.g.
``("reporter", shard_id)``) with its reason and, if given, its traceback; further failures
of that kind within ``interval`` seconds are counted, not written; the first one after the
interval writes one line that says how many were suppressed. Tracebacks after the first go
to DEBUG only. :meth:`LogThrottle.recovered` ends a kind: it says how many failures were
not written since the last line, and the next failure is written at once again.

Not thread-safe: use one throttle per trio thread (or per object living in one).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Hashable

import trio

__all__ = ["DEFAULT_INTERVAL_S", "MAX_KINDS", "MAX_REASON_CHARS", "LogThrottle", "is_disconnection", "reason"]

#: Seconds between two lines for one kind of failure: a failure that persists shows up
#: once a minute, which is enough to see it is still there and few enough to read the rest.
DEFAULT_INTERVAL_S = 60.0

#: Kinds remembered at once; the least recently failed is forgotten beyond it (then its
#: next failure is written at once). Keys per peer or per shard must not grow without bound.
MAX_KINDS = 1024

#: Characters of an exception's text in a line: a remote traceback or an echoed request
#: must not make one failure a screenful.
MAX_REASON_CHARS = 300


def reason(exc: BaseException) -> str:
    """Returns one line saying why ``exc`` happened: the last non-empty line of its text (a
    remote traceback ends with what failed; KJ's ``stack:`` trailer is not a reason, and a
    KJ error's ``description`` is used when it has one), cut to :data:`MAX_REASON_CHARS`;
    its type's name if it has no text."""
    description = getattr(exc, "description", None)
    text = description if isinstance(description, str) and description.strip() else str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("stack: ")]
    text = lines[-1] if lines else type(exc).__name__
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def is_disconnection(exc: BaseException) -> bool:
    """Returns whether ``exc`` only says that a peer or connection went away (a KJ
    ``DISCONNECTED`` error, a broken or closed stream, a socket error): its :func:`reason`
    says all, so it is logged without a traceback. Anything else may be a bug: keep it."""
    if getattr(exc, "type", None) == "DISCONNECTED":
        return True
    return isinstance(exc, (OSError, trio.BrokenResourceError, trio.ClosedResourceError))


class _Kind:
    __slots__ = ("logged_at", "suppressed")

    def __init__(self, logged_at: float) -> None:
        self.logged_at = logged_at
        self.suppressed = 0


class LogThrottle:
    """Writes failures of one kind to ``logger`` once, then at most once per ``interval``.

    ``clock`` returns seconds (monotonic; tests pass a fake one or ``trio.current_time``).
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        max_kinds: int = MAX_KINDS,
    ) -> None:
        if interval <= 0 or max_kinds < 1:
            raise ValueError(f"interval must be > 0 and max_kinds >= 1, got {interval!r}, {max_kinds!r}")
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._max_kinds = max_kinds
        self._kinds: collections.OrderedDict[Hashable, _Kind] = collections.OrderedDict()

    def failure(
        self, key: Hashable, level: int, msg: str, *args: Any, exc_info: Any = None
    ) -> bool:
        """Record one failure of kind ``key``; returns whether a line was written.

        The first failure of a kind is written as ``logger.log(level, msg, *args,
        exc_info=exc_info)``. Later ones within ``interval`` of the last line are only
        counted (with ``exc_info``, their traceback goes to DEBUG if that is enabled); the
        first one past it is written without a traceback, followed by how many were
        suppressed and over how long.
        """
        now = self._clock()
        kind = self._kinds.get(key)
        if kind is None:
            self._remember(key, _Kind(now))
            self.logger.log(level, msg, *args, exc_info=exc_info)
            return True
        self._kinds.move_to_end(key)
        if now - kind.logged_at < self.interval:
            kind.suppressed += 1
            if exc_info and self.logger.isEnabledFor(logging.DEBUG):
                self.logger.debug(msg, *args, exc_info=exc_info)
            return False
        suppressed, since = kind.suppressed, now - kind.logged_at
        kind.logged_at, kind.suppressed = now, 0
        self.logger.log(level, msg + " (again; %d more not logged in the last %.0fs)", *args, suppressed, since)
        if exc_info and self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug(msg, *args, exc_info=exc_info)
        return True

    def recovered(self, key: Hashable, msg: str | None = None, *args: Any) -> bool:
        """Forget kind ``key`` (it works again), so that its next failure is written at once.

        If failures were suppressed since its last line and ``msg`` is given, writes ``msg``
        at INFO with how many; returns whether a line was written. Unknown keys are ignored.
        """
        kind = self._kinds.pop(key, None)
        if kind is None or not kind.suppressed or msg is None:
            return False
        self.logger.info(msg + " (after %d more failures not logged)", *args, kind.suppressed)
        return True

    def suppressed(self, key: Hashable) -> int:
        """Returns how many failures of ``key`` were counted but not written since its last line."""
        kind = self._kinds.get(key)
        return kind.suppressed if kind is not None else 0

    def _remember(self, key: Hashable, kind: _Kind) -> None:
        self._kinds[key] = kind
        while len(self._kinds) > self._max_kinds:
            self._kinds.popitem(last=False)
