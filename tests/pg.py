"""PostgreSQL for tests: a fresh database per test on the server named by LLMGW_TEST_PG.

The ``pg_dsn`` fixture is available to every test (tests/conftest.py loads this module as a
plugin); mark the tests that use it ``@pytest.mark.postgres``. If no server answers, the fixture
fails the test with what to run; it never skips silently.
"""

from __future__ import annotations

import os
import urllib.parse
import uuid
from typing import Iterator

import psycopg
import psycopg.sql
import pytest

from llmgw.control.store import redact_dsn

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
#: Seconds to wait for the test server (it is local; a longer wait means it is not there).
CONNECT_TIMEOUT_S = 3


def server_dsn() -> str:
    """Return the DSN of the test server's maintenance database (env LLMGW_TEST_PG)."""
    return os.environ.get("LLMGW_TEST_PG") or DEFAULT_SERVER


def with_database(dsn: str, dbname: str) -> str:
    """Return the URL ``dsn`` pointing at database ``dbname`` instead."""
    parts = urllib.parse.urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError(f"LLMGW_TEST_PG must be a postgresql:// URL, got {dsn!r}")
    return urllib.parse.urlunsplit(parts._replace(path="/" + dbname))


def as_conninfo(dsn: str) -> str:
    """Return the URL ``dsn`` in libpq's key=value form (host, port, dbname, user; password if any)."""
    parts = urllib.parse.urlsplit(dsn)
    pairs = {"host": parts.hostname, "port": parts.port or 5432, "dbname": parts.path[1:],
             "user": parts.username, "password": parts.password}
    return " ".join(f"{key}={value}" for key, value in pairs.items() if value)


def _admin_connect(dsn: str) -> psycopg.Connection:
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
    except psycopg.OperationalError as exc:
        reason = str(exc).strip()
    # Outside the except block, so the report is this message and not a chained traceback.
    pytest.fail(
        f"no PostgreSQL server answers at {redact_dsn(dsn)} ({reason}). Start one with "
        "scripts/ensure-postgres.sh and export LLMGW_TEST_PG=<the DSN it prints>",
        pytrace=False,
    )


@pytest.fixture
def pg_dsn() -> Iterator[str]:
    """Yield the URL of a new, empty database; drop it (and its connections) afterwards."""
    server = server_dsn()
    name = f"llmgw_test_{uuid.uuid4().hex[:16]}"
    with _admin_connect(server) as admin:
        admin.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    try:
        yield with_database(server, name)
    finally:
        with _admin_connect(server) as admin:
            admin.execute(
                psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    psycopg.sql.Identifier(name)
                )
            )
