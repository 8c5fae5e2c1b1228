"""PostgreSQL backend: psycopg 3's *sync* API in worker threads, one connection.

psycopg's async API is asyncio-only, so :class:`PostgresDriver` is blocking and is only
called from worker threads, one call at a time. The connection runs in autocommit mode and
every store operation is one explicit ``conn.transaction()``. A connection that broke (server
restart, Patroni failover, ``pg_terminate_backend``) is replaced, and the operation that found
it broken is run once more on the new connection when that cannot apply it twice: always when
the break came before COMMIT was sent (PostgreSQL rolled the transaction back), and after a
break during COMMIT only for reads and writes the caller marks idempotent. Any other write
whose COMMIT was cut fails with StoreUnavailableError saying it may or may not have been
applied. The DSN's password never appears in a message: the DSN is shown redacted, and
every driver message is masked (:func:`llmgw.config.dsn.mask_secrets`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence, TypeVar

import psycopg
import psycopg.errors
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.string import TextLoader

from llmgw.config.dsn import mask_secrets, redact_dsn
from llmgw.control.store.base import StoreError, StoreTimeoutError, StoreUnavailableError
from llmgw.control.store.migrations import POSTGRES
from llmgw.control.store.sql import Row, Tx

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Seconds to wait for the server to accept a connection (libpq's minimum is 2).
PG_CONNECT_TIMEOUT_S = 5
#: Longest any one statement may run, and longest it may wait for a lock. Store operations
#: touch a few rows; anything slower is a sick server, and failing beats hanging forever.
PG_STATEMENT_TIMEOUT_S = 15.0
#: A transaction left open this long (a stuck client) is ended by the server.
PG_IDLE_IN_TRANSACTION_TIMEOUT_S = 60.0
#: TCP keepalives and a TCP user timeout, so a server that vanished from the network (no
#: RST ever arrives) is noticed within about 20 s instead of the kernel's ~15 minutes.
PG_KEEPALIVES = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "20000",  # milliseconds
}
#: Key of the advisory lock held while migrating (any fixed 64-bit value unique to this use;
#: these are the bytes b"llmgwmig").
MIGRATION_LOCK_KEY = int.from_bytes(b"llmgwmig", "big")

_CHECK = (
    "check that PostgreSQL is running and reachable from this machine, the DSN's host, "
    "port, database and user, and the credentials (password, pg_hba.conf)"
)


class _PostgresTx:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        # The store writes '?' placeholders and never a literal '?' or '%'.
        cur = self._conn.execute(sql.replace("?", "%s"), tuple(params))  # type: ignore[arg-type]
        return cur.fetchall() if cur.description is not None else []


class _ConnectionLost(Exception):
    """The connection broke during one attempt: ``error`` to raise, ``reason`` the driver's
    (masked) words, ``committing``: it broke while COMMIT was sent."""

    def __init__(self, error: StoreError, reason: str, committing: bool) -> None:
        super().__init__(reason)
        self.error = error
        self.reason = reason
        self.committing = committing


class PostgresDriver:
    """One psycopg connection; see :class:`llmgw.control.store.sql.Driver`."""

    dialect = POSTGRES

    def __init__(self, dsn: str, timeout_s: float = PG_STATEMENT_TIMEOUT_S) -> None:
        self._dsn = dsn
        self._timeout_s = timeout_s
        self._conn: psycopg.Connection[Any] | None = None
        self._closed = False
        self.description = f"PostgreSQL database {redact_dsn(dsn)}"

    @classmethod
    def open(cls, dsn: str, timeout_s: float = PG_STATEMENT_TIMEOUT_S) -> PostgresDriver:
        """Connect to ``dsn``; return the driver. Blocking.

        Raises StoreUnavailableError naming the DSN (without its password) and what to check
        if the server does not accept the connection within PG_CONNECT_TIMEOUT_S. The caller
        owns the result and must ``close()`` it.
        """
        driver = cls(dsn, timeout_s)
        driver._connect()
        return driver

    def _connect(self) -> None:
        try:
            params = conninfo_to_dict(self._dsn)
        except psycopg.Error as exc:
            raise StoreUnavailableError(f"invalid {self.description}: {self._masked(exc)}") from None
        # Settings the operator put in the DSN win over our defaults.
        options: dict[str, Any] = {"connect_timeout": str(PG_CONNECT_TIMEOUT_S), "application_name": "llmgw"}
        options.update(PG_KEEPALIVES)
        for key in list(options):
            if key in params:
                del options[key]
        try:
            conn = psycopg.connect(self._dsn, autocommit=True, **options)
        except psycopg.Error as exc:
            # Not chained: the driver's own exception could carry what the mask removed.
            raise StoreUnavailableError(
                f"cannot connect to {self.description}: {self._masked(exc)}; {_CHECK}"
            ) from None
        try:
            # JSON columns are read as text, exactly like SQLite's, and parsed by the store.
            conn.adapters.register_loader("jsonb", TextLoader)
            timeout_ms = str(max(1, int(self._timeout_s * 1000)))
            for name, value in (
                ("statement_timeout", timeout_ms),
                ("lock_timeout", timeout_ms),
                ("idle_in_transaction_session_timeout", str(int(PG_IDLE_IN_TRANSACTION_TIMEOUT_S * 1000))),
            ):
                conn.execute("SELECT set_config(%s, %s, false)", (name, value))
        except psycopg.Error as exc:
            conn.close()
            raise self._error(exc) from exc
        self._conn = conn

    def _masked(self, exc: BaseException) -> str:
        """``exc``'s message, stripped, with the DSN's passwords masked."""
        return mask_secrets(str(exc).strip(), self._dsn)

    def _error(self, exc: psycopg.Error) -> StoreError:
        message = self._masked(exc)
        if isinstance(exc, (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable)):
            return StoreTimeoutError(
                f"{self.description}: statement or lock wait exceeded {self._timeout_s:g}s "
                f"({message}); check the server's load and for long-running transactions "
                "holding locks (pg_stat_activity)"
            )
        if isinstance(exc, psycopg.OperationalError):
            return StoreUnavailableError(f"{self.description}: {message}; {_CHECK}")
        return StoreError(f"{self.description}: {message}")

    def _connection(self) -> psycopg.Connection[Any]:
        """The open connection, made anew if there is none or the last one broke."""
        if self._conn is not None and (self._conn.closed or self._conn.broken):
            self._conn.close()
            self._conn = None
        if self._conn is None:
            self._connect()
        assert self._conn is not None
        return self._conn

    def transaction(self, fn: Callable[[Tx], T], *, write: bool, idempotent: bool = False) -> T:
        """Run ``fn`` in one transaction; see :class:`llmgw.control.store.sql.Driver`.

        A lost connection is replaced and ``fn`` run once more if that cannot apply it twice
        (the break came before COMMIT, or ``write`` is false, or ``idempotent`` is true);
        otherwise, and if the second attempt fails too, StoreUnavailableError.
        """
        if self._closed:
            raise StoreError(f"{self.description} is closed")
        try:
            return self._attempt(fn)
        except _ConnectionLost as lost:
            if lost.committing and write and not idempotent:
                raise StoreUnavailableError(
                    f"{self.description}: the connection was lost while committing ({lost.reason}): "
                    "the change may or may not have been applied; check before repeating it"
                ) from None
            log.warning("%s: the connection was lost (%s); retrying once on a new connection",
                        self.description, lost.reason)
        try:
            return self._attempt(fn)
        except _ConnectionLost as lost:
            raise lost.error from None

    def _attempt(self, fn: Callable[[Tx], T]) -> T:
        """Run ``fn`` in one transaction on the connection, once. Raises _ConnectionLost
        (the connection is dropped) if the connection broke, a StoreError for other failures."""
        conn = self._connection()
        committing = False
        try:
            with conn.transaction():
                result = fn(_PostgresTx(conn))
                committing = True  # set before the context manager sends COMMIT
            return result
        except psycopg.Error as exc:
            if not (conn.closed or conn.broken):
                raise self._error(exc) from exc
            conn.close()
            self._conn = None
            raise _ConnectionLost(self._error(exc), self._masked(exc), committing) from None

    def lock_migrations(self, tx: Tx) -> None:
        tx.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK_KEY,))

    def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None
