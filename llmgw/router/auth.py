"""API keys and tenants as the gateway sees them: who is calling, and what they may use.

The control plane keeps an :class:`AuthTable` in memory and replaces its contents
whenever tenants or keys change (:meth:`AuthTable.replace`), so authenticating a
request is a dictionary look-up and one SHA-256, never a database round trip.

A key's ``id`` finds the row and its ``secret`` is checked against the stored SHA-256
digest with a constant-time comparison; the key format (and why a plain hash is the
right tool) is :mod:`llmgw.catalog.access`, shared with the control plane that makes keys.

Everything here is synchronous and does no I/O.
"""

from __future__ import annotations

import hmac
from typing import Iterable, Mapping

import attrs

from llmgw.catalog.access import bearer_credential, secret_digest, split_key

from .errors import GatewayError, echo

#: The tenant requests are accounted to when authentication is off.
ANONYMOUS_TENANT = "anonymous"


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
        f"This API key (tenant '{tenant}') may not use the model '{echo(model)}'. "
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
        parts = split_key(bearer_credential(authorization) or "")
        if parts is None:
            return None
        entry = self._keys.get(parts[0])
        if entry is None:
            return None
        return entry if hmac.compare_digest(secret_digest(parts[1]), entry.secret_hash) else None
