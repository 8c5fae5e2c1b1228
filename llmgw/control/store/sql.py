"""The store's logic, written once against a small synchronous driver interface.

:class:`SqlStore` implements :class:`~llmgw.control.store.base.Store` with SQL both SQLite
and PostgreSQL accept (``?`` placeholders; the PostgreSQL driver rewrites them). A
:class:`Driver` owns one database connection and runs a function inside one transaction;
it is only ever called from a worker thread, one call at a time.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, TypeVar

import attrs
import trio

from llmgw.catalog import namespace_conflict
from llmgw.control.store.base import (
    AdminTokenRecord,
    ApiKeyRecord,
    AuditEntry,
    ConflictError,
    FencedError,
    NotFoundError,
    TenantRecord,
    UsageRecord,
    NodeRecord,
    SchemaTooNewError,
    SettingVersion,
    Store,
    StoreClosedError,
)
from llmgw.control.store.training import TrainingStore
from llmgw.control.store.enrolment import EnrolmentStore
from llmgw.control.store.migrations import (
    SCHEMA_MIGRATIONS_TABLE,
    Dialect,
    Migration,
    check_migrations,
    latest_version,
)
from llmgw.spec import Adapter, ModelSpec, Profile, adapters_from_dicts, adapters_to_dicts

T = TypeVar("T")
Row = tuple[Any, ...]


class Tx(Protocol):
    """One open transaction."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one statement (``?`` placeholders); return its rows (empty if it has none)."""
        ...


class Driver(Protocol):
    """One connection to one database, used from worker threads one call at a time."""

    dialect: Dialect
    description: str  # the path, or the DSN without its password

    def transaction(self, fn: Callable[[Tx], T], *, write: bool, idempotent: bool = False) -> T:
        """Run ``fn`` in a transaction and commit; roll back and re-raise if it raises.

        ``idempotent``: running ``fn`` twice leaves the database and the result as once, so
        a driver may repeat a write whose COMMIT it lost (reads are always safe to repeat).
        Driver errors come out as StoreError subclasses naming the database.
        """
        ...

    def lock_migrations(self, tx: Tx) -> None:
        """Inside ``tx``, wait until no other process is migrating the same database."""
        ...

    def close(self) -> None:
        """Close the connection. Idempotent."""
        ...


def _dump_json(value: Any) -> str:
    """Return ``value`` as JSON text; TypeError/ValueError if it is not JSON (NaN is not)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _profile_to_json(profile: Profile) -> str:
    data = attrs.asdict(profile, recurse=False)
    data["engine_args"] = list(profile.engine_args)
    data["engine_env"] = dict(profile.engine_env)
    return _dump_json(data)


_PROFILE_FIELDS = {f.name for f in attrs.fields(Profile)}


def _profile_from_json(text: str) -> Profile:
    """Rebuild a Profile from stored JSON.

    Lenient on purpose: the data was validated when it was written, and keys this version
    does not know (written by a newer llmgw at the same schema version) are ignored rather
    than making the whole catalog unreadable.
    """
    data = json.loads(text)
    known = {k: v for k, v in data.items() if k in _PROFILE_FIELDS}
    if "engine_args" in known:
        known["engine_args"] = tuple(known["engine_args"])
    return Profile(**known)


def _adapters_to_json(adapters: Sequence[Adapter]) -> str:
    return _dump_json(adapters_to_dicts(adapters))


def _adapters_from_json(value: Any) -> tuple[Adapter, ...]:
    """Rebuild adapters from stored JSON (text on SQLite; PostgreSQL's driver may hand back a list)."""
    data = json.loads(value) if isinstance(value, (str, bytes)) else value
    return adapters_from_dicts(data or ())


def _model(row: Row) -> ModelSpec:
    name, engine, source, profile, adapters, max_loaded = row
    return ModelSpec(
        name=name,
        engine=engine,
        source=source,
        profile=_profile_from_json(profile),
        adapters=_adapters_from_json(adapters),
        max_loaded_adapters=int(max_loaded),
    )


def _node(row: Row) -> NodeRecord:
    node_id, address, first_seen, last_seen, labels = row
    return NodeRecord(
        id=node_id,
        address=address,
        first_seen=first_seen,
        last_seen=last_seen,
        labels=json.loads(labels),
    )


def _audit(row: Row) -> AuditEntry:
    entry_id, ts, actor, action, target, detail = row
    return AuditEntry(
        id=entry_id, ts=ts, actor=actor, action=action, target=target, detail=json.loads(detail)
    )


def _setting(row: Row) -> SettingVersion:
    key, value, version, updated_at, actor = row
    return SettingVersion(
        key=key, value=json.loads(value), version=version, updated_at=updated_at, actor=actor
    )


_MODEL_COLUMNS = "name, engine, source, profile, adapters, max_loaded_adapters"
_NODE_COLUMNS = "id, address, first_seen, last_seen, labels"
_AUDIT_COLUMNS = "id, ts, actor, action, target, detail"


def apply_migrations(driver: Driver, migrations: Sequence[Migration]) -> int:
    """Bring the database up to the last of ``migrations``; return the resulting version.

    Blocking: call from a worker thread. Each pending migration runs in its own transaction
    under the driver's migration lock and is recorded in ``schema_migrations`` in that same
    transaction, so it is applied exactly once even when several processes start together.
    Raises SchemaTooNewError if the database is ahead of ``migrations``; a migration that
    fails is rolled back and its error propagates.
    """
    check_migrations(migrations)
    known = latest_version(migrations)
    dialect = driver.dialect

    def ensure_table(tx: Tx) -> int:
        driver.lock_migrations(tx)
        tx.execute(dialect.render(SCHEMA_MIGRATIONS_TABLE))
        (current,) = tx.execute("SELECT MAX(version) FROM schema_migrations")[0]
        return current or 0

    current = driver.transaction(ensure_table, write=True, idempotent=True)
    if current > known:
        raise SchemaTooNewError(
            f"{driver.description}: database schema version {current} is newer than this llmgw "
            f"(knows up to {known}): upgrade llmgw"
        )

    for migration in migrations[current:]:

        def apply(tx: Tx, migration: Migration = migration) -> None:
            driver.lock_migrations(tx)
            if tx.execute("SELECT 1 FROM schema_migrations WHERE version = ?", (migration.version,)):
                return  # another process applied it while we waited for the lock
            for statement in migration.statements:
                tx.execute(dialect.render(statement))
            tx.execute(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                (migration.version, migration.name, time.time()),
            )

        driver.transaction(apply, write=True, idempotent=True)
    return max(current, known)


class SqlStore(EnrolmentStore, TrainingStore, Store):
    """A Store over one :class:`Driver`; all access to it is serialised by a trio.Lock."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self._lock = trio.Lock()
        self._closed = False
        self._fence: int | None = None
        self.description = driver.description

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.description}>"

    async def _run(
        self, fn: Callable[[Tx], T], *, write: bool, idempotent: bool = False, fenced: bool = False
    ) -> T:
        """Run ``fn`` in one transaction in a worker thread; return what it returns.

        ``idempotent`` marks a write that is safe to repeat (see :meth:`Driver.transaction`);
        ``fenced`` one made on behalf of leadership (see :meth:`set_fence`).
        """
        fence = self._fence
        if fenced and fence is not None:
            unfenced = fn

            def fn(tx: Tx) -> T:  # type: ignore[no-redef]
                rows = tx.execute(f"SELECT epoch FROM leadership WHERE id = 1{self._driver.dialect.for_share}")
                current = int(rows[0][0]) if rows else 0
                if current != fence:
                    raise FencedError(
                        f"{self.description}: refused a write of the leader of epoch {fence}: "
                        f"another control plane leads at epoch {current}"
                    )
                return unfenced(tx)

        async with self._lock:
            if self._closed:
                raise StoreClosedError(f"store {self.description} is closed")
            return await trio.to_thread.run_sync(
                lambda: self._driver.transaction(fn, write=write, idempotent=idempotent)
            )

    async def migrate(self, migrations: Sequence[Migration]) -> int:
        """Apply pending ``migrations`` (see :func:`apply_migrations`); return the version."""
        async with self._lock:
            if self._closed:
                raise StoreClosedError(f"store {self.description} is closed")
            return await trio.to_thread.run_sync(apply_migrations, self._driver, migrations)

    async def close(self) -> None:
        # Shielded: closing must happen even when the caller is being cancelled, and the
        # wait for an operation in flight is bounded by the driver's timeouts.
        with trio.CancelScope(shield=True):
            async with self._lock:
                if self._closed:
                    return
                self._closed = True
                await trio.to_thread.run_sync(self._driver.close)

    async def schema_version(self) -> int:
        def read(tx: Tx) -> int:
            (version,) = tx.execute("SELECT MAX(version) FROM schema_migrations")[0]
            return version or 0

        return await self._run(read, write=False)

    # -- leadership ----------------------------------------------------------------------

    def set_fence(self, epoch: int | None) -> None:
        self._fence = epoch

    # -- models --------------------------------------------------------------------------

    async def put_model(self, spec: ModelSpec, *, create_only: bool) -> ModelSpec:
        now = time.time()
        params = (
            spec.name, spec.engine, spec.source, _profile_to_json(spec.profile),
            _adapters_to_json(spec.adapters), spec.max_loaded_adapters, now, now,
        )
        insert = (
            "INSERT INTO models (name, engine, source, profile, adapters, max_loaded_adapters, "
            "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
        )

        def write(tx: Tx) -> ModelSpec:
            # Model and adapter names share one namespace; checked in the write's own
            # transaction (only the leading control plane writes the catalog).
            others = [_model(r) for r in tx.execute(
                f"SELECT {_MODEL_COLUMNS} FROM models WHERE name <> ?", (spec.name,)
            )]
            conflict = namespace_conflict(spec, others)
            if conflict:
                raise ConflictError(conflict)
            if create_only:
                rows = tx.execute(
                    insert + f"ON CONFLICT (name) DO NOTHING RETURNING {_MODEL_COLUMNS}", params
                )
                if not rows:
                    raise ConflictError(
                        f"model {spec.name!r} already exists in the catalog: "
                        "choose another name, or update or delete the existing entry"
                    )
            else:
                rows = tx.execute(
                    insert + "ON CONFLICT (name) DO UPDATE SET engine = excluded.engine, "
                    "source = excluded.source, profile = excluded.profile, "
                    "adapters = excluded.adapters, max_loaded_adapters = excluded.max_loaded_adapters, "
                    f"updated_at = excluded.updated_at RETURNING {_MODEL_COLUMNS}",
                    params,
                )
            return _model(rows[0])

        # An upsert is safe to repeat; a create is not (the repeat would find its own row).
        return await self._run(write, write=True, fenced=True, idempotent=not create_only)

    async def get_model(self, name: str) -> ModelSpec | None:
        def read(tx: Tx) -> ModelSpec | None:
            rows = tx.execute(f"SELECT {_MODEL_COLUMNS} FROM models WHERE name = ?", (name,))
            return _model(rows[0]) if rows else None

        return await self._run(read, write=False)

    async def list_models(self) -> list[ModelSpec]:
        def read(tx: Tx) -> list[ModelSpec]:
            return [_model(r) for r in tx.execute(f"SELECT {_MODEL_COLUMNS} FROM models ORDER BY name")]

        return await self._run(read, write=False)

    async def delete_model(self, name: str) -> bool:
        def write(tx: Tx) -> bool:
            return bool(tx.execute("DELETE FROM models WHERE name = ? RETURNING name", (name,)))

        return await self._run(write, write=True, fenced=True)

    # -- nodes ---------------------------------------------------------------------------

    async def record_node_seen(self, node_id: str, address: str) -> NodeRecord:
        now = time.time()

        def write(tx: Tx) -> NodeRecord:
            rows = tx.execute(
                "INSERT INTO nodes (id, address, first_seen, last_seen, labels) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                "address = excluded.address, last_seen = excluded.last_seen "
                f"RETURNING {_NODE_COLUMNS}",
                (node_id, address, now, now, "{}"),
            )
            return _node(rows[0])

        return await self._run(write, write=True, fenced=True, idempotent=True)

    async def list_known_nodes(self) -> list[NodeRecord]:
        def read(tx: Tx) -> list[NodeRecord]:
            return [_node(r) for r in tx.execute(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY id")]

        return await self._run(read, write=False)

    # -- audit ---------------------------------------------------------------------------

    async def audit(
        self, actor: str, action: str, target: str, detail: Mapping[str, Any] | None = None
    ) -> AuditEntry:
        detail_json = _dump_json(dict(detail or {}))  # raises TypeError before touching the DB
        now = time.time()

        def write(tx: Tx) -> AuditEntry:
            rows = tx.execute(
                "INSERT INTO audit (ts, actor, action, target, detail) VALUES (?, ?, ?, ?, ?) "
                f"RETURNING {_AUDIT_COLUMNS}",
                (now, actor, action, target, detail_json),
            )
            return _audit(rows[0])

        return await self._run(write, write=True)

    async def list_audit(self, limit: int = 100) -> list[AuditEntry]:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be an integer >= 0, got {limit!r}")

        def read(tx: Tx) -> list[AuditEntry]:
            rows = tx.execute(f"SELECT {_AUDIT_COLUMNS} FROM audit ORDER BY id DESC LIMIT ?", (limit,))
            return [_audit(r) for r in rows]

        return await self._run(read, write=False)

    # -- settings ------------------------------------------------------------------------

    async def get_setting(self, key: str) -> SettingVersion | None:
        def read(tx: Tx) -> SettingVersion | None:
            rows = tx.execute(
                "SELECT key, value, version, updated_at, actor FROM settings WHERE key = ?", (key,)
            )
            return _setting(rows[0]) if rows else None

        return await self._run(read, write=False)

    async def list_settings(self) -> list[SettingVersion]:
        def read(tx: Tx) -> list[SettingVersion]:
            rows = tx.execute("SELECT key, value, version, updated_at, actor FROM settings ORDER BY key")
            return [_setting(r) for r in rows]

        return await self._run(read, write=False)

    async def set_setting(self, key: str, value: Any, actor: str) -> int:
        value_json = _dump_json(value)  # raises TypeError before touching the DB
        now = time.time()

        def write(tx: Tx) -> int:
            # The upsert takes the row lock, so concurrent writers (even other control
            # planes on PostgreSQL) are handed versions one after another.
            ((version,),) = tx.execute(
                "INSERT INTO settings (key, value, version, updated_at, actor) "
                "VALUES (?, ?, 1, ?, ?) ON CONFLICT (key) DO UPDATE SET "
                "value = excluded.value, version = settings.version + 1, "
                "updated_at = excluded.updated_at, actor = excluded.actor RETURNING version",
                (key, value_json, now, actor),
            )
            tx.execute(
                "INSERT INTO setting_history (key, version, value, updated_at, actor) "
                "VALUES (?, ?, ?, ?, ?)",
                (key, version, value_json, now, actor),
            )
            return version

        return await self._run(write, write=True, fenced=True)

    async def setting_history(self, key: str) -> list[SettingVersion]:
        def read(tx: Tx) -> list[SettingVersion]:
            rows = tx.execute(
                "SELECT key, value, version, updated_at, actor FROM setting_history "
                "WHERE key = ? ORDER BY version",
                (key,),
            )
            return [_setting(r) for r in rows]

        return await self._run(read, write=False)

    # -- tenants, API keys, usage (migration 2) ------------------------------------------

    async def put_tenant(self, tenant: TenantRecord, *, create_only: bool) -> TenantRecord:
        models = _dump_json(list(tenant.models) if tenant.models is not None else None)
        now = time.time()
        limits = (tenant.max_concurrency, tenant.rpm, tenant.tpm)

        def write(tx: Tx) -> TenantRecord:
            if create_only:
                rows = tx.execute(
                    "INSERT INTO tenants (name, models, max_concurrency, rpm, tpm, created_at, updated_at) "
                    f"VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO NOTHING RETURNING {_TENANT_COLUMNS}",
                    (tenant.name, models, *limits, now, now),
                )
                if not rows:
                    raise ConflictError(
                        f"tenant {tenant.name!r} already exists: choose another name, or change it "
                        "with `llmgw ctl tenants update`"
                    )
            else:
                rows = tx.execute(
                    "UPDATE tenants SET models = ?, max_concurrency = ?, rpm = ?, tpm = ?, updated_at = ? "
                    f"WHERE name = ? RETURNING {_TENANT_COLUMNS}",
                    (models, *limits, now, tenant.name),
                )
                if not rows:
                    raise NotFoundError(f"no tenant {tenant.name!r} (see `llmgw ctl tenants list`)")
            return _tenant(rows[0])

        return await self._run(write, write=True, fenced=True, idempotent=not create_only)

    async def list_tenants(self) -> list[TenantRecord]:
        def read(tx: Tx) -> list[TenantRecord]:
            return [_tenant(r) for r in tx.execute(f"SELECT {_TENANT_COLUMNS} FROM tenants ORDER BY name")]

        return await self._run(read, write=False)

    async def delete_tenant(self, name: str) -> bool:
        now = time.time()

        def write(tx: Tx) -> bool:
            tx.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE tenant = ? AND revoked_at IS NULL", (now, name)
            )
            return bool(tx.execute("DELETE FROM tenants WHERE name = ? RETURNING name", (name,)))

        return await self._run(write, write=True, fenced=True)

    async def create_api_key(self, key: ApiKeyRecord) -> ApiKeyRecord:
        now = time.time()

        def write(tx: Tx) -> ApiKeyRecord:
            if not tx.execute("SELECT 1 FROM tenants WHERE name = ?", (key.tenant,)):
                raise NotFoundError(
                    f"no tenant {key.tenant!r}: create it first with `llmgw ctl tenants add {key.tenant}`"
                )
            rows = tx.execute(
                "INSERT INTO api_keys (id, tenant, name, secret_sha256, created_at, revoked_at) "
                f"VALUES (?, ?, ?, ?, ?, NULL) ON CONFLICT (id) DO NOTHING RETURNING {_KEY_COLUMNS}",
                (key.id, key.tenant, key.name, key.secret_sha256, now),
            )
            if not rows:
                raise ConflictError(f"an API key with id {key.id!r} already exists")
            return _api_key(rows[0])

        return await self._run(write, write=True, fenced=True)

    async def list_api_keys(self) -> list[ApiKeyRecord]:
        def read(tx: Tx) -> list[ApiKeyRecord]:
            return [_api_key(r) for r in tx.execute(
                f"SELECT {_KEY_COLUMNS} FROM api_keys ORDER BY created_at, id"
            )]

        return await self._run(read, write=False)

    async def revoke_api_key(self, key_id: str) -> ApiKeyRecord | None:
        now = time.time()

        def write(tx: Tx) -> ApiKeyRecord | None:
            tx.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (now, key_id))
            rows = tx.execute(f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE id = ?", (key_id,))
            return _api_key(rows[0]) if rows else None

        return await self._run(write, write=True, fenced=True, idempotent=True)

    async def create_admin_token(self, token: AdminTokenRecord) -> AdminTokenRecord:
        now = time.time()

        def write(tx: Tx) -> AdminTokenRecord:
            rows = tx.execute(
                "INSERT INTO admin_tokens (id, name, secret_sha256, created_by, created_at, revoked_at) "
                f"VALUES (?, ?, ?, ?, ?, NULL) ON CONFLICT (id) DO NOTHING RETURNING {_ADMIN_TOKEN_COLUMNS}",
                (token.id, token.name, token.secret_sha256, token.created_by, now),
            )
            if not rows:
                raise ConflictError(f"an admin token with id {token.id!r} already exists")
            return AdminTokenRecord(*rows[0])

        return await self._run(write, write=True, fenced=True)

    async def list_admin_tokens(self) -> list[AdminTokenRecord]:
        def read(tx: Tx) -> list[AdminTokenRecord]:
            return [AdminTokenRecord(*r) for r in tx.execute(
                f"SELECT {_ADMIN_TOKEN_COLUMNS} FROM admin_tokens ORDER BY created_at, id"
            )]

        return await self._run(read, write=False)

    async def get_admin_token(self, token_id: str) -> AdminTokenRecord | None:
        def read(tx: Tx) -> AdminTokenRecord | None:
            rows = tx.execute(f"SELECT {_ADMIN_TOKEN_COLUMNS} FROM admin_tokens WHERE id = ?", (token_id,))
            return AdminTokenRecord(*rows[0]) if rows else None

        return await self._run(read, write=False)

    async def revoke_admin_token(self, token_id: str) -> AdminTokenRecord | None:
        now = time.time()

        def write(tx: Tx) -> AdminTokenRecord | None:
            tx.execute("UPDATE admin_tokens SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (now, token_id))
            rows = tx.execute(f"SELECT {_ADMIN_TOKEN_COLUMNS} FROM admin_tokens WHERE id = ?", (token_id,))
            return AdminTokenRecord(*rows[0]) if rows else None

        return await self._run(write, write=True, fenced=True, idempotent=True)

    async def add_usage(self, rows: list[UsageRecord], *, marks: Mapping[str, int] | None = None) -> None:
        marks = dict(marks or {})
        if not rows and not marks:
            return
        now = time.time()

        def write(tx: Tx) -> None:
            for journal, seq in marks.items():
                tx.execute(
                    "INSERT INTO usage_journals (journal, seq, updated_at) VALUES (?, ?, ?) "
                    "ON CONFLICT (journal) DO UPDATE SET "
                    "seq = CASE WHEN excluded.seq > usage_journals.seq THEN excluded.seq ELSE usage_journals.seq END, "
                    "updated_at = excluded.updated_at",
                    (journal, seq, now),
                )
            for row in rows:
                tx.execute(
                    "INSERT INTO usage (tenant, model, requests, prompt_tokens, completion_tokens, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, model) DO UPDATE SET "
                    "requests = usage.requests + excluded.requests, "
                    "prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens, "
                    "completion_tokens = usage.completion_tokens + excluded.completion_tokens, "
                    "updated_at = excluded.updated_at",
                    (row.tenant, row.model, row.requests, row.prompt_tokens, row.completion_tokens, now),
                )

        await self._run(write, write=True)

    async def list_usage(self) -> list[UsageRecord]:
        def read(tx: Tx) -> list[UsageRecord]:
            return [UsageRecord(*r) for r in tx.execute(
                "SELECT tenant, model, requests, prompt_tokens, completion_tokens, updated_at "
                "FROM usage ORDER BY tenant, model"
            )]

        return await self._run(read, write=False)

    async def usage_marks(self) -> dict[str, int]:
        def read(tx: Tx) -> dict[str, int]:
            return {journal: int(seq) for journal, seq in tx.execute("SELECT journal, seq FROM usage_journals")}

        return await self._run(read, write=False)

    async def forget_usage_marks(self, journals: Iterable[str]) -> None:
        names = list(journals)
        if not names:
            return

        def write(tx: Tx) -> None:
            for journal in names:
                tx.execute("DELETE FROM usage_journals WHERE journal = ?", (journal,))

        await self._run(write, write=True)


_TENANT_COLUMNS = "name, models, max_concurrency, rpm, tpm, created_at, updated_at"
_KEY_COLUMNS = "id, tenant, name, secret_sha256, created_at, revoked_at"
#: In the order of AdminTokenRecord's fields.
_ADMIN_TOKEN_COLUMNS = "id, name, secret_sha256, created_by, created_at, revoked_at"


def _tenant(row: Row) -> TenantRecord:
    name, models, max_concurrency, rpm, tpm, created_at, updated_at = row
    parsed = json.loads(models) if isinstance(models, str) else models
    return TenantRecord(
        name=name, models=tuple(parsed) if parsed is not None else None, max_concurrency=max_concurrency,
        rpm=rpm, tpm=tpm, created_at=created_at, updated_at=updated_at,
    )


def _api_key(row: Row) -> ApiKeyRecord:
    key_id, tenant, name, secret_sha256, created_at, revoked_at = row
    return ApiKeyRecord(key_id, tenant, name, secret_sha256, created_at, revoked_at)
