"""The store's join tokens and revoked certificates (migration 6), shared by both backends.

:class:`EnrolmentStore` is mixed into :class:`~llmgw.control.store.sql.SqlStore`: it only
needs the store's ``_run`` (one transaction in a worker thread). See the abstract methods
on :class:`~llmgw.control.store.base.Store` for what each promises.
"""

from __future__ import annotations

import hmac
import time
from typing import Any, Callable, TypeVar

import attrs

from llmgw.control.store.base import (
    CertificateRevokedError,
    ConflictError,
    ControlPlaneRecord,
    ControlPlaneRemoval,
    JoinTokenRecord,
    JoinTokenRefused,
    NodeRemoval,
)
from llmgw.jointoken import NodeOverrides

T = TypeVar("T")

_TOKEN_COLUMNS = "id, role, name, created_at, created_by, expires_at, used_at, used_by, revoked_at, overrides"
CONTROL_PLANE_COLUMNS = "name, rpc_address, http_address, first_seen, last_seen, serial"


def _token(row: Any) -> JoinTokenRecord:
    *fields, overrides = row
    return JoinTokenRecord(*fields, overrides=NodeOverrides.from_json(overrides))


def _revoke_pending_tokens(tx: Any, role: str, name: str, now: float) -> int:
    """Revoke every unused, unrevoked join token for ``role`` ``name``; returns how many of
    them could still have been used (not expired at ``now``)."""
    return sum(1 for row in tx.execute(
        "UPDATE join_tokens SET revoked_at = ? WHERE role = ? AND name = ? "
        "AND used_at IS NULL AND revoked_at IS NULL RETURNING expires_at", (now, role, name)) if row[0] > now)


def _revoke_certificate(tx: Any, serial: str, role: str, name: str, now: float, actor: str) -> None:
    """Refuse the certificate ``serial`` (of ``role`` ``name``) from now on."""
    tx.execute("INSERT INTO revoked_certificates (serial, role, name, revoked_at, actor) "
               "VALUES (?, ?, ?, ?, ?) ON CONFLICT (serial) DO NOTHING", (serial, role, name, now, actor))


class EnrolmentStore:
    """Join tokens, certificate revocation and control plane rows, on a SQL store."""

    _run: Callable[..., Any]

    async def record_control_plane(
        self, name: str, rpc_address: str, http_address: str, serial: str = ""
    ) -> ControlPlaneRecord:
        now = time.time()

        def write(tx: Any) -> ControlPlaneRecord:
            if serial and tx.execute("SELECT 1 FROM revoked_certificates WHERE serial = ?", (serial,)):
                raise CertificateRevokedError(
                    f"this control plane's certificate (serial {serial}) was revoked: it was removed "
                    "from the cluster (`llmgw ctl servers remove`). Join it again with a new token "
                    "(`llmgw ctl servers add` on the cluster, then `llmgw server join` here)")
            rows = tx.execute(
                "INSERT INTO control_planes (name, rpc_address, http_address, first_seen, last_seen, serial) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET rpc_address = excluded.rpc_address, "
                "http_address = excluded.http_address, last_seen = excluded.last_seen, serial = excluded.serial "
                f"RETURNING {CONTROL_PLANE_COLUMNS}",
                (name, rpc_address, http_address, now, now, serial),
            )
            return ControlPlaneRecord(*rows[0])

        return await self._run(write, write=True, idempotent=True)  # type: ignore[no-any-return]

    async def list_control_planes(self) -> list[ControlPlaneRecord]:
        def read(tx: Any) -> list[ControlPlaneRecord]:
            rows = tx.execute(f"SELECT {CONTROL_PLANE_COLUMNS} FROM control_planes ORDER BY name")
            return [ControlPlaneRecord(*row) for row in rows]

        return await self._run(read, write=False)  # type: ignore[no-any-return]

    async def create_join_token(self, token: JoinTokenRecord, secret_sha256: str) -> JoinTokenRecord:
        def write(tx: Any) -> JoinTokenRecord:
            if tx.execute("SELECT 1 FROM join_tokens WHERE id = ?", (token.id,)):
                raise ConflictError(f"a join token with id {token.id!r} already exists")
            tx.execute(
                f"INSERT INTO join_tokens ({_TOKEN_COLUMNS}, secret_sha256) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (token.id, token.role, token.name, token.created_at, token.created_by, token.expires_at,
                 token.used_at, token.used_by, token.revoked_at, token.overrides.to_json(), secret_sha256),
            )
            return token

        return await self._run(write, write=True, fenced=True)  # type: ignore[no-any-return]

    async def list_join_tokens(self) -> list[JoinTokenRecord]:
        def read(tx: Any) -> list[JoinTokenRecord]:
            return [_token(r) for r in tx.execute(f"SELECT {_TOKEN_COLUMNS} FROM join_tokens ORDER BY created_at, id")]

        return await self._run(read, write=False)  # type: ignore[no-any-return]

    async def redeem_join_token(self, token_id: str, secret_sha256: str, used_by: str,
                                now: float | None = None, role: str = "") -> JoinTokenRecord:
        at = time.time() if now is None else now

        def write(tx: Any) -> JoinTokenRecord:
            rows = tx.execute(f"SELECT {_TOKEN_COLUMNS}, secret_sha256 FROM join_tokens WHERE id = ?", (token_id,))
            if not rows or not hmac.compare_digest(str(rows[0][-1]), secret_sha256):
                raise JoinTokenRefused("the join token is not one this cluster issued (unknown or mistyped): "
                                       "mint a new one (`llmgw ctl nodes add` or `llmgw ctl servers add`)")
            token = _token(rows[0][:-1])
            if role and token.role != role:
                joins = {"control": "llmgw server join", "node": "llmgw agent join"}
                raise JoinTokenRefused(f"the join token is for a {token.role} ({token.name or 'unnamed'}), not a "
                                       f"{role}: run `{joins.get(token.role, 'the matching join')}` with it instead "
                                       "(the token is still unused)")
            state = token.state(at)
            if state == "used":
                raise JoinTokenRefused(f"the join token for {token.name!r} was used already (from {token.used_by}): "
                                       "tokens work once; mint a new one")
            if state == "revoked":
                raise JoinTokenRefused(f"the join token for {token.name!r} was revoked by an operator")
            if state == "expired":
                raise JoinTokenRefused(f"the join token for {token.name!r} expired "
                                       f"{at - token.expires_at:.0f}s ago: mint a new one")
            # The guard in WHERE makes a racing second redemption update nothing.
            updated = tx.execute("UPDATE join_tokens SET used_at = ?, used_by = ? WHERE id = ? AND used_at IS NULL "
                                 "AND revoked_at IS NULL RETURNING id", (at, used_by, token_id))
            if not updated:
                raise JoinTokenRefused(f"the join token for {token.name!r} was used already")
            return attrs.evolve(token, used_at=at, used_by=used_by, revoked_at=None)

        return await self._run(write, write=True)  # type: ignore[no-any-return]

    async def remove_control_plane(self, name: str, actor: str) -> ControlPlaneRemoval:
        now = time.time()

        def write(tx: Any) -> ControlPlaneRemoval:
            revoked = _revoke_pending_tokens(tx, "control", name, now)
            rows = tx.execute(f"SELECT {CONTROL_PLANE_COLUMNS} FROM control_planes WHERE name = ?", (name,))
            if not rows:
                return ControlPlaneRemoval(None, revoked)
            record = ControlPlaneRecord(*rows[0])
            if record.serial:
                _revoke_certificate(tx, record.serial, "control", name, now, actor)
            tx.execute("DELETE FROM control_planes WHERE name = ?", (name,))
            return ControlPlaneRemoval(record, revoked)

        return await self._run(write, write=True, fenced=True)  # type: ignore[no-any-return]

    async def record_node_certificate(self, node_id: str, serial: str) -> None:
        now = time.time()

        def write(tx: Any) -> None:
            tx.execute("INSERT INTO node_certificates (serial, node, seen_at) VALUES (?, ?, ?) "
                       "ON CONFLICT (serial) DO NOTHING", (serial, node_id, now))

        await self._run(write, write=True, idempotent=True)

    async def remove_node(self, node_id: str, actor: str) -> NodeRemoval:
        now = time.time()

        def write(tx: Any) -> NodeRemoval:
            tokens = _revoke_pending_tokens(tx, "node", node_id, now)
            serials = [row[0] for row in tx.execute("SELECT serial FROM node_certificates WHERE node = ?", (node_id,))]
            for serial in serials:
                _revoke_certificate(tx, serial, "node", node_id, now, actor)
            tx.execute("DELETE FROM node_certificates WHERE node = ?", (node_id,))
            known = bool(tx.execute("DELETE FROM nodes WHERE id = ? RETURNING id", (node_id,)))
            return NodeRemoval(known or bool(serials), len(serials), tokens)

        return await self._run(write, write=True, fenced=True)  # type: ignore[no-any-return]

    async def is_certificate_revoked(self, serial: str) -> bool:
        def read(tx: Any) -> bool:
            return bool(tx.execute("SELECT 1 FROM revoked_certificates WHERE serial = ?", (serial,)))

        return await self._run(read, write=False)  # type: ignore[no-any-return]
