"""Who leads the control planes of one store: the blocking half of the election.

An :class:`Election` owns a connection of its own (never the store's), because on
PostgreSQL leadership *is* that connection: its session holds the advisory lock
:data:`LEADER_LOCK_KEY`, and the one ``leadership`` row names the session (its backend
pid), the leader, and the epoch, a number that grows by one each time a control plane
takes the lead. Writes made on behalf of leadership check the epoch in the same
transaction (:meth:`llmgw.control.store.sql.SqlStore.set_fence`), so a leader that was
deposed while it slept cannot change anything when it wakes.

A lock alone cannot depose a leader that is frozen (SIGSTOP, a VM paused, a process
swapped out): its kernel keeps the TCP connection, and so its session and lock, alive.
So the leader renews ``renewed_at`` (the database's clock, never the callers') every few
seconds, and a standby that finds it older than the lease ends the holder's session with
``pg_terminate_backend`` and takes the lock. The leader steps down by its own clock well
before the lease ends (:mod:`llmgw.control.leader`), so two never act at once.

On SQLite (one machine by nature) the lock is an ``flock`` on a file beside the database:
the kernel releases it when the process dies; a frozen process keeps it.

Every method blocks and is called from a worker thread, one call at a time. Errors come out
as :class:`~llmgw.control.store.base.StoreError` subclasses naming the database.
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Protocol

import attrs

from llmgw.control.store import parse_target
from llmgw.control.store.base import StoreError
from llmgw.control.store.postgres import PostgresDriver
from llmgw.control.store.sql import Driver, Row, Tx

#: The PostgreSQL advisory lock a leader holds (these are the bytes b"llmgwldr").
LEADER_LOCK_KEY = int.from_bytes(b"llmgwldr", "big") & 0x7FFF_FFFF_FFFF_FFFF


@attrs.frozen
class LeaderRecord:
    """The ``leadership`` row: who leads (or last led), since when, at which epoch."""

    epoch: int
    name: str
    rpc_address: str
    http_address: str
    #: Unix seconds (the database's clock) when this leader took the lead.
    since: float
    #: Seconds since the leader last renewed, by the database's clock.
    renewed_age: float


class Election(Protocol):
    """One control plane's side of the election (see the module docstring)."""

    description: str

    def try_lead(self, name: str, rpc_address: str, http_address: str) -> int | None:
        """Take the lead if nobody holds it: returns the new epoch, or None (another leads)."""
        ...

    def renew(self, epoch: int) -> bool:
        """Mark the lead of ``epoch`` alive now; returns False if it is no longer ours (the
        epoch moved on or, on PostgreSQL, this session no longer holds the lock)."""
        ...

    def read(self) -> LeaderRecord | None:
        """Returns the ``leadership`` row (None before anyone has led)."""
        ...

    def depose_expired(self, lease_s: float) -> str | None:
        """End the session of a leader that has not renewed for ``lease_s`` seconds;
        returns its name, or None when there was none to end."""
        ...

    def close(self) -> None:
        """Close the connection, giving up the lead if held. Idempotent."""
        ...


def _record(row: Row, now: float) -> LeaderRecord:
    epoch, name, rpc, http, since, renewed_at = row[:6]
    return LeaderRecord(
        epoch=int(epoch), name=name, rpc_address=rpc, http_address=http, since=float(since),
        renewed_age=max(0.0, now - float(renewed_at)),
    )


_READ = "SELECT epoch, leader, rpc_address, http_address, since, renewed_at, backend_pid FROM leadership WHERE id = 1"


def _take(tx: Tx, name: str, rpc: str, http: str, now: float, pid: int) -> int:
    """Inside ``tx``, make ``name`` the leader at the next epoch; returns that epoch."""
    rows = tx.execute(
        "INSERT INTO leadership (id, epoch, leader, rpc_address, http_address, since, renewed_at, backend_pid) "
        "VALUES (1, 1, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET epoch = leadership.epoch + 1, leader = excluded.leader, "
        "rpc_address = excluded.rpc_address, http_address = excluded.http_address, "
        "since = excluded.since, renewed_at = excluded.renewed_at, backend_pid = excluded.backend_pid "
        "RETURNING epoch",
        (name, rpc, http, now, now, pid),
    )
    return int(rows[0][0])


class PostgresElection:
    """The election on PostgreSQL: a session-level advisory lock plus the lease row."""

    def __init__(self, dsn: str, timeout_s: float) -> None:
        self._driver = PostgresDriver.open(dsn, timeout_s)
        self.description = self._driver.description

    @staticmethod
    def _now(tx: Tx) -> float:
        return float(tx.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8")[0][0])

    def try_lead(self, name: str, rpc_address: str, http_address: str) -> int | None:
        def attempt(tx: Tx) -> int | None:
            (locked, pid) = tx.execute("SELECT pg_try_advisory_lock(?), pg_backend_pid()", (LEADER_LOCK_KEY,))[0]
            if not locked:
                return None
            return _take(tx, name, rpc_address, http_address, self._now(tx), int(pid))

        # Not repeated on a lost connection: the lock would be on a session that is gone.
        return self._driver.transaction(attempt, write=True, idempotent=False)

    def renew(self, epoch: int) -> bool:
        def attempt(tx: Tx) -> bool:
            rows = tx.execute(
                "UPDATE leadership SET renewed_at = ? WHERE id = 1 AND epoch = ? AND backend_pid = pg_backend_pid() "
                "RETURNING epoch",
                (self._now(tx), epoch),
            )
            return bool(rows)

        # A renewal repeated on a new connection finds another backend pid, and says so.
        return self._driver.transaction(attempt, write=True, idempotent=True)

    def read(self) -> LeaderRecord | None:
        def attempt(tx: Tx) -> LeaderRecord | None:
            rows = tx.execute(_READ)
            return _record(rows[0], self._now(tx)) if rows else None

        return self._driver.transaction(attempt, write=False)

    def depose_expired(self, lease_s: float) -> str | None:
        def attempt(tx: Tx) -> str | None:
            rows = tx.execute(_READ)
            if not rows:
                return None
            record = _record(rows[0], self._now(tx))
            if record.renewed_age <= lease_s:
                return None
            pid = int(rows[0][6])
            # Only while that session still holds the leader's lock: a pid may be reused.
            ended = tx.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND pid = ? AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = ?",
                (pid, LEADER_LOCK_KEY),
            )
            return record.name if ended and ended[0][0] else None

        return self._driver.transaction(attempt, write=False)

    def close(self) -> None:
        self._driver.close()


class SqliteElection:
    """The election on SQLite: an ``flock`` on ``<database>.leader`` plus the same row."""

    def __init__(self, driver: Driver, path: str) -> None:
        self._driver = driver
        self._lock_path = path + ".leader"
        self._fd: int | None = None
        self.description = driver.description

    def try_lead(self, name: str, rpc_address: str, http_address: str) -> int | None:
        if self._fd is None:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            except OSError as exc:
                os.close(fd)
                raise StoreError(f"cannot lock {self._lock_path}: {exc.strerror or exc}") from None
            self._fd = fd
        now = time.time()
        return self._driver.transaction(
            lambda tx: _take(tx, name, rpc_address, http_address, now, 0), write=True
        )

    def renew(self, epoch: int) -> bool:
        if self._fd is None:
            return False
        now = time.time()
        rows = self._driver.transaction(
            lambda tx: tx.execute("UPDATE leadership SET renewed_at = ? WHERE id = 1 AND epoch = ? RETURNING epoch",
                                  (now, epoch)),
            write=True,
        )
        return bool(rows)

    def read(self) -> LeaderRecord | None:
        now = time.time()
        rows = self._driver.transaction(lambda tx: tx.execute(_READ), write=False)
        return _record(rows[0], now) if rows else None

    def depose_expired(self, lease_s: float) -> str | None:
        return None  # the kernel ends the lock with its process; nothing else can

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None
        self._driver.close()


def open_election(target: str | os.PathLike[str], timeout_s: float) -> Election:
    """Open the election's own connection to the store at ``target`` (as for
    :func:`~llmgw.control.store.open_store`, whose migrations must have run). Blocking;
    raises StoreUnavailableError as ``open_store`` does. The caller closes the result."""
    from llmgw.control.store.sqlite import SqliteDriver

    backend, location = parse_target(target)
    if backend == "postgres":
        return PostgresElection(location, timeout_s)
    return SqliteElection(SqliteDriver.open(location, timeout_s), location)

