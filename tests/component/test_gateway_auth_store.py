"""Tenants, API keys and usage in the store, on SQLite and PostgreSQL; and AccessSync feeding a gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from llmgw.catalog import AccessError, validate_tenant
from llmgw.control.keys import SERVING_STOPPED, AccessSync, new_api_key
from llmgw.control.store import ConflictError, open_store
from llmgw.control.store.base import NotFoundError, TenantRecord, UsageRecord
from llmgw.router import ReplicaTable
from llmgw.router.app import Gateway
from llmgw.router.auth import AuthTable
from llmgw.router.errors import GatewayError
from llmgw.router.local import LocalGateway
from llmgw.router.usage import Usage


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/llmgw.db"
    return request.getfixturevalue("pg_dsn")


async def test_tenants_keys_and_usage_round_trip(db_url: str) -> None:
    async with open_store(db_url) as store:
        acme = await store.put_tenant(TenantRecord("acme", ("m1",), 4, 60, 1000), create_only=True)
        assert (acme.models, acme.max_concurrency, acme.rpm, acme.tpm) == (("m1",), 4, 60, 1000)
        assert acme.created_at > 0
        with pytest.raises(ConflictError):
            await store.put_tenant(TenantRecord("acme"), create_only=True)
        with pytest.raises(NotFoundError):
            await store.put_tenant(TenantRecord("ghost"), create_only=False)
        updated = await store.put_tenant(TenantRecord("acme", None, 0, 0, 0), create_only=False)
        assert updated.models is None and updated.created_at == acme.created_at
        await store.put_tenant(TenantRecord("beta"), create_only=True)
        assert [t.name for t in await store.list_tenants()] == ["acme", "beta"]

        record, key = new_api_key("acme", "ci")
        assert record.secret_sha256 not in key and len(record.secret_sha256) == 64
        saved = await store.create_api_key(record)
        assert saved.revoked_at is None and saved.tenant == "acme"
        with pytest.raises(NotFoundError):
            await store.create_api_key(new_api_key("ghost", "")[0])
        beta_key = await store.create_api_key(new_api_key("beta", "")[0])
        revoked = await store.revoke_api_key(saved.id)
        assert revoked is not None and revoked.revoked_at is not None
        assert (await store.revoke_api_key(saved.id)).revoked_at == revoked.revoked_at  # idempotent
        assert await store.revoke_api_key("nope") is None
        assert await store.delete_tenant("beta") is True
        assert await store.delete_tenant("beta") is False
        keys = {k.id: k for k in await store.list_api_keys()}
        assert keys[beta_key.id].revoked_at is not None  # removing a tenant revokes its keys

        await store.add_usage([UsageRecord("acme", "m1", 2, 10, 5)])
        await store.add_usage([UsageRecord("acme", "m1", 1, 1, 1), UsageRecord("acme", "m2", 1, 0, 0)])
        assert [(u.model, u.requests, u.prompt_tokens, u.completion_tokens) for u in await store.list_usage()] == [
            ("m1", 3, 11, 6), ("m2", 1, 0, 0)]


async def test_access_sync_feeds_keys_and_stop_and_flushes_usage(tmp_path: Path) -> None:
    async with open_store(f"sqlite://{tmp_path}/llmgw.db") as store:
        gateway = Gateway(ReplicaTable(), auth=AuthTable(enabled=True))
        sync = AccessSync(store, LocalGateway(gateway), usage_flush_interval=3600)
        await store.put_tenant(TenantRecord("acme", ("m1",)), create_only=True)
        record, key = new_api_key("acme", "")
        await store.create_api_key(record)
        async with trio.open_nursery() as nursery:
            await nursery.start(sync.run)
            tenant = gateway.auth.authenticate(f"Bearer {key}")
            assert tenant.name == "acme" and tenant.allows("m1") and not tenant.allows("m2")
            await store.set_setting(SERVING_STOPPED, True, "test")
            await store.revoke_api_key(record.id)
            await sync.reload()
            assert gateway.stopped is True
            with pytest.raises(GatewayError) as refused:
                gateway.auth.authenticate(f"Bearer {key}")
            assert refused.value.status == 401
            gateway.usage.record("acme", "m1", Usage(3, 4))
            await sync.flush_usage()
            gateway.usage.record("acme", "m1", Usage(1, 1))
            nursery.cancel_scope.cancel()  # the last counts are flushed on the way out
        [row] = await store.list_usage()
        assert (row.requests, row.prompt_tokens, row.completion_tokens) == (2, 4, 5)


@pytest.mark.parametrize(
    ("data", "field"),
    [({"name": "bad name"}, "name"), ({"name": "a", "models": "m1"}, "models"),
     ({"name": "a", "models": [""]}, "models"), ({"name": "a", "rpm": -1}, "rpm"),
     ({"name": "a", "tpm": True}, "tpm"), ({"name": "a", "max_concurrency": 2**40}, "max_concurrency")],
)
def test_validate_tenant_names_the_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(AccessError, match=f"^{field}:"):
        validate_tenant(data)
    assert validate_tenant({"name": "ok", "models": ["b", "a", "a"]}).models == ("a", "b")


async def test_usage_totals_count_each_request_once_while_a_flush_runs(tmp_path: Path) -> None:
    async with open_store(f"sqlite://{tmp_path}/llmgw.db") as store:
        gateway = Gateway(ReplicaTable())
        sync = AccessSync(store, LocalGateway(gateway))
        gateway.usage.record("acme", "m1", Usage(1, 2))
        await store.add_usage([UsageRecord("acme", "m1", 5, 5, 5)])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync.flush_usage)  # drains, then writes in a worker thread...
            await trio.sleep(0)
            [row] = await sync.usage_totals()  # ...and this waits for it rather than missing it
        assert (row.requests, row.prompt_tokens, row.completion_tokens) == (6, 6, 7)
        assert [u.requests for u in await sync.usage_totals()] == [6]
