"""Join tokens and certificate revocation in the store, on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
from typing import Any

import attrs
import pytest
import trio

from llmgw.control.store import open_store
from llmgw.control.store.base import (
    CertificateRevokedError,
    ControlPlaneRemoval,
    JoinTokenRecord,
    JoinTokenRefused,
)
from llmgw.jointoken import NodeOverrides


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/llmgw.db"
    return str(request.getfixturevalue("pg_dsn"))


def _sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _token(token_id: str, name: str = "cp-2", *, expires_at: float = 2_000.0) -> JoinTokenRecord:
    return JoinTokenRecord(token_id, "control", name, 1_000.0, "admin:alice", expires_at)


async def test_a_token_is_redeemed_once_and_only_with_its_secret(db_url: str) -> None:
    async with open_store(db_url) as store:
        await store.create_join_token(_token("t1"), _sha("s3cret"))
        with pytest.raises(JoinTokenRefused, match="not one this cluster issued"):
            await store.redeem_join_token("t1", _sha("wrong"), "10.0.0.2", now=1_500.0)
        with pytest.raises(JoinTokenRefused, match="not one this cluster issued"):
            await store.redeem_join_token("nope", _sha("s3cret"), "10.0.0.2", now=1_500.0)
        used = await store.redeem_join_token("t1", _sha("s3cret"), "10.0.0.2", now=1_500.0)
        assert (used.name, used.used_at, used.used_by) == ("cp-2", 1_500.0, "10.0.0.2")
        with pytest.raises(JoinTokenRefused, match=r"used already \(from 10.0.0.2\)"):
            await store.redeem_join_token("t1", _sha("s3cret"), "10.0.0.3", now=1_501.0)
        (listed,) = await store.list_join_tokens()
        assert listed.state(1_501.0) == "used"


async def test_a_node_tokens_overrides_are_kept_and_come_back_when_redeemed(db_url: str) -> None:
    overrides = NodeOverrides({"rack": "r1"}, ["vllm"])
    async with open_store(db_url) as store:
        await store.create_join_token(attrs.evolve(_token("t1", "n1"), role="node", overrides=overrides), _sha("s"))
        await store.create_join_token(_token("t2", "cp-3"), _sha("s"))
        assert [t.overrides for t in await store.list_join_tokens()] == [overrides, NodeOverrides()]
        used = await store.redeem_join_token("t1", _sha("s"), "10.0.0.2", now=1_500.0)
        assert used.overrides == overrides and used.used_by == "10.0.0.2"


async def test_racing_redemptions_give_the_token_to_one(db_url: str) -> None:
    async with open_store(db_url) as store:
        await store.create_join_token(_token("t1"), _sha("s"))
        outcomes: list[str] = []

        async def redeem(by: str) -> None:
            try:
                await store.redeem_join_token("t1", _sha("s"), by, now=1_500.0)
                outcomes.append("ok")
            except JoinTokenRefused:
                outcomes.append("refused")

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(redeem, f"10.0.0.{i}")
        assert sorted(outcomes) == ["ok", "refused", "refused", "refused"]


async def test_an_expired_token_is_refused_with_how_long_ago(db_url: str) -> None:
    async with open_store(db_url) as store:
        await store.create_join_token(_token("t1", expires_at=2_000.0), _sha("s"))
        with pytest.raises(JoinTokenRefused, match="expired 30s ago"):
            await store.redeem_join_token("t1", _sha("s"), "10.0.0.2", now=2_030.0)
        (listed,) = await store.list_join_tokens()
        assert listed.state(2_030.0) == "expired" and listed.used_at is None


async def test_removing_a_control_plane_revokes_its_certificate_and_pending_tokens(db_url: str) -> None:
    async with open_store(db_url) as store:
        await store.record_control_plane("cp-2", "10.0.0.2:7070", "10.0.0.2:8080", "ab12")
        await store.create_join_token(_token("t1", expires_at=4_000_000_000.0), _sha("s"))
        removal = await store.remove_control_plane("cp-2", "admin:alice")
        assert removal.record is not None and removal.record.serial == "ab12" and removal.tokens_revoked == 1
        assert await store.list_control_planes() == []
        assert await store.is_certificate_revoked("ab12")
        assert not await store.is_certificate_revoked("cd34")
        with pytest.raises(JoinTokenRefused, match="revoked"):
            await store.redeem_join_token("t1", _sha("s"), "10.0.0.2", now=1_500.0)
        with pytest.raises(CertificateRevokedError, match="llmgw ctl servers add"):
            await store.record_control_plane("cp-2", "10.0.0.2:7070", "10.0.0.2:8080", "ab12")
        # Joined again, with a new certificate: welcome back.
        again = await store.record_control_plane("cp-2", "10.0.0.2:7070", "10.0.0.2:8080", "ef56")
        assert again.serial == "ef56"
        assert await store.remove_control_plane("nobody", "admin:alice") == ControlPlaneRemoval(None, 0)
