"""Store locations (llmgw.config.dsn): which backend a text names, and DSNs without secrets."""

from __future__ import annotations

import pytest

from llmgw.config.dsn import mask_secrets, parse_conninfo, redact_dsn, store_backend

SECRET = "s3cr=t pw"  # a space and an '=' inside, so quoting and splitting are exercised


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://u:pw@db1:5432/llmgw", ("postgresql", "postgresql://u:pw@db1:5432/llmgw")),
        ("postgres://db1/llmgw", ("postgresql", "postgres://db1/llmgw")),
        ("host=127.0.0.1 port=5999 dbname=x user=postgres password=pw",
         ("postgresql", "host=127.0.0.1 port=5999 dbname=x user=postgres password=pw")),
        ("host = db1  dbname='my db'", ("postgresql", "host = db1  dbname='my db'")),
        ("service=llmgw", ("postgresql", "service=llmgw")),
        ("sqlite:///var/lib/llmgw/llmgw.db", ("sqlite", "/var/lib/llmgw/llmgw.db")),
        ("sqlite:////var/lib/llmgw/llmgw.db", ("sqlite", "/var/lib/llmgw/llmgw.db")),
        ("sqlite://rel.db", ("sqlite", "rel.db")),
        ("sqlite:rel.db", ("sqlite", "rel.db")),
        ("sqlite:////srv/run=1/llmgw.db", ("sqlite", "/srv/run=1/llmgw.db")),  # '=' only via sqlite:
        ("/var/lib/llmgw/llmgw.db", ("sqlite", "/var/lib/llmgw/llmgw.db")),
        ("state/llmgw.db", ("sqlite", "state/llmgw.db")),
    ],
)
def test_store_backend_forms(text: str, expected: tuple[str, str]) -> None:
    assert store_backend(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "the store location is empty"),
        ("   ", "the store location is empty"),
        ("mysql://u:s3cret@db/x", "unsupported scheme 'mysql'"),
        ("PostgreSQL://u:s3cret@db/x", "unsupported scheme 'PostgreSQL'"),  # libpq's prefixes are lower-case
        ("sqlite://", "the SQLite URL names no file"),
        ("sqlite:", "the SQLite URL names no file"),
        # Mistyped DSNs: each would have been a SQLite file named after the password.
        ("host=db1 password='s3cret", "pair 2 has an unterminated quoted value"),
        ("host=db1 s3cret", "pair 2 has no '=' after its keyword"),
        ("host=db1 =s3cret", "pair 2 does not start with a keyword"),
        ("/srv/run=1/llmgw.db", "pair 1 does not start with a keyword"),
    ],
)
def test_store_backend_refuses(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as info:
        store_backend(text)
    # The reason names at most a scheme or a keyword, never a value.
    assert "s3cret" not in str(info.value) and "db1" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "pairs"),
    [
        ("host=db1 dbname=llmgw", {"host": "db1", "dbname": "llmgw"}),
        ("  host =  db1\tport= 5432 ", {"host": "db1", "port": "5432"}),
        ("password='it''s'", None),  # libpq has no '' escape: the second quote opens a new value
        (r"password='it\'s a \\ test'", {"password": "it's a \\ test"}),
        (r"password=a\ b", {"password": "a b"}),
        ("options='-c search_path=x'", {"options": "-c search_path=x"}),
        ("password=''", {"password": ""}),
    ],
)
def test_parse_conninfo(text: str, pairs: dict[str, str] | None) -> None:
    if pairs is None:
        with pytest.raises(ValueError):
            parse_conninfo(text)
    else:
        assert parse_conninfo(text) == pairs


@pytest.mark.parametrize(
    ("dsn", "redacted"),
    [
        ("postgresql://u:pw@h1:5432,h2:5433/db?sslmode=require&password=x",
         "postgresql://u@h1:5432,h2:5433/db?sslmode=require"),
        ("postgres://u@h/db", "postgres://u@h/db"),
        ("host=h user=u password=pw dbname=db", "host=h user=u dbname=db"),
        ("host=h sslpassword='a b' dbname='my db'", "host=h dbname='my db'"),
        ("host=h password='unterminated", "<unparseable DSN>"),
    ],
)
def test_redact_dsn(dsn: str, redacted: str) -> None:
    assert redact_dsn(dsn) == redacted


_ENCODED = SECRET.replace(" ", "%20").replace("=", "%3D")


@pytest.mark.parametrize(
    ("dsn", "forms"),
    [
        (f"postgresql://u:{_ENCODED}@h/db", (SECRET, _ENCODED)),
        (f"postgresql://u@h/db?password={_ENCODED}", (SECRET, _ENCODED)),
        (f"host=h password='{SECRET}'", (SECRET,)),
        (f"host=h sslpassword='{SECRET}'", (SECRET,)),
        (f"host=h password='{SECRET}", (SECRET,)),  # unterminated: masked all the same
        ("host=h password=hunter2", ("hunter2",)),
        ("postgresql://u:pa/s@s@h/db", ("pa/s@s",)),  # malformed: '/' and '@' not encoded
    ],
)
def test_mask_secrets(dsn: str, forms: tuple[str, ...]) -> None:
    message = "connection failed: " + " / ".join(f'invalid value "{form}"' for form in forms) + ' for user "u"'
    masked = mask_secrets(message, dsn)
    assert not [form for form in forms if form in masked]
    assert masked.startswith('connection failed: invalid value "***"') and masked.endswith('for user "u"')
    assert mask_secrets("nothing secret here", "host=h") == "nothing secret here"
