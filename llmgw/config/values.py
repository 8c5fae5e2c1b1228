"""Value types and the parsers of single configuration values.

Each parser takes a value as YAML gave it and returns it checked and normalised, or
raises :class:`ValueError` with the reason; the reader (:mod:`.yaml_reader`) adds the
file and the key path to make it a :class:`~llmgw.config.ConfigError`.
"""

from __future__ import annotations

import ipaddress
import math
import re
import types
from typing import Any, Callable, Mapping

import attrs

from llmgw.credentials import check_name

__all__ = [
    "ENGINE_NAME",
    "ENGINE_NAME_RULE",
    "LOG_LEVELS",
    "Address",
    "count",
    "frozen_mapping",
    "parse_address",
    "parse_bool",
    "parse_duration",
    "is_loopback_host",
    "parse_host",
    "parse_log_level",
    "parse_node_id",
    "parse_ratio",
    "parse_str",
    "parse_url_or_empty",
    "positive",
    "show",
]

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: Engine names as keys of ``engines:`` (server.yaml) and ``engine_urls:`` (agent.yaml).
ENGINE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
ENGINE_NAME_RULE = "engine names are lower-case letters, digits, '.', '_' and '-'"

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


@attrs.frozen
class Address:
    """A ``host:port`` pair; ``str()`` gives it back in that form (IPv6 in brackets)."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def frozen_mapping(value: Mapping[str, str]) -> Mapping[str, str]:
    """A read-only copy of ``value`` (for the mapping fields of frozen configs)."""
    return types.MappingProxyType(dict(value))


def show(value: Any) -> str:
    """A value as the operator wrote it: strings in double quotes, the rest as YAML would."""
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'
    if value is None:
        return "null (empty)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return str(value)


def parse_duration(value: Any) -> float:
    """Return seconds from a number (seconds) or a string such as ``"10s"``, ``"2m"``,
    ``"500ms"``, ``"1h"``, ``"1m30s"`` or ``"10"``. Raises :class:`ValueError` for anything
    else, for negative or infinite values."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f'expected a duration like 10, "10s", "2m" or "500ms", got {show(value)}')
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            compact = text.replace(" ", "")
            parts = list(_DURATION_PART.finditer(compact))
            if not parts or "".join(p.group(0) for p in parts) != compact:
                raise ValueError(
                    f'expected a duration like 10, "10s", "2m" or "500ms", got {show(value)}'
                ) from None
            seconds = sum(float(p.group(1)) * _DURATION_UNITS[p.group(2)] for p in parts)
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"expected a duration of 0 seconds or more, got {show(value)}")
    return seconds


def positive(parse: Callable[[Any], float]) -> Callable[[Any], float]:
    """Return ``parse`` (a duration parser) that also refuses 0 seconds."""

    def checked(value: Any) -> float:
        seconds = parse(value)
        if seconds <= 0:
            raise ValueError(f"must be more than 0 seconds, got {show(value)}")
        return seconds

    return checked


def _check_host(host: str) -> str:
    """Return ``host`` if it is an IP address or a DNS name; raise ValueError otherwise."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if not host or len(host) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"{show(host)} is neither an IP address nor a host name")
    return host


def parse_address(value: Any, *, listen: bool = False) -> Address:
    """Return an :class:`Address` from ``"host:port"`` (``"[::1]:7070"`` for IPv6).

    With ``listen`` the port may be 0 (the system picks one). Raises :class:`ValueError`
    with the reason otherwise.
    """
    expected = f'expected "host:port", got {show(value)}'
    if not isinstance(value, str):
        raise ValueError(expected)
    text = value.strip()
    bracketed = re.fullmatch(r"\[([^\]]*)\]:([^:]*)", text)
    if bracketed:
        host, port_text = bracketed.groups()
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise ValueError(f"{show(host)} in brackets is not an IPv6 address") from None
    else:
        if ":" not in text:
            raise ValueError(expected)
        host, port_text = text.rsplit(":", 1)
        if ":" in host:
            raise ValueError(f'IPv6 addresses go in brackets, e.g. "[{host}]:{port_text}"; '
                             f"got {show(value)}")
        if not host:
            hint = ' (use "0.0.0.0:PORT" to listen on every address)' if listen else ""
            raise ValueError(f"missing host in {show(value)}{hint}")
        host = _check_host(host)
    if not port_text.isdigit():
        raise ValueError(f"port {show(port_text)} is not a number, in {show(value)}")
    port = int(port_text)
    lowest = 0 if listen else 1
    if not lowest <= port <= 65535:
        raise ValueError(f"port {port} is out of range {lowest}-65535, in {show(value)}")
    return Address(host, port)


def parse_str(value: Any) -> str:
    """Return a non-empty string, stripped."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty string, got {show(value)}")
    return value.strip()


def is_loopback_host(host: str) -> bool:
    """Returns whether ``host`` (an address to listen on or a peer's address, or
    ``localhost``) is loopback only: brackets and an IPv6 zone id are ignored, and an
    IPv4-mapped IPv6 address counts as its IPv4 address. A name other than ``localhost``
    is not loopback."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def parse_host(value: Any) -> str:
    """Return an IP address (IPv6 with or without brackets) or a DNS name."""
    return _check_host(parse_str(value).strip("[]"))


def parse_log_level(value: Any) -> str:
    """Return one of :data:`LOG_LEVELS`, in lower case."""
    if isinstance(value, str) and value.strip().lower() in LOG_LEVELS:
        return value.strip().lower()
    raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {show(value)}")


def parse_node_id(value: Any) -> str:
    """Return a node id, which must be able to name the node's certificate."""
    try:
        return check_name(value)
    except ValueError as exc:
        raise ValueError(f"{exc} (node ids name the node's certificate)") from None


def parse_bool(value: Any) -> bool:
    """Return a YAML boolean (``true``/``false``; no strings, no numbers)."""
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {show(value)}")
    return value


def count(minimum: int) -> Callable[[Any], int]:
    """Return a parser of whole numbers of at least ``minimum``."""

    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected a whole number >= {minimum}, got {show(value)}")
        return value

    return parse


def parse_ratio(value: Any) -> float:
    """Return a number from 0 to 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"expected a number from 0 to 1, got {show(value)}")
    return float(value)


def parse_url_or_empty(value: Any) -> str:
    """Return an http(s) URL without a trailing slash, or "" for an empty value."""
    text = parse_str(value) if value not in (None, "") else ""
    if text and not text.startswith(("http://", "https://")):
        raise ValueError(f"expected an http(s) URL, got {show(value)}")
    return text.rstrip("/")
