"""SQLite backend: one file (by default in the server's state directory), one connection.

The stdlib sqlite3 module is blocking; :class:`SqliteDriver` is only called from worker
threads, one call at a time (the store's lock guarantees it), so the connection is opened
with ``check_same_thread=False``.
"""

from __future__ import annotations

import sqlite3
from typing import Any, Callable, Sequence, TypeVar

from llmgw.control.store.base import StoreError, StoreTimeoutError, StoreUnavailableError
from llmgw.control.store.migrations import SQLITE
from llmgw.control.store.sql import Row, Tx

T = TypeVar("T")

#: How long a statement waits for another process's write lock before failing. Our own
#: transactions are a few rows; a longer wait means something else holds the file (a second
#: server on the same state directory, a backup tool, an operator's sqlite3 shell).
SQLITE_BUSY_TIMEOUT_S = 10.0

#: RETURNING (3.35) and ON CONFLICT ... DO UPDATE (3.24) are used throughout.
SQLITE_MIN_VERSION = (3, 35, 0)

# sqlite3 reports a busy timeout with these messages (there is no distinct exception type).
_LOCKED_MESSAGES = ("database is locked", "database table is locked", "database is busy")


class _SqliteTx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return self._db.execute(sql, tuple(params)).fetchall()


class SqliteDriver:
    """One sqlite3 connection; see :class:`llmgw.control.store.sql.Driver`."""

    dialect = SQLITE

    def __init__(self, db: sqlite3.Connection, path: str, timeout_s: float) -> None:
        self._db: sqlite3.Connection | None = db
        self._path = path
        self._timeout_s = timeout_s
        self.description = f"SQLite database {path}"

    @classmethod
    def open(cls, path: str, timeout_s: float = SQLITE_BUSY_TIMEOUT_S) -> SqliteDriver:
        """Open (creating if missing) the database file at ``path``; return the driver.

        Blocking. Raises StoreUnavailableError naming the path if the file cannot be opened
        or is not an SQLite database. The caller owns the result and must ``close()`` it.
        """
        if sqlite3.sqlite_version_info < SQLITE_MIN_VERSION:
            raise StoreUnavailableError(
                f"cannot use SQLite database {path}: this Python's SQLite is {sqlite3.sqlite_version}, "
                f"llmgw needs {'.'.join(map(str, SQLITE_MIN_VERSION))} or newer (for RETURNING and "
                "upserts): use a newer Python build, or PostgreSQL"
            )
        try:
            # isolation_level=None: no implicit transactions; transaction() issues BEGIN itself.
            db = sqlite3.connect(
                path, timeout=timeout_s, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise StoreUnavailableError(
                f"cannot open SQLite database {path}: {exc}; check that its directory exists "
                "and that this user may write there"
            ) from exc
        driver = cls(db, path, timeout_s)
        try:
            # WAL lets readers (e.g. a backup) run while the server writes.
            db.execute("PRAGMA journal_mode=WAL").fetchall()
            db.execute("PRAGMA foreign_keys=ON")
        except sqlite3.Error as exc:
            db.close()
            raise driver._error(exc) from exc
        return driver

    def _error(self, exc: sqlite3.Error) -> StoreError:
        message = str(exc)
        if isinstance(exc, sqlite3.OperationalError) and message in _LOCKED_MESSAGES:
            return StoreTimeoutError(
                f"{self.description} stayed locked for {self._timeout_s:g}s: another process "
                "is writing it (is a second llmgw server using the same state directory?)"
            )
        if isinstance(exc, sqlite3.DatabaseError) and not isinstance(
            exc, (sqlite3.IntegrityError, sqlite3.ProgrammingError)
        ):
            return StoreUnavailableError(
                f"cannot use {self.description}: {message}; check the file, its permissions "
                "and the free disk space"
            )
        return StoreError(f"{self.description}: {message}")

    def transaction(self, fn: Callable[[Tx], T], *, write: bool) -> T:
        db = self._db
        if db is None:
            raise StoreError(f"{self.description} is closed")
        # BEGIN IMMEDIATE takes the write lock up front, so a writer never fails half-way
        # because another connection upgraded first; plain BEGIN for readers.
        try:
            db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        try:
            result = fn(_SqliteTx(db))
            db.execute("COMMIT")
        except BaseException as exc:
            if db.in_transaction:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # the original error is the one worth reporting
            if isinstance(exc, sqlite3.Error):
                raise self._error(exc) from exc
            raise
        return result

    def lock_migrations(self, tx: Tx) -> None:
        pass  # BEGIN IMMEDIATE already excludes every other writer of the file

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
