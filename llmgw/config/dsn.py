"""Store locations: which backend a store string names, and its DSN without secrets.

:func:`store_backend` decides, from the text alone, whether a store location is a
PostgreSQL DSN (a ``postgresql://`` / ``postgres://`` URL, or libpq's ``key=value``
form) or a SQLite file (``sqlite:///PATH``, ``sqlite:PATH``, or a plain path). Text that
looks like ``key=value`` but is not valid conninfo is an error, never a file name: a
mistyped DSN must not become a new SQLite file named after its password.
:func:`redact_dsn` drops the password from a DSN and :func:`mask_secrets` removes it from
any message (a driver's error, a log line). Pure Python and neutral: the config reader,
the store and the tests share it without loading a database driver.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Literal

__all__ = [
    "MASK",
    "POSTGRES_SCHEMES",
    "Backend",
    "dsn_passwords",
    "mask_secrets",
    "parse_conninfo",
    "redact_dsn",
    "store_backend",
]

Backend = Literal["sqlite", "postgresql"]

#: URL schemes libpq accepts (case-sensitive, as libpq matches them).
POSTGRES_SCHEMES = ("postgresql", "postgres")
#: What a secret is replaced with in messages.
MASK = "***"

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_KEYWORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PASSWORD_KEYS = ("password", "sslpassword")
# A password=VALUE pair in text that did not parse as conninfo (quoted or not).
_LOOSE_PASSWORD = re.compile(r"(?:ssl)?password\s*=\s*('(?:[^'\\]|\\.)*'?|\S+)")


def parse_conninfo(text: str) -> dict[str, str]:
    """Parse libpq's ``key=value`` connection string the way libpq does; return the pairs.

    Pairs are separated by whitespace, with optional spaces around ``=``; a value is either
    single-quoted (``\\'`` and ``\\\\`` escapes inside) or runs to the next whitespace
    (``\\`` escapes one character). Keywords are not checked against libpq's list (a newer
    libpq knows more): connecting reports an unknown one. Raises ValueError naming the
    pair's position and the problem, never a value (it may be a password).
    """
    pairs: dict[str, str] = {}
    i, n, count = 0, len(text), 0
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            break
        count += 1
        match = _KEYWORD.match(text, i)
        if match is None:
            raise ValueError(f"key=value pair {count} does not start with a keyword (letters, digits, '_')")
        i = match.end()
        while i < n and text[i].isspace():
            i += 1
        if i >= n or text[i] != "=":
            raise ValueError(f"key=value pair {count} has no '=' after its keyword")
        i += 1
        while i < n and text[i].isspace():
            i += 1
        value, i = _conninfo_value(text, i, count)
        pairs[match.group()] = value
    if not pairs:
        raise ValueError("the connection string is empty")
    return pairs


def _conninfo_value(text: str, i: int, count: int) -> tuple[str, int]:
    """Read one value starting at ``text[i]``; return it and the index after it."""
    quoted = i < len(text) and text[i] == "'"
    if quoted:
        i += 1
    chars: list[str] = []
    while i < len(text):
        char = text[i]
        if quoted and char == "'":
            return "".join(chars), i + 1
        if not quoted and char.isspace():
            break
        if char == "\\" and i + 1 < len(text):
            i += 1
            char = text[i]
        chars.append(char)
        i += 1
    if quoted:
        raise ValueError(f"key=value pair {count} has an unterminated quoted value")
    return "".join(chars), i


def _scheme(text: str) -> str | None:
    match = _SCHEME.match(text)
    return match.group(1) if match else None


def store_backend(text: str) -> tuple[Backend, str]:
    """Return ``(backend, location)`` for a store location.

    ``postgresql://...`` / ``postgres://...`` and libpq ``key=value`` text ->
    ``("postgresql", text)``; ``sqlite:///abs/path``, ``sqlite://rel``, ``sqlite:rel`` ->
    ``("sqlite", path)``; other text without ``=`` -> ``("sqlite", text)`` (a plain path).
    Raises ValueError for empty text, another URL scheme, a SQLite URL with no file, or
    ``key=value`` text that is not valid conninfo (write ``sqlite:///PATH`` for a file whose
    name holds ``=``); the reason never repeats the text, which may hold a password.
    """
    scheme = _scheme(text)
    if scheme in POSTGRES_SCHEMES:
        return "postgresql", text
    if scheme is not None and scheme != "sqlite":
        raise ValueError(
            f"unsupported scheme {scheme!r}: use a SQLite file path, sqlite:///PATH, a postgresql:// URL "
            "or a libpq key=value DSN"
        )
    if text.startswith("sqlite:"):
        path = text[len("sqlite:"):]
        path = path[2:] if path.startswith("//") else path
        path = "/" + path.lstrip("/") if path.startswith("/") else path  # sqlite:////abs is /abs too
        if not path:
            raise ValueError("the SQLite URL names no file: use sqlite:///path/to/llmgw.db")
        return "sqlite", path
    if not text.strip():
        raise ValueError("the store location is empty: give a SQLite file or a PostgreSQL DSN")
    if "=" in text:
        try:
            parse_conninfo(text)
        except ValueError as exc:
            raise ValueError(
                f"looks like a libpq key=value DSN but is not one: {exc} (for a SQLite file whose "
                "name holds '=', write sqlite:///PATH)"
            ) from None
        return "postgresql", text
    return "sqlite", text


def redact_dsn(dsn: str) -> str:
    """Return ``dsn`` (a URL or ``key=value`` conninfo) with its passwords removed, and
    masked wherever else they appear (another value that holds the same text).

    Text that does not parse is returned as ``<unparseable DSN>``, never as it is.
    """
    return mask_secrets(_without_passwords(dsn), dsn)


def _without_passwords(dsn: str) -> str:
    if _scheme(dsn) is not None:
        parts = urllib.parse.urlsplit(dsn)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, hosts = netloc.rsplit("@", 1)
            netloc = f"{userinfo.split(':', 1)[0]}@{hosts}"
        query = urllib.parse.urlencode(
            [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k not in _PASSWORD_KEYS]
        )
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))
    try:
        params = parse_conninfo(dsn)
    except ValueError:
        return "<unparseable DSN>"
    return " ".join(f"{key}={_quote(value)}" for key, value in params.items() if key not in _PASSWORD_KEYS)


def _quote(value: str) -> str:
    if value and not any(c.isspace() or c in "'\\" for c in value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def dsn_passwords(dsn: str) -> list[str]:
    """Return every secret written in ``dsn``: its passwords, raw and as written (URL-encoded).

    Best effort on text that does not parse (a ``password=`` pair is still found), so a
    malformed DSN's secret is masked too.
    """
    found: list[str] = []
    if _scheme(dsn) is not None:
        # Up to the last '@' before any query: a password with an unencoded '/' or '@' in it
        # (a malformed URL) is still found whole; a spurious match only masks more.
        rest = dsn.split("://", 1)[1].split("?", 1)[0]
        userinfo = rest.rsplit("@", 1)[0] if "@" in rest else ""
        if ":" in userinfo:
            written = userinfo.split(":", 1)[1]
            found += [written, urllib.parse.unquote(written)]
        query = dsn.split("?", 1)[1] if "?" in dsn else ""
        for key, value in urllib.parse.parse_qsl(query):
            if key in _PASSWORD_KEYS:
                found.append(value)
        found += [m.group(1) for m in _LOOSE_PASSWORD.finditer(query)]
    else:
        try:
            found += [v for k, v in parse_conninfo(dsn).items() if k in _PASSWORD_KEYS]
        except ValueError:
            pass
        for match in _LOOSE_PASSWORD.finditer(dsn):
            written = match.group(1)
            found += [written, written.strip("'")]
    # Longest first, so a password is masked whole before a shorter form of it.
    return sorted({s for s in found if s}, key=len, reverse=True)


def mask_secrets(message: str, dsn: str) -> str:
    """Return ``message`` with every password of ``dsn`` replaced by :data:`MASK`."""
    for secret in dsn_passwords(dsn):
        message = message.replace(secret, MASK)
    return message
