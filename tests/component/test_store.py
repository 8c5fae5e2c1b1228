"""The store against both backends: the same tests on SQLite (tmp_path) and PostgreSQL (pg_dsn)."""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import stat
from typing import Any, Iterator, Sequence

import attrs
import psycopg
import pytest
import trio

from llmgw.control.store import (
    MIGRATIONS,
    ConflictError,
    Migration,
    SchemaTooNewError,
    Store,
    StoreClosedError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
    open_store,
    parse_target,
    redact_dsn,
)
from llmgw.control.admin_tokens import AdminAuthError, authenticate, new_admin_token
from llmgw.control.store.base import UsageRecord
from llmgw.control.store.postgres import PostgresDriver
from llmgw.spec import Adapter, ModelSpec, Profile
from tests.pg import as_conninfo, server_dsn

LATEST = MIGRATIONS[-1].version


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """The URL of an empty database on each backend."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/llmgw.db"
    return request.getfixturevalue("pg_dsn")


@contextlib.contextmanager
def raw_connection(url: str) -> Iterator[Any]:
    """A direct driver connection to the store's database (autocommit), bypassing the store."""
    backend, location = parse_target(url)
    if backend == "sqlite":
        db = sqlite3.connect(location, isolation_level=None)
        try:
            yield db
        finally:
            db.close()
    else:
        with psycopg.connect(location, autocommit=True, connect_timeout=3) as conn:
            yield conn


def raw_query(url: str, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Run one statement (``?`` placeholders) outside the store; return its rows."""
    with raw_connection(url) as conn:
        if isinstance(conn, sqlite3.Connection):
            return conn.execute(sql, params).fetchall()
        cur = conn.execute(sql.replace("?", "%s"), params)
        return cur.fetchall() if cur.description is not None else []


def model(name: str = "tiny", **profile: Any) -> ModelSpec:
    return ModelSpec(name=name, engine="llama.cpp", source=f"/models/{name}.gguf", profile=Profile(**profile))


# -- schema and migrations -----------------------------------------------------------------


async def test_migrations_apply_once_and_are_recorded(db_url: str) -> None:
    async with open_store(db_url) as store:
        assert await store.schema_version() == LATEST
    first = raw_query(db_url, "SELECT version, name, applied_at FROM schema_migrations ORDER BY version")
    assert [(v, n) for v, n, _ in first] == [(m.version, m.name) for m in MIGRATIONS]

    store = await open_store(db_url)  # the awaited form; reopening applies nothing again
    try:
        assert await store.schema_version() == LATEST
    finally:
        await store.close()
    again = raw_query(db_url, "SELECT version, name, applied_at FROM schema_migrations ORDER BY version")
    assert again == first


async def test_failing_migration_is_rolled_back_and_not_recorded(db_url: str) -> None:
    bad = Migration(LATEST + 1, "half-done", ("CREATE TABLE extra (x INTEGER)", "INSERT INTO missing VALUES (1)"))
    with pytest.raises(StoreError):
        await open_store(db_url, migrations=(*MIGRATIONS, bad))
    async with open_store(db_url) as store:
        assert await store.schema_version() == LATEST
    # Had the failed migration's CREATE TABLE survived, this one would fail.
    good = Migration(LATEST + 1, "extra", ("CREATE TABLE extra (x INTEGER)",))
    async with open_store(db_url, migrations=(*MIGRATIONS, good)) as store:
        assert await store.schema_version() == LATEST + 1
    assert raw_query(db_url, "SELECT version FROM schema_migrations ORDER BY version") == [
        (v,) for v in range(1, LATEST + 2)
    ]


async def test_newer_schema_is_refused(db_url: str) -> None:
    async with open_store(db_url):
        pass
    raw_query(
        db_url,
        "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
        (LATEST + 6, "from the future", 0.0),
    )
    with pytest.raises(SchemaTooNewError) as info:
        await open_store(db_url)
    assert (
        f"database schema version {LATEST + 6} is newer than this llmgw (knows up to {LATEST}): "
        "upgrade llmgw" in str(info.value)
    )


async def test_reopen_keeps_data(db_url: str) -> None:
    async with open_store(db_url) as store:
        await store.put_model(model("kept", replicas=3), create_only=True)
        await store.record_node_seen("node-a", "10.0.0.1")
        await store.audit("alice", "model.add", "kept", {"why": "test"})
        await store.set_setting("serving.stopped", True, "alice")
    async with open_store(db_url) as store:
        assert await store.get_model("kept") == model("kept", replicas=3)
        assert [n.id for n in await store.list_known_nodes()] == ["node-a"]
        assert [(e.actor, e.detail) for e in await store.list_audit()] == [("alice", {"why": "test"})]
        setting = await store.get_setting("serving.stopped")
        assert setting is not None and (setting.value, setting.version) == (True, 1)


# -- contents ------------------------------------------------------------------------------


async def test_models_crud_and_conflict(db_url: str) -> None:
    spec = ModelSpec(
        name="qwen-0.5b",
        engine="vllm",
        source="/models/qwen",
        profile=Profile(
            replicas=2,
            memory_mb=4096,
            cpu_cores=1.5,
            gpus=1,
            engine_args=("--max-model-len", "4096"),
            engine_env={"VLLM_X": "1"},
        ),
    )
    async with open_store(db_url) as store:
        assert await store.get_model("qwen-0.5b") is None
        assert await store.put_model(spec, create_only=True) == spec
        assert await store.get_model("qwen-0.5b") == spec

        with pytest.raises(ConflictError, match="model 'qwen-0.5b' already exists"):
            await store.put_model(model("qwen-0.5b"), create_only=True)
        assert await store.get_model("qwen-0.5b") == spec  # the conflict changed nothing

        replaced = model("qwen-0.5b", replicas=0)
        assert await store.put_model(replaced, create_only=False) == replaced
        await store.put_model(model("a-first"), create_only=False)  # upsert creates too
        assert await store.list_models() == [model("a-first"), replaced]

        assert await store.delete_model("qwen-0.5b") is True
        assert await store.delete_model("qwen-0.5b") is False
        assert await store.list_models() == [model("a-first")]


async def test_models_keep_their_adapters(db_url: str) -> None:
    spec = ModelSpec(
        name="base", engine="vllm", source="/models/base",
        adapters=(Adapter("sql", "hf://org/sql-lora@v1"), Adapter("chat", "/adapters/chat")),
        max_loaded_adapters=1,
    )
    async with open_store(db_url) as store:
        assert await store.put_model(spec, create_only=True) == spec
        assert await store.get_model("base") == spec
        fewer = attrs.evolve(spec, adapters=(Adapter("chat", "/adapters/chat2"),), max_loaded_adapters=0)
        assert await store.put_model(fewer, create_only=False) == fewer
        assert await store.list_models() == [fewer]


async def test_adapter_and_model_names_share_one_namespace(db_url: str) -> None:
    base = ModelSpec(name="base", engine="vllm", source="/m", adapters=(Adapter("sql", "/a/sql"),))
    async with open_store(db_url) as store:
        await store.put_model(base, create_only=True)
        with pytest.raises(ConflictError, match="model name 'sql' is already taken by an adapter of model 'base'"):
            await store.put_model(model("sql"), create_only=True)
        clash = ModelSpec(name="other", engine="vllm", source="/m", adapters=(Adapter("base", "/a/x"),))
        with pytest.raises(ConflictError, match="adapter name 'base' is already taken by model 'base'"):
            await store.put_model(clash, create_only=False)
        assert [m.name for m in await store.list_models()] == ["base"]  # nothing was written
        # Replacing a model may keep (or rename) its own adapters.
        renamed = attrs.evolve(base, adapters=(Adapter("sql2", "/a/sql"),))
        assert await store.put_model(renamed, create_only=False) == renamed
        assert await store.put_model(model("sql"), create_only=True) == model("sql")  # the name is free again


async def test_migration_3_keeps_existing_models_without_adapters(db_url: str) -> None:
    """A catalog written at schema 2 reads back unchanged, with no adapters, after migration 3."""
    async with open_store(db_url, migrations=MIGRATIONS[:2]) as store:
        assert await store.schema_version() == 2
    raw_query(
        db_url,
        "INSERT INTO models (name, engine, source, profile, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?)",
        ("old", "llama.cpp", "/models/old.gguf", '{"replicas": 2}', 1.0, 1.0),
    )
    async with open_store(db_url) as store:
        assert await store.schema_version() == LATEST
        [old] = await store.list_models()
    assert old == ModelSpec(name="old", engine="llama.cpp", source="/models/old.gguf", profile=Profile(replicas=2))


async def test_nodes_keep_first_seen_and_follow_address(db_url: str) -> None:
    async with open_store(db_url) as store:
        first = await store.record_node_seen("node-b", "10.0.0.2")
        await store.record_node_seen("node-a", "10.0.0.1")
        again = await store.record_node_seen("node-b", "10.0.0.99")
        assert again.first_seen == first.first_seen
        assert again.last_seen >= first.last_seen
        assert again.address == "10.0.0.99"
        nodes = await store.list_known_nodes()
        assert [(n.id, n.address, n.labels) for n in nodes] == [
            ("node-a", "10.0.0.1", {}),
            ("node-b", "10.0.0.99", {}),
        ]


async def test_audit_is_newest_first_with_detail(db_url: str) -> None:
    async with open_store(db_url) as store:
        assert await store.list_audit() == []
        for i in range(3):
            await store.audit("bob", "settings.set", f"key{i}", {"n": i, "nested": {"list": [i, None]}})
        entries = await store.list_audit(2)
        assert [e.target for e in entries] == ["key2", "key1"]
        assert entries[0].detail == {"n": 2, "nested": {"list": [2, None]}}
        assert entries[0].id > entries[1].id
        assert len(await store.list_audit()) == 3
        with pytest.raises(TypeError):
            await store.audit("bob", "x", "y", {"bad": object()})
        assert len(await store.list_audit()) == 3


async def test_settings_history(db_url: str) -> None:
    async with open_store(db_url) as store:
        assert await store.get_setting("serving.stopped") is None
        assert await store.setting_history("serving.stopped") == []
        assert await store.set_setting("serving.stopped", False, "alice") == 1
        assert await store.set_setting("serving.stopped", True, "bob") == 2
        assert await store.set_setting("other", {"a": [1, "two"]}, "carol") == 1
        assert await store.set_setting("serving.stopped", None, "carol") == 3

        current = await store.get_setting("serving.stopped")
        assert current is not None
        assert (current.value, current.version, current.actor) == (None, 3, "carol")
        history = await store.setting_history("serving.stopped")
        assert [(h.version, h.value, h.actor) for h in history] == [
            (1, False, "alice"),
            (2, True, "bob"),
            (3, None, "carol"),
        ]
        other = await store.get_setting("other")
        assert other is not None and other.value == {"a": [1, "two"]}
        with pytest.raises(TypeError):
            await store.set_setting("serving.stopped", {1, 2}, "dave")
        with pytest.raises(ValueError):
            await store.set_setting("serving.stopped", float("nan"), "dave")
        assert len(await store.setting_history("serving.stopped")) == 3


async def test_admin_tokens_are_checked_by_their_hash_and_refused_once_revoked(db_url: str) -> None:
    async with open_store(db_url) as store:
        record, token = new_admin_token("ops-bot", "alice")
        saved = await store.create_admin_token(record)
        assert (saved.name, saved.created_by, saved.revoked_at) == ("ops-bot", "alice", None) and saved.created_at > 0
        assert token not in repr(saved) and saved.secret_sha256 != token.split("_", 2)[2]
        with pytest.raises(ConflictError):
            await store.create_admin_token(record)
        assert (await authenticate(store, f"Bearer {token}")).id == saved.id
        for header, words in [("", "needs `Authorization: Bearer"), (f"Bearer {token}x", "wrong secret"),
                              ("Bearer llmgw_abc_def", "not an admin token"),
                              ("Bearer llmgwadmin_000000000000_secret", "unknown admin token")]:
            with pytest.raises(AdminAuthError, match=words):
                await authenticate(store, header)
        revoked = await store.revoke_admin_token(saved.id)
        assert revoked is not None and revoked.revoked_at is not None
        assert (await store.revoke_admin_token(saved.id)) == revoked  # idempotent
        assert await store.revoke_admin_token("nope") is None
        with pytest.raises(AdminAuthError, match="was revoked"):
            await authenticate(store, f"Bearer {token}")
        assert [t.id for t in await store.list_admin_tokens()] == [saved.id]


async def test_concurrent_writers_lose_no_updates(db_url: str) -> None:
    """Tasks on two stores (like two control planes on one database) write the same rows."""
    writers_per_store = 8
    async with open_store(db_url) as one, open_store(db_url) as two:
        versions: list[int] = []

        async def writer(store: Store, n: int) -> None:
            versions.append(await store.set_setting("shared", n, f"writer-{n}"))
            await store.audit(f"writer-{n}", "write", "shared", {})
            await store.record_node_seen("node", f"10.0.0.{n}")

        async with trio.open_nursery() as nursery:
            for n in range(writers_per_store * 2):
                nursery.start_soon(writer, one if n % 2 else two, n)

        total = writers_per_store * 2
        assert sorted(versions) == list(range(1, total + 1))
        history = await one.setting_history("shared")
        assert [h.version for h in history] == list(range(1, total + 1))
        assert sorted(h.value for h in history) == list(range(total))
        current = await two.get_setting("shared")
        assert current is not None and current.version == total
        assert {e.actor for e in await one.list_audit(100)} == {f"writer-{n}" for n in range(total)}
        assert len(await two.list_known_nodes()) == 1


# -- failure modes -------------------------------------------------------------------------


@contextlib.contextmanager
def holding_write_lock(url: str) -> Iterator[None]:
    """Hold a lock that blocks the store's settings writes until the block exits."""
    with raw_connection(url) as conn:
        if isinstance(conn, sqlite3.Connection):
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            finally:
                conn.execute("ROLLBACK")
        else:
            with conn.transaction():
                conn.execute("LOCK TABLE settings IN EXCLUSIVE MODE")
                yield


async def test_a_blocked_write_times_out(db_url: str) -> None:
    async with open_store(db_url, timeout_s=0.3) as store:
        with holding_write_lock(db_url):
            with pytest.raises(StoreTimeoutError):
                await store.set_setting("k", 1, "alice")
        assert await store.set_setting("k", 2, "alice") == 1  # the failed write left nothing


async def test_closed_store_refuses_work(db_url: str) -> None:
    store = await open_store(db_url)
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(StoreClosedError):
        await store.list_models()


def terminate_store_connection(dsn: str) -> None:
    """pg_terminate_backend the store's connection(s) to ``dsn``'s database (application
    name llmgw) and wait until each has exited, as a DBA or a failover would."""
    dbname = dsn.rsplit("/", 1)[1]
    killed = raw_query(
        server_dsn(),  # the maintenance database: the store's own may refuse connections
        "SELECT pg_terminate_backend(pid, ?) FROM pg_stat_activity "
        "WHERE datname = ? AND application_name = 'llmgw'",
        (TERMINATE_WAIT_MS, dbname),
    )
    assert killed == [(True,)]


#: How long pg_terminate_backend waits for the backend to exit (it is local: far less).
TERMINATE_WAIT_MS = 5000


@pytest.mark.postgres
async def test_postgres_retries_once_after_losing_its_connection(
    pg_dsn: str, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """Every kind of call succeeds, applied exactly once, on the call after a terminated
    connection: the break is found before COMMIT, so even writes that are not safe to
    repeat are retried."""
    async with open_store(pg_dsn) as store:
        await store.set_setting("k", 1, "alice")
        calls = {
            "read": lambda: store.get_setting("k"),
            "setting": lambda: store.set_setting("k", 2, "alice"),
            "audit": lambda: store.audit("alice", "poke", "k"),
            "usage": lambda: store.add_usage([UsageRecord("t", "m", 1, 2, 3, 0.0)]),
            "create": lambda: store.put_model(model("once"), create_only=True),
            "upsert": lambda: store.put_model(model("once", replicas=2), create_only=False),
        }
        for name, call in calls.items():
            terminate_store_connection(pg_dsn)
            caplog.clear()
            await call()
            assert "the connection was lost" in caplog.text, name
        setting = await store.get_setting("k")
        assert setting is not None and (setting.value, setting.version) == (2, 2)
        assert [(e.action, e.target) for e in await store.list_audit()] == [("poke", "k")]
        assert [(u.requests, u.prompt_tokens) for u in await store.list_usage()] == [(1, 2)]
        once = await store.get_model("once")
        assert once is not None and once.profile.replicas == 2


class _TerminateBeforeCommit:
    """A transaction body that inserts a row and, on its first run only, has its own
    backend terminated after the insert: the COMMIT that follows finds the connection gone."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.runs = 0

    def __call__(self, tx: Any) -> str:
        self.runs += 1
        tx.execute("INSERT INTO settings (key, value, version, updated_at, actor) VALUES (?, '1', 1, 0, 'x')",
                   (f"run-{self.runs}",))
        if self.runs == 1:
            ((pid,),) = tx.execute("SELECT pg_backend_pid()")
            assert raw_query(self.dsn, "SELECT pg_terminate_backend(?, ?)", (pid, TERMINATE_WAIT_MS)) == [(True,)]
        return "done"


@pytest.mark.postgres
@pytest.mark.parametrize("idempotent", [False, True])
def test_postgres_commit_cut_is_repeated_only_when_idempotent(pg_dsn: str, idempotent: bool) -> None:  # noqa: F811
    trio.run(_migrated, pg_dsn)
    driver = PostgresDriver.open(pg_dsn)
    body = _TerminateBeforeCommit(pg_dsn)
    try:
        if idempotent:
            assert driver.transaction(body, write=True, idempotent=True) == "done"
        else:
            with pytest.raises(StoreUnavailableError, match="lost while committing .* may or may not"):
                driver.transaction(body, write=True)
        assert driver.transaction(lambda tx: tx.execute("SELECT 1"), write=False) == [(1,)]  # reconnected
    finally:
        driver.close()
    keys = [k for (k,) in raw_query(pg_dsn, "SELECT key FROM settings ORDER BY key")]
    # The cut transaction never committed; only the repeat (when allowed) did.
    assert (body.runs, keys) == ((2, ["run-2"]) if idempotent else (1, []))


@pytest.mark.postgres
async def test_postgres_that_refuses_the_new_connection_fails_the_call_with_the_reason(
    pg_dsn: str  # noqa: F811
) -> None:
    dbname = pg_dsn.rsplit("/", 1)[1]
    async with open_store(pg_dsn) as store:
        await store.set_setting("k", 1, "alice")
        raw_query(server_dsn(), f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS false')
        try:
            terminate_store_connection(pg_dsn)
            with pytest.raises(StoreUnavailableError, match="cannot connect to .*not currently accepting"):
                await store.get_setting("k")
        finally:
            raw_query(server_dsn(), f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true')
        setting = await store.get_setting("k")  # the server takes connections again: so does the store
        assert setting is not None and setting.value == 1


async def _migrated(dsn: str) -> None:
    async with open_store(dsn):
        pass


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_dead_postgres_is_named_without_password() -> None:
    port = _closed_port()
    with pytest.raises(StoreUnavailableError) as info:
        await open_store(f"postgresql://llmgw:s3cret@127.0.0.1:{port}/llmgw")
    message = str(info.value)
    assert f"postgresql://llmgw@127.0.0.1:{port}/llmgw" in message
    assert "s3cret" not in message
    assert "check that PostgreSQL is running" in message


async def test_dsn_in_key_value_form_is_postgres_and_never_a_file(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """The tester's DSN: it used to open a new SQLite file named after itself, password included."""
    monkeypatch.chdir(tmp_path)
    port = _closed_port()
    with pytest.raises(StoreUnavailableError) as info:
        await open_store(f"host=127.0.0.1 port={port} dbname=x user=postgres password=s3cret")
    message = str(info.value)
    assert f"PostgreSQL database host=127.0.0.1 port={port} dbname=x user=postgres" in message
    assert "s3cret" not in message and "check that PostgreSQL is running" in message
    assert list(tmp_path.iterdir()) == []


async def test_driver_messages_are_masked() -> None:
    # libpq repeats the bad port value in its message; here it is the password too.
    with pytest.raises(StoreUnavailableError) as info:
        await open_store("host=127.0.0.1 port=hunter2x dbname=x password=hunter2x")
    assert "hunter2x" not in str(info.value) and "***" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.postgres
async def test_postgres_in_key_value_form(pg_dsn: str) -> None:  # noqa: F811
    async with open_store(as_conninfo(pg_dsn)) as store:
        await store.set_setting("k", 1, "alice")
    assert raw_query(pg_dsn, "SELECT key FROM settings") == [("k",)]


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _modes(directory: Any) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}


async def test_sqlite_files_are_owner_only(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    tmp_path.chmod(0o700)
    with umask(0o022):  # the usual umask: files 0644 unless the store says otherwise
        async with open_store(tmp_path / "llmgw.db") as store:
            await store.set_setting("k", 1, "alice")
            assert _modes(tmp_path) == {"llmgw.db": 0o600, "llmgw.db-wal": 0o600, "llmgw.db-shm": 0o600}
    assert "mode" not in caplog.text  # nothing to warn about


async def test_sqlite_looser_files_are_tightened_and_directory_warned(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_store(tmp_path / "llmgw.db") as store:
        await store.set_setting("k", 1, "alice")
    for name in ("llmgw.db", "llmgw.db-wal", "llmgw.db-shm"):
        (tmp_path / name).touch()
        (tmp_path / name).chmod(0o644)
    tmp_path.chmod(0o755)
    async with open_store(tmp_path / "llmgw.db") as store:
        setting = await store.get_setting("k")
        assert setting is not None and setting.value == 1
        assert _modes(tmp_path) == {"llmgw.db": 0o600, "llmgw.db-wal": 0o600, "llmgw.db-shm": 0o600}
    assert caplog.text.count("had mode 0644 (others could read it): tightened to 0600") == 3
    assert f"run `chmod 700 {tmp_path}`" in caplog.text
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755  # a directory may be shared: warned, not changed


async def test_sqlite_in_a_missing_directory_is_named(tmp_path: Any) -> None:
    path = tmp_path / "no-such-dir" / "llmgw.db"
    with pytest.raises(StoreUnavailableError, match="directory exists") as info:
        await open_store(path)
    assert str(path) in str(info.value)


async def test_sqlite_file_that_is_not_a_database(tmp_path: Any) -> None:
    path = tmp_path / "llmgw.db"
    path.write_bytes(b"this is not an SQLite file, just some text that is long enough" * 20)
    with pytest.raises(StoreUnavailableError, match="not a database"):
        await open_store(f"sqlite:{path}")


def test_parse_target() -> None:
    assert parse_target("sqlite:///var/lib/llmgw/llmgw.db") == ("sqlite", "/var/lib/llmgw/llmgw.db")
    assert parse_target("sqlite:rel.db") == ("sqlite", "rel.db")
    assert parse_target("/state/llmgw.db") == ("sqlite", "/state/llmgw.db")
    assert parse_target("postgresql://u@h/db") == ("postgres", "postgresql://u@h/db")
    assert parse_target("postgres://u@h/db") == ("postgres", "postgres://u@h/db")
    with pytest.raises(ValueError, match="unsupported scheme 'mysql'"):
        parse_target("mysql://u@h/db")
    with pytest.raises(ValueError, match="names no file"):
        parse_target("sqlite://")


def test_redact_dsn() -> None:
    assert redact_dsn("postgresql://u:pw@h1:5432,h2:5433/db?sslmode=require&password=x") == (
        "postgresql://u@h1:5432,h2:5433/db?sslmode=require"
    )
    assert "pw" not in redact_dsn("host=h user=u password=pw dbname=db")
    assert "host=h" in redact_dsn("host=h user=u password=pw dbname=db")
