"""Secrets never reach a log line, and the agent's last lines are kept in memory."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest

from llmgw.catalog.access import generate_key
from llmgw.control.admin_tokens import ADMIN_TOKEN_PREFIX
from llmgw.jointoken import new_token
from llmgw.logbook import REDACTED, LogRing, RedactingFormatter, redact
from llmgw.rpc.tls import new_private_key

API_KEY = generate_key()
ADMIN_TOKEN = generate_key(ADMIN_TOKEN_PREFIX)
JOIN_TOKEN = new_token("ab" * 32)
PRIVATE_KEY = new_private_key().decode()


@pytest.mark.parametrize("line, secret, kept", [
    (f"request with key {API_KEY.key} refused", API_KEY.key.split("_", 2)[2], f"llmgw_{API_KEY.key_id}_"),
    (f"admin call by {ADMIN_TOKEN.key}", ADMIN_TOKEN.key.split("_", 2)[2], f"llmgwadmin_{ADMIN_TOKEN.key_id}_"),
    (f"join with {JOIN_TOKEN}", str(JOIN_TOKEN).split(".")[2], f"llmgwj1.{JOIN_TOKEN.id}."),
    ("store postgresql://llmgw:s3cr3t-pw@db.internal:5432/llmgw unreachable", "s3cr3t-pw", "postgresql://llmgw:"),
    ("dsn host=db user=llmgw password=s3cr3t-pw dbname=llmgw", "s3cr3t-pw", "host=db user=llmgw"),
    ("headers {'authorization': 'Bearer sk-live-123456'}", "sk-live-123456", "'authorization': 'Bearer "),
    ('env {"HF_TOKEN": "hf_abcdef123456"}', "hf_abcdef123456", '"HF_TOKEN": "'),
    (f"read key.pem:\n{PRIVATE_KEY}done", PRIVATE_KEY.splitlines()[1], "read key.pem:"),
], ids=["api-key", "admin-token", "join-token", "dsn-url", "dsn-keywords", "bearer-header", "hf-token",
        "private-key"])  # fixed ids: the secrets are made afresh per run (pytest-xdist compares ids)
def test_every_secret_shape_is_redacted_and_the_rest_kept(line: str, secret: str, kept: str) -> None:
    out = redact(line)
    assert secret not in out and REDACTED in out and kept in out, out


def test_a_record_with_secret_arguments_and_traceback_is_written_redacted() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(RedactingFormatter("%(levelname)s %(message)s"))
    ring = LogRing(capacity=3)
    ring.setFormatter(RedactingFormatter("%(message)s"))
    log = logging.getLogger("test.logbook")
    log.addHandler(handler)
    log.addHandler(ring)
    log.propagate = False
    try:
        try:
            raise ValueError(f"bad key {API_KEY.key}")
        except ValueError:
            log.exception("call with %s failed", ADMIN_TOKEN.key)
        for n in range(3):
            log.warning("line %d", n)
    finally:
        log.removeHandler(handler)
        log.removeHandler(ring)
    written = stream.getvalue()
    for secret in (API_KEY.key, ADMIN_TOKEN.key):
        assert secret.split("_", 2)[2] not in written
    assert "ValueError: bad key llmgw_" in written
    # the traceback's lines came first and made room: the last three lines are kept
    assert ring.after(0, 10) == (["line 0", "line 1", "line 2"], ring.total)
    assert ring.after(0, 2) == (["line 1", "line 2"], ring.total) and ring.after(0, 0) == ([], ring.total)


def test_the_daemons_log_setup_redacts_what_any_logger_writes() -> None:
    """``llmgw server``/``agent``/``up`` call setup_logging: run it in a fresh interpreter."""
    code = ("import logging; from llmgw.cli.common import setup_logging; setup_logging('info'); "
            f"logging.getLogger('llmgw.anything').warning('store %s key %s', "
            f"'postgresql://u:pw-123@db/x', {API_KEY.key!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "pw-123" not in out.stderr and API_KEY.key not in out.stderr
    assert f"llmgw_{API_KEY.key_id}_{REDACTED}" in out.stderr and "postgresql://u:" in out.stderr


def test_a_follower_gets_each_new_line_once_and_is_told_what_it_missed() -> None:
    ring = LogRing(capacity=5)
    ring.setFormatter(logging.Formatter("%(message)s"))

    def add(*messages: str) -> None:
        for message in messages:
            ring.emit(logging.makeLogRecord({"msg": message}))

    add("a", "b")
    assert ring.after(0, 10) == (["a", "b"], 2)
    assert ring.after(2, 10) == ([], 2)
    add("c")
    assert ring.after(2, 10) == (["c"], 3)
    add("d", "e", "f", "g", "h")  # 8 lines in all; "d".."h" are kept
    assert ring.after(3, 10) == (["d", "e", "f", "g", "h"], 8)
    assert ring.after(2, 10) == (["(1 lines skipped)", "d", "e", "f", "g", "h"], 8)  # "c" left the ring
    assert ring.after(3, 2) == (["(3 lines skipped)", "g", "h"], 8)  # at most the newest 2
    assert ring.after(99, 2) == (["(the log started again)", "(3 lines skipped)", "g", "h"], 8)
