"""The Admin methods for tenants, API keys, usage and ``serving.stopped`` (a mixin).

``AdminServer`` in :mod:`llmgw.control.admin` inherits :class:`AccessAdminMixin` and
calls :meth:`AccessAdminMixin.bind_access` with the store, the access sync and the
caller's name.
Every change is audited and applied to this control plane's gateway before the call
returns (:meth:`llmgw.control.keys.AccessSync.reload`), so a revoked key is refused as
soon as ``llmgw ctl keys revoke`` prints. Params are copied into Python values before
the first await (the capnp backend's rule); errors are plain exceptions whose message
is for the operator.
"""

from __future__ import annotations

from typing import Any, Callable

from llmgw.catalog import validate_tenant
from llmgw.control.keys import SERVING_STOPPED, AccessSync, new_api_key, tenant_record
from llmgw.control.store import Store
from llmgw.control.store.base import ApiKeyRecord, TenantRecord
from llmgw.router.interface import GatewayStatus


def tenant_dict(record: TenantRecord) -> dict[str, Any]:
    """Return ``record`` as a capnp ``Tenant``."""
    return {
        "name": record.name,
        "allModels": record.models is None,
        "models": list(record.models or ()),
        "maxConcurrency": record.max_concurrency,
        "rpm": record.rpm,
        "tpm": record.tpm,
        "createdAt": record.created_at,
        "updatedAt": record.updated_at,
    }


def tenant_input(tenant: Any) -> dict[str, Any]:
    """Return a capnp ``Tenant`` as the plain dict :func:`validate_tenant` checks."""
    return {
        "name": str(tenant.name),
        "models": None if tenant.allModels else [str(m) for m in tenant.models],
        "max_concurrency": int(tenant.maxConcurrency),
        "rpm": int(tenant.rpm),
        "tpm": int(tenant.tpm),
    }


def key_dict(record: ApiKeyRecord) -> dict[str, Any]:
    """Return ``record`` as a capnp ``ApiKey`` (never the hash)."""
    return {
        "id": record.id,
        "tenant": record.tenant,
        "name": record.name,
        "createdAt": record.created_at,
        "revokedAt": record.revoked_at or 0.0,
    }


def _audit_tenant(record: TenantRecord) -> dict[str, Any]:
    return {"models": list(record.models) if record.models is not None else None,
            "max_concurrency": record.max_concurrency, "rpm": record.rpm, "tpm": record.tpm}


class AccessAdminMixin:
    """Admin methods listTenants, putTenant, removeTenant, createKey, listKeys, revokeKey,
    usage, setServingStopped (see schema/llmgw.capnp)."""

    _access_store: Store
    _access: AccessSync
    _access_actor: str

    def bind_access(
        self, store: Store, access: AccessSync, actor: str, serving_changed: Callable[[], None] = lambda: None,
    ) -> None:
        """Act on ``store`` and the gateway behind ``access`` for ``actor`` (the admin
        certificate's name); ``serving_changed`` is called after ``serving.stopped`` changed
        (the reconciler frees or places every model's replicas)."""
        self._access_store = store
        self._access = access
        self._access_actor = actor
        self._serving_changed = serving_changed

    async def _applied(self) -> None:
        await self._access.reload()
        self._access.changed()

    async def listTenants(self, _context: Any, **_: Any) -> None:
        tenants = await self._access_store.list_tenants()
        _context.results.tenants = [tenant_dict(t) for t in tenants]

    async def putTenant(self, tenant: Any, create: bool, _context: Any, **_: Any) -> None:
        record = tenant_record(validate_tenant(tenant_input(tenant)))
        create = bool(create)
        store = self._access_store
        saved = await store.put_tenant(record, create_only=create)
        await store.audit(self._access_actor, "tenant.add" if create else "tenant.update", saved.name,
                          _audit_tenant(saved))
        await self._applied()
        _context.results.tenant = tenant_dict(saved)

    async def removeTenant(self, name: str, _context: Any, **_: Any) -> None:
        name = str(name)
        store = self._access_store
        removed = await store.delete_tenant(name)
        if removed:
            await store.audit(self._access_actor, "tenant.remove", name, {})
            await self._applied()
        _context.results.removed = removed

    async def createKey(self, tenant: str, name: str, _context: Any, **_: Any) -> None:
        record, key = new_api_key(str(tenant), str(name))
        store = self._access_store
        saved = await store.create_api_key(record)
        await store.audit(self._access_actor, "key.create", saved.id, {"tenant": saved.tenant, "name": saved.name})
        await self._applied()
        _context.results.key = key_dict(saved)
        _context.results.secret = key

    async def listKeys(self, _context: Any, **_: Any) -> None:
        keys = await self._access_store.list_api_keys()
        _context.results.keys = [key_dict(k) for k in keys]

    async def revokeKey(self, id: str, _context: Any, **_: Any) -> None:
        key_id = str(id)
        store = self._access_store
        revoked = await store.revoke_api_key(key_id)
        if revoked is None:
            raise LookupError(f"no API key {key_id!r} (see `llmgw ctl keys list`)")
        await store.audit(self._access_actor, "key.revoke", key_id, {"tenant": revoked.tenant})
        await self._applied()
        _context.results.key = key_dict(revoked)

    async def usage(self, _context: Any, **_: Any) -> None:
        rows = await self._access.usage_totals()
        _context.results.rows = [
            {"tenant": u.tenant, "model": u.model, "requests": u.requests, "promptTokens": u.prompt_tokens,
             "completionTokens": u.completion_tokens}
            for u in rows
        ]

    async def setServingStopped(self, stopped: bool, _context: Any, **_: Any) -> None:
        stopped = bool(stopped)
        store = self._access_store
        await store.set_setting(SERVING_STOPPED, stopped, self._access_actor)
        await store.audit(self._access_actor, "serving.stop" if stopped else "serving.start", SERVING_STOPPED,
                          {"value": stopped})
        await self._applied()
        self._serving_changed()
        _context.results.stopped = stopped


def admission_rows(status: GatewayStatus) -> list[dict[str, Any]]:
    """Return the gateway's per-tenant admission counts, with its share of each tenant's
    concurrency limit, as capnp ``TenantAdmission``s."""
    return [
        {"tenant": name, "admitted": c.admitted, "queued": c.queued, "shed": c.shed, "inFlight": max(0, c.in_flight),
         "share": status.shares.of(name).concurrency}
        for name, c in sorted(status.admission.items())
    ]
