"""What a failed server call tells its caller: one line, never the server's traceback.

pycapnp sends the exception a server method raised as text, and that text is the whole
formatted traceback: file paths, source lines, chained exceptions. :func:`remote_failure`
is what the trio backend hands pycapnp instead (:class:`llmgw.rpc.kjtrio.TrioTask`): a
:class:`RemoteError` carrying one line.

* An *expected* error (:func:`is_expected`: raised on purpose for the caller, such as a
  ValueError for refused input, a KeyError for an unknown id, an OSError naming a full
  disk, any exception class of llmgw's own) becomes its own message.
* Anything else is a bug: its traceback is logged here under a short id, and the caller
  gets ``internal error (see the server log, id X)``.

Either way the message is one line of at most :data:`MAX_REMOTE_MESSAGE` characters.
:func:`remote_reason` is the other side: the operator-facing line of a
``capnp.KjException``, also from peers that still send tracebacks.
"""

from __future__ import annotations

import logging
import secrets

import capnp
import trio

__all__ = [
    "EXPECTED_TYPES",
    "INTERNAL_ERROR",
    "MAX_REMOTE_MESSAGE",
    "RemoteError",
    "TIMED_OUT",
    "UNEXPECTED_TYPES",
    "is_expected",
    "one_line",
    "remote_failure",
    "remote_reason",
]

log = logging.getLogger(__name__)

#: Characters of a message sent to a caller: enough for a validation error that lists
#: every refused setting, bounded so an echoed input (a megabyte of model name) is not.
MAX_REMOTE_MESSAGE = 2000
#: What a caller reads for an unexpected error; ``{id}`` finds its traceback in the log.
INTERNAL_ERROR = "internal error (see the server log, id {id})"
#: What a caller reads when the server gave up waiting (trio.TooSlowError has no text).
TIMED_OUT = "timed out waiting for another part of the cluster"
#: Exceptions whose message is meant for the caller (refused input, an unknown id, a full
#: disk, a peer that did not answer). Programming errors (TypeError, AttributeError,
#: AssertionError...) are not.
EXPECTED_TYPES: tuple[type[BaseException], ...] = (
    ValueError, LookupError, PermissionError, OSError, RuntimeError, trio.TooSlowError, capnp.KjException,
)
#: Subclasses of the expected types that are programming errors all the same.
UNEXPECTED_TYPES: tuple[type[BaseException], ...] = (
    IndexError, RecursionError, NotImplementedError,
)
#: Exception classes defined under this package are llmgw's own: raised on purpose.
_OWN_PACKAGE = "llmgw."
#: Bytes of randomness in an internal error's id: unique enough to grep one log for.
_ID_BYTES = 4
#: Prefixes pycapnp and KJ put before a remote exception's own text.
_REMOTE_PREFIXES = ("remote exception:", "message =")


class RemoteError(Exception):
    """The one-line failure a caller receives in place of a server method's exception."""


def is_expected(exc: BaseException) -> bool:
    """Returns whether ``exc``'s own message is meant for the caller (see the module docstring)."""
    if isinstance(exc, UNEXPECTED_TYPES):
        return False
    return isinstance(exc, EXPECTED_TYPES) or type(exc).__module__.startswith(_OWN_PACKAGE)


def one_line(text: str, limit: int = MAX_REMOTE_MESSAGE) -> str:
    """Returns ``text``'s non-empty lines joined by ``"; "``, cut to ``limit`` characters
    (the cut marked with ``...``)."""
    joined = "; ".join(line.strip() for line in text.splitlines() if line.strip())
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


def _message(exc: BaseException) -> str:
    """Returns ``exc``'s own text for a caller: a KeyError's key without quotes, a remote
    error's reason, :data:`TIMED_OUT` for a bare timeout, else ``str(exc)``; the type's name
    when there is no text."""
    if isinstance(exc, capnp.KjException):
        return remote_reason(exc)
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    if isinstance(exc, trio.TooSlowError) and not str(exc):
        return TIMED_OUT
    return str(exc) or type(exc).__name__


def _leaf(exc: BaseException) -> BaseException:
    """Returns the only exception inside nested one-member groups (a method's nursery), else ``exc``."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def remote_failure(exc: BaseException, method: str = "") -> RemoteError:
    """Returns the :class:`RemoteError` a caller receives for ``exc``, raised by server ``method``.

    Expected errors (:func:`is_expected`) keep their message (on one line, bounded) and
    are logged at DEBUG; anything else is logged at ERROR with its traceback under a new
    id, which the returned error names. The result has no traceback, cause or context,
    so pycapnp formats exactly one line. Never raises.
    """
    leaf = _leaf(exc)
    where = f" in {method}" if method else ""
    if is_expected(leaf):
        message = one_line(_message(leaf))
        log.debug("remote call%s refused: %s", where, message)
    else:
        error_id = secrets.token_hex(_ID_BYTES)
        log.error("internal error %s%s", error_id, where, exc_info=(type(exc), exc, exc.__traceback__))
        message = INTERNAL_ERROR.format(id=error_id)
    failure = RemoteError(message)
    failure.__suppress_context__ = True
    return failure


def remote_reason(exc: capnp.KjException) -> str:
    """Returns the operator-facing line of a remote error: the server's own message,
    without KJ's location and stack, pycapnp's prefixes, a traceback (older peers send
    one: its last line is kept) or the exception's type name; bounded like the message."""
    text = exc.description or str(exc) or ""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("stack: ")]
    last = lines[-1] if lines else str(exc.type)
    changed = True
    while changed:
        changed = False
        for prefix in _REMOTE_PREFIXES:
            if last.startswith(prefix):
                last, changed = last[len(prefix):].strip(), True
    head, sep, rest = last.partition(": ")
    if sep and " " not in head and head.replace(".", "").replace("_", "").isalnum() and head[:1].isalpha():
        last = rest
    return one_line(last)
