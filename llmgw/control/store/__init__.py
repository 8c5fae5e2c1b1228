"""The control plane's store: catalog, nodes, audit and settings, on SQLite or PostgreSQL.

Open one with :func:`open_store`, either awaited or as an async context manager::

    async with open_store("sqlite:///var/lib/llmgw/llmgw.db") as store:
        await store.put_model(spec, create_only=True)

    store = await open_store("postgresql://llmgw@db1:5432/llmgw")
    try:
        ...
    finally:
        await store.close()
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any, Generator, Sequence

import trio

from llmgw.control.store.base import (
    AuditEntry,
    ConflictError,
    NodeRecord,
    SchemaTooNewError,
    SettingVersion,
    Store,
    StoreClosedError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from llmgw.control.store.migrations import MIGRATIONS, Migration
from llmgw.control.store.postgres import PG_STATEMENT_TIMEOUT_S, PostgresDriver, redact_dsn
from llmgw.control.store.sql import Driver, SqlStore
from llmgw.control.store.sqlite import SQLITE_BUSY_TIMEOUT_S, SqliteDriver

__all__ = [
    "AuditEntry",
    "ConflictError",
    "MIGRATIONS",
    "Migration",
    "NodeRecord",
    "SchemaTooNewError",
    "SettingVersion",
    "Store",
    "StoreClosedError",
    "StoreError",
    "StoreTimeoutError",
    "StoreUnavailableError",
    "open_store",
    "parse_target",
    "redact_dsn",
]

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def parse_target(target: str | os.PathLike[str]) -> tuple[str, str]:
    """Return ``(backend, location)`` for a store URL or path.

    ``sqlite:///abs/path.db`` -> ("sqlite", "/abs/path.db"); ``sqlite:rel.db`` or a bare path
    -> ("sqlite", path); ``postgresql://...`` or ``postgres://...`` -> ("postgres", the DSN).
    Raises ValueError for an empty target or another URL scheme.
    """
    text = os.fspath(target)
    if text.startswith(_POSTGRES_SCHEMES):
        return "postgres", text
    if text.startswith("sqlite:"):
        path = text[len("sqlite:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ValueError(f"store URL {text!r} names no file: use sqlite:///path/to/llmgw.db")
        return "sqlite", path
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise ValueError(
            f"unsupported store URL scheme {scheme!r}: use sqlite:///path/to/file.db, "
            "a plain path, or postgresql://user@host:port/database"
        )
    if not text:
        raise ValueError("store location is empty: give a path or a postgresql:// DSN")
    return "sqlite", text


async def _open(
    target: str | os.PathLike[str], timeout_s: float | None, migrations: Sequence[Migration]
) -> Store:
    backend, location = parse_target(target)
    driver: Driver
    if backend == "postgres":
        driver = await trio.to_thread.run_sync(
            PostgresDriver.open, location, timeout_s or PG_STATEMENT_TIMEOUT_S
        )
    else:
        driver = await trio.to_thread.run_sync(
            SqliteDriver.open, location, timeout_s or SQLITE_BUSY_TIMEOUT_S
        )
    store = SqlStore(driver)
    try:
        await store.migrate(migrations)
    except BaseException:
        await store.close()
        raise
    return store


class _OpenStore:
    """What :func:`open_store` returns: await it, or use it as an async context manager."""

    def __init__(
        self, target: str | os.PathLike[str], timeout_s: float | None, migrations: Sequence[Migration]
    ) -> None:
        self._args = (target, timeout_s, migrations)
        self._store: Store | None = None

    def __await__(self) -> Generator[Any, None, Store]:
        return _open(*self._args).__await__()

    async def __aenter__(self) -> Store:
        self._store = await _open(*self._args)
        return self._store

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._store is not None
        await self._store.close()


def open_store(
    target: str | os.PathLike[str],
    *,
    timeout_s: float | None = None,
    migrations: Sequence[Migration] = MIGRATIONS,
) -> _OpenStore:
    """Open the store at ``target`` and bring its schema up to date.

    ``target`` is ``sqlite:///path/to/file.db`` or a bare path (SQLite; the file is created,
    its directory must exist) or ``postgresql://user[:password]@host[:port]/database``.
    ``timeout_s`` bounds each statement (PostgreSQL statement and lock timeouts; SQLite's
    wait for another writer's lock); None means the backend's default. ``migrations`` is
    for tests; the default is the schema this llmgw ships.

    Await the result to get a :class:`Store` (the caller closes it), or use it with
    ``async with`` (closed on exit). Raises ValueError for a malformed target,
    StoreUnavailableError if the database cannot be reached or opened (the message names it,
    without any password, and what to check) and SchemaTooNewError if a newer llmgw has
    migrated it. Cancellation while opening closes whatever was opened.
    """
    return _OpenStore(target, timeout_s, migrations)
