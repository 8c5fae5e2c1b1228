"""Tenants and API keys as values: operator input checked, and the key format.

* :func:`validate_tenant` checks operator input (``llmgw ctl tenants ...``, the Admin API)
  and returns a :class:`TenantSpec`; :func:`check_key_name` checks a key's label.
* Keys look like ``llmgw_<id>_<secret>``: ``id`` (hex) finds the stored row, ``secret``
  (256 random bits, URL-safe base64) is stored only as its SHA-256. :func:`generate_key`
  makes one (the control plane, when an operator creates a key); :func:`split_key` and
  :func:`secret_digest` take one apart (the gateway, on every request). A plain hash is the
  right tool here: the secret is random and long, so there is nothing for a slow password
  hash to protect against.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Any, Mapping

import attrs

__all__ = [
    "KEY_ID_BYTES",
    "KEY_NAME_MAX",
    "KEY_PREFIX",
    "KEY_SECRET_BYTES",
    "LIMIT_MAX",
    "AccessError",
    "NewKey",
    "bearer_credential",
    "TenantSpec",
    "check_key_name",
    "generate_key",
    "hash_secret",
    "secret_digest",
    "split_key",
    "validate_tenant",
]

#: Every key starts with this, so a leaked key is recognisable (secret scanners, logs).
KEY_PREFIX = "llmgw"
_BEARER = "bearer "
#: Bytes of randomness in a key's id (hex in the key) and in its secret.
KEY_ID_BYTES = 6
KEY_SECRET_BYTES = 32  # 256 bits

_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
#: Longest key label (free text shown in ``ctl keys list``).
KEY_NAME_MAX = 200
#: The largest limit a tenant may have (a UInt32 on the wire).
LIMIT_MAX = 2**32 - 1
_LIMITS = ("max_concurrency", "rpm", "tpm")


class AccessError(ValueError):
    """Operator input for a tenant or key is invalid; the message names the field."""


@attrs.frozen
class TenantSpec:
    """A tenant as an operator describes it: ``models`` its keys may use (None: every
    model, else sorted without repeats) and its limits (0: unlimited)."""

    name: str
    models: tuple[str, ...] | None = None
    max_concurrency: int = 0
    rpm: int = 0
    tpm: int = 0


def validate_tenant(data: Mapping[str, Any]) -> TenantSpec:
    """Returns the :class:`TenantSpec` of ``name``, ``models`` (list or None: all),
    ``max_concurrency``, ``rpm``, ``tpm``; raises :class:`AccessError` naming the bad field."""
    name = data.get("name")
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
        raise AccessError(
            f"name: {name!r} is not a tenant name (letters, digits, '.', '_', '-'; up to 63, "
            "starting with a letter or digit)"
        )
    models = data.get("models")
    if models is not None:
        if isinstance(models, str) or not isinstance(models, (list, tuple)):
            raise AccessError("models: expected a list of model names, or nothing for every model")
        if not all(isinstance(m, str) and m for m in models):
            raise AccessError("models: every model name must be a non-empty string")
        models = tuple(sorted(set(models)))
    limits = {}
    for field in _LIMITS:
        value = data.get(field, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= LIMIT_MAX:
            raise AccessError(f"{field}: expected a whole number >= 0 (0: unlimited), got {value!r}")
        limits[field] = value
    return TenantSpec(name=name, models=models, **limits)


def check_key_name(name: str) -> str:
    """Returns ``name`` (a key's label) if it is acceptable; raises :class:`AccessError` if too long."""
    if len(name) > KEY_NAME_MAX:
        raise AccessError(f"name: at most {KEY_NAME_MAX} characters")
    return name


@attrs.frozen
class NewKey:
    """A freshly generated key: ``key`` is shown to the operator once; only ``secret_hash`` is stored."""

    key_id: str
    key: str
    secret_hash: str  # hex


def secret_digest(secret: str) -> bytes:
    """Returns the SHA-256 digest of a key's secret part (what the gateway compares)."""
    return hashlib.sha256(secret.encode()).digest()


def hash_secret(secret: str) -> str:
    """Returns the hex SHA-256 digest of a key's secret part (what the store keeps)."""
    return secret_digest(secret).hex()


def generate_key(prefix: str = KEY_PREFIX) -> NewKey:
    """Returns a new random key (``<prefix>_<id>_<secret>``) with its id and secret hash."""
    key_id = secrets.token_hex(KEY_ID_BYTES)
    secret = secrets.token_urlsafe(KEY_SECRET_BYTES)
    return NewKey(key_id, f"{prefix}_{key_id}_{secret}", hash_secret(secret))


def bearer_credential(authorization: str | None) -> str | None:
    """Returns what an ``Authorization: Bearer X`` header value carries (X), or None when it
    is missing or not a bearer credential."""
    if not authorization or authorization[:len(_BEARER)].lower() != _BEARER:
        return None
    return authorization[len(_BEARER):].strip()


def split_key(key: str, prefix: str = KEY_PREFIX) -> tuple[str, str] | None:
    """Returns ``(id, secret)`` of a key in llmgw's format (``<prefix>_<id>_<secret>``), or
    None if it is not one."""
    given, sep, rest = key.partition("_")
    if given != prefix or not sep:
        return None
    key_id, sep, secret = rest.partition("_")
    if not sep or not key_id or not secret:
        return None
    return key_id, secret
