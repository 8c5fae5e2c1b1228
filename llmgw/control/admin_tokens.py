"""Bearer tokens of the HTTP admin API (``/api/v1/*``): making, checking and the Admin methods.

A token is ``llmgwadmin_<id>_<secret>`` (:func:`llmgw.catalog.access.generate_key` with
:data:`ADMIN_TOKEN_PREFIX`); the store keeps its id, name and the SHA-256 of its secret,
never the token. ``llmgw ctl admin-tokens create NAME`` shows it once. :func:`authenticate`
checks an ``Authorization`` header against the store (one indexed read per admin call: they
are rare, and a revocation applies to the next call on every control plane).
"""

from __future__ import annotations

import hmac
from typing import Any

from llmgw.catalog.access import bearer_credential, check_key_name, generate_key, secret_digest, split_key
from llmgw.control.store import Store
from llmgw.control.store.base import AdminTokenRecord

#: The first part of every admin token; an API key (``llmgw_...``) is never one.
ADMIN_TOKEN_PREFIX = "llmgwadmin"


class AdminAuthError(Exception):
    """The request carries no admin token, or one that is unknown, wrong or revoked (401)."""


def new_admin_token(name: str, created_by: str) -> tuple[AdminTokenRecord, str]:
    """Returns a new token's record (to store) and the token itself (to show once).

    Raises :class:`llmgw.catalog.AccessError` if ``name`` is too long, ValueError if empty."""
    if not name.strip():
        raise ValueError("name: give the token a name (who or what uses it); it is the actor in the audit log")
    check_key_name(name)
    made = generate_key(ADMIN_TOKEN_PREFIX)
    return AdminTokenRecord(made.key_id, name, made.secret_hash, created_by), made.key


async def authenticate(store: Store, authorization: str) -> AdminTokenRecord:
    """Returns the active admin token an ``Authorization: Bearer`` header value carries.

    Raises :class:`AdminAuthError` saying what is wrong (no token, not an admin token,
    unknown, wrong secret, revoked), or the store's error."""
    credential = bearer_credential(authorization)
    if credential is None:
        raise AdminAuthError("the admin API needs `Authorization: Bearer <admin token>` "
                             "(make one with `llmgw ctl admin-tokens create NAME`)")
    parts = split_key(credential, ADMIN_TOKEN_PREFIX)
    if parts is None:
        raise AdminAuthError(f"not an admin token (they start with {ADMIN_TOKEN_PREFIX}_; "
                             "an API key does not open the admin API)")
    record = await store.get_admin_token(parts[0])
    if record is None or not hmac.compare_digest(secret_digest(parts[1]), bytes.fromhex(record.secret_sha256)):
        raise AdminAuthError("unknown admin token, or a wrong secret")
    if record.revoked_at is not None:
        raise AdminAuthError(f"admin token {record.id} ({record.name}) was revoked")
    return record


def admin_token_dict(record: AdminTokenRecord) -> dict[str, Any]:
    """Returns ``record`` as a capnp ``AdminTokenView``."""
    return {"id": record.id, "name": record.name, "createdBy": record.created_by, "createdAt": record.created_at,
            "revokedAt": record.revoked_at or 0.0}


class AdminTokensAdminMixin:
    """Admin methods createAdminToken, listAdminTokens, revokeAdminToken (schema/llmgw.capnp).

    Uses the store and actor :meth:`~llmgw.control.settings_admin.SettingsAdminMixin.bind_settings` bound."""

    _settings_store: Store
    _settings_actor: str

    async def createAdminToken(self, name: str, _context: Any, **_: Any) -> None:
        record, token = new_admin_token(str(name), self._settings_actor)
        store = self._settings_store
        saved = await store.create_admin_token(record)
        await store.audit(self._settings_actor, "admin_token.create", saved.id, {"name": saved.name})
        _context.results.token = token
        _context.results.view = admin_token_dict(saved)

    async def listAdminTokens(self, _context: Any, **_: Any) -> None:
        _context.results.tokens = [admin_token_dict(t) for t in await self._settings_store.list_admin_tokens()]

    async def revokeAdminToken(self, id: str, _context: Any, **_: Any) -> None:
        token_id = str(id)
        store = self._settings_store
        revoked = await store.revoke_admin_token(token_id)
        if revoked is None:
            raise LookupError(f"no admin token {token_id!r} (see `llmgw ctl admin-tokens list`)")
        await store.audit(self._settings_actor, "admin_token.revoke", token_id, {"name": revoked.name})
        _context.results.view = admin_token_dict(revoked)
