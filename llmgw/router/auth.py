"""API keys and tenants as the gateway sees them: who is calling, and what they may use.

The control plane keeps an :class:`AuthTable` in memory and replaces its contents
whenever tenants or keys change (:meth:`AuthTable.replace`), so authenticating a
request is a dictionary look-up and one SHA-256, never a database round trip.

Keys look like ``llmgw_<id>_<secret>``: ``id`` (hex) finds the row, ``secret`` (256
random bits, URL-safe base64) is checked against the stored SHA-256 digest with a
constant-time comparison. A plain hash is the right tool here: the secret is random
and long, so there is nothing for a slow password hash to protect against.

Everything here is synchronous and does no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Iterable, Mapping

import attrs

from .errors import GatewayError

#: Every key starts with this, so a leaked key is recognisable (secret scanners, logs).
KEY_PREFIX = "llmgw"
#: Bytes of randomness in a key's id (hex in the key) and in its secret.
KEY_ID_BYTES = 6
KEY_SECRET_BYTES = 32  # 256 bits

#: The tenant requests are accounted to when authentication is off.
ANONYMOUS_TENANT = "anonymous"

_BEARER = "bearer "


@attrs.frozen
class Tenant:
    """A tenant's limits as admission applies them.

    ``models`` is the set of catalog models its keys may use, or None for all of them.
    ``max_concurrency`` (requests in flight), ``rpm`` (requests per minute) and ``tpm``
    (tokens per minute): 0 means unlimited.
    """

    name: str
    models: frozenset[str] | None = None
    max_concurrency: int = 0
    rpm: int = 0
    tpm: int = 0

    def allows(self, model: str) -> bool:
        """Return whether this tenant's keys may use ``model``."""
        return self.models is None or model in self.models


ANONYMOUS = Tenant(ANONYMOUS_TENANT)


@attrs.frozen
class KeyEntry:
    """One active API key: its id, the SHA-256 digest of its secret, and its tenant."""

    key_id: str
    secret_hash: bytes
    tenant: Tenant


@attrs.frozen
class NewKey:
    """A freshly generated key: ``key`` is shown to the operator once; only ``secret_hash`` is stored."""

    key_id: str
    key: str
    secret_hash: str  # hex


def hash_secret(secret: str) -> str:
    """Return the hex SHA-256 digest of a key's secret part."""
    return hashlib.sha256(secret.encode()).hexdigest()


def generate_key() -> NewKey:
    """Return a new random key (``llmgw_<id>_<secret>``) with its id and secret hash."""
    key_id = secrets.token_hex(KEY_ID_BYTES)
    secret = secrets.token_urlsafe(KEY_SECRET_BYTES)
    return NewKey(key_id, f"{KEY_PREFIX}_{key_id}_{secret}", hash_secret(secret))


def split_key(key: str) -> tuple[str, str] | None:
    """Return ``(id, secret)`` of a key in llmgw's format, or None if it is not one."""
    prefix, sep, rest = key.partition("_")
    if prefix != KEY_PREFIX or not sep:
        return None
    key_id, sep, secret = rest.partition("_")
    if not sep or not key_id or not secret:
        return None
    return key_id, secret


def unauthorized(message: str) -> GatewayError:
    """401 in OpenAI's shape (``invalid_api_key``), with the challenge header."""
    return GatewayError(
        401, message, "invalid_request_error", code="invalid_api_key",
        headers={"WWW-Authenticate": 'Bearer realm="llmgw"'},
    )


def model_not_allowed(tenant: str, model: str) -> GatewayError:
    """403: the key's tenant may not use ``model``."""
    return GatewayError(
        403,
        f"This API key (tenant '{tenant}') may not use the model '{model}'. "
        "GET /v1/models lists the models it may use; an operator can change the tenant's "
        "models with `llmgw ctl tenants update`.",
        "permission_error",
        code="model_not_allowed",
        param="model",
    )


class AuthTable:
    """The active API keys, by key id; answers "which tenant is this request?".

    With ``enabled`` false every request is served: a request carrying a valid key is
    accounted to that key's tenant, anything else to :data:`ANONYMOUS`.
    """

    def __init__(self, *, enabled: bool = True, keys: Iterable[KeyEntry] = ()) -> None:
        self.enabled = enabled
        self._keys: Mapping[str, KeyEntry] = {}
        self.replace(keys)

    def replace(self, keys: Iterable[KeyEntry]) -> None:
        """Make ``keys`` the complete set of active keys (revoked keys are simply absent)."""
        self._keys = {entry.key_id: entry for entry in keys}

    def __len__(self) -> int:
        return len(self._keys)

    def authenticate(self, authorization: str | None) -> Tenant:
        """Return the tenant of the ``Authorization`` header's bearer key.

        Raises a 401 :class:`GatewayError` when authentication is enabled and the header
        is missing, not a bearer token, or not an active key.
        """
        entry = self._lookup(authorization)
        if entry is not None:
            return entry.tenant
        if not self.enabled:
            return ANONYMOUS
        if not authorization:
            raise unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'; "
                "an operator creates keys with `llmgw ctl keys create --tenant NAME`."
            )
        raise unauthorized("Incorrect API key provided (unknown, malformed or revoked).")

    def _lookup(self, authorization: str | None) -> KeyEntry | None:
        if not authorization or authorization[:7].lower() != _BEARER:
            return None
        parts = split_key(authorization[7:].strip())
        if parts is None:
            return None
        entry = self._keys.get(parts[0])
        if entry is None:
            return None
        digest = hashlib.sha256(parts[1].encode()).digest()
        return entry if hmac.compare_digest(digest, entry.secret_hash) else None
