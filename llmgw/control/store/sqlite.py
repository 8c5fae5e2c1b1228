"""SQLite backend: one file (by default in the server's state directory), one connection.

The stdlib sqlite3 module is blocking; :class:`SqliteDriver` is only called from worker
threads, one call at a time (the store's lock guarantees it), so the connection is opened
with ``check_same_thread=False``.

The file holds API key hashes, tenants and the audit log, so it is owner-only: created
0600 (SQLite gives its ``-wal`` and ``-shm`` files the database file's mode), and an
existing database, WAL, SHM or journal file that others may read is tightened to 0600
with a warning. Its directory should be 0700: one that grants others any access is
warned about, not changed (it may be shared; llmgw creates its state directory 0700).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from typing import Any, Callable, Sequence, TypeVar

from llmgw.control.store.base import StoreError, StoreTimeoutError, StoreUnavailableError
from llmgw.control.store.migrations import SQLITE
from llmgw.control.store.sql import Row, Tx

T = TypeVar("T")

log = logging.getLogger(__name__)

#: How long a statement waits for another process's write lock before failing. Our own
#: transactions are a few rows; a longer wait means something else holds the file (a second
#: server on the same state directory, a backup tool, an operator's sqlite3 shell).
SQLITE_BUSY_TIMEOUT_S = 10.0

#: RETURNING (3.35) and ON CONFLICT ... DO UPDATE (3.24) are used throughout.
SQLITE_MIN_VERSION = (3, 35, 0)

#: Owner-only: the store holds key hashes, tenants and the audit log.
SQLITE_FILE_MODE = 0o600
#: The mode the store's directory should have (warned about, never changed: it may be shared).
SQLITE_DIR_MODE = 0o700
#: The files SQLite keeps beside the database (WAL mode, and a rollback journal).
SQLITE_SIDE_SUFFIXES = ("-wal", "-shm", "-journal")

# sqlite3 reports a busy timeout with these messages (there is no distinct exception type).
_LOCKED_MESSAGES = ("database is locked", "database table is locked", "database is busy")


class _SqliteTx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return self._db.execute(sql, tuple(params)).fetchall()


def secure_files(path: str) -> None:
    """Make the database at ``path`` owner-only before SQLite opens it. Blocking.

    Creates the file 0600 if it is missing (an empty file is an empty database), tightens
    the database and its side files to 0600 where others may read them (a warning each),
    and warns if the directory grants others any access. Raises StoreUnavailableError
    naming the path if the directory is missing or the file cannot be created; a file
    this user may not change is only warned about (SQLite's open then says what fails).
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, SQLITE_FILE_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StoreUnavailableError(
            f"cannot open SQLite database {path}: {exc.strerror or exc}; check that its directory "
            "exists and that this user may write there"
        ) from None
    else:
        os.close(fd)
    for name in (path, *(path + suffix for suffix in SQLITE_SIDE_SUFFIXES)):
        _tighten(name)
    dir_mode = stat.S_IMODE(os.stat(directory).st_mode)
    if dir_mode & 0o077:
        log.warning(
            "the directory %s of SQLite database %s has mode %04o (group or others may use it), "
            "and it holds API key hashes, tenants and the audit log; run `chmod %o %s` "
            "(or give the store a directory of its own)",
            directory, path, dir_mode, SQLITE_DIR_MODE, directory,
        )


def _tighten(name: str) -> None:
    """chmod ``name`` to SQLITE_FILE_MODE if it exists and others may use it; warn either way."""
    try:
        mode = stat.S_IMODE(os.stat(name).st_mode)
    except FileNotFoundError:
        return
    if not mode & 0o077:
        return
    try:
        os.chmod(name, SQLITE_FILE_MODE)
    except OSError as exc:
        log.warning("SQLite file %s has mode %04o (others may read it) and cannot be tightened: %s; "
                    "run `chmod %o %s` as its owner", name, mode, exc.strerror or exc, SQLITE_FILE_MODE, name)
        return
    log.warning("SQLite file %s had mode %04o (others could read it): tightened to %04o",
                name, mode, SQLITE_FILE_MODE)


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
        secure_files(path)
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

    def transaction(self, fn: Callable[[Tx], T], *, write: bool, idempotent: bool = False) -> T:
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
