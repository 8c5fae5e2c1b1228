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

from llmgw.config.dsn import redact_dsn, store_backend
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
from llmgw.control.store.postgres import PG_STATEMENT_TIMEOUT_S, PostgresDriver
from llmgw.control.store.sql import Driver, SqlStore
from llmgw.control.store.sqlite import SQLITE_BUSY_TIMEOUT_S, SQLITE_DIR_MODE, SqliteDriver

__all__ = [
    "AuditEntry",
    "ConflictError",
    "MIGRATIONS",
    "STORE_DIR_MODE",
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

#: The mode of a directory that holds a SQLite store (llmgw creates its state directory so).
STORE_DIR_MODE = SQLITE_DIR_MODE


def parse_target(target: str | os.PathLike[str]) -> tuple[str, str]:
    """Return ``(backend, location)`` for a store URL, DSN or path.

    ``sqlite:///abs/path.db`` -> ("sqlite", "/abs/path.db"); ``sqlite:rel.db`` or a bare path
    -> ("sqlite", path); ``postgresql://...``, ``postgres://...`` or libpq ``key=value`` text
    -> ("postgres", the DSN). Raises ValueError for an empty target, another URL scheme or
    ``key=value`` text that is not a valid DSN (see :func:`llmgw.config.dsn.store_backend`);
    the message never repeats the target.
    """
    if isinstance(target, os.PathLike):
        text = os.fspath(target)
        if not text:
            raise ValueError("the store location is empty: give a SQLite file or a PostgreSQL DSN")
        return "sqlite", text  # a path object is a file, whatever its name
    backend, location = store_backend(target)
    return ("postgres" if backend == "postgresql" else "sqlite"), location


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

    ``target`` is ``sqlite:///path/to/file.db`` or a bare path (SQLite; the file is created
    0600 and its directory must exist; see :mod:`.sqlite` for the modes it enforces), or a
    PostgreSQL DSN: ``postgresql://user[:password]@host[:port]/database`` or libpq's
    ``key=value`` form. A read, or a write that is safe to repeat, that finds its PostgreSQL
    connection lost is retried once on a new connection (see :mod:`.postgres`).
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
