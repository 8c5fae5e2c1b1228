"""Leader election on the store: one leads, the epoch fences a deposed leader's writes,
a frozen leader is deposed after its lease, and a leader that loses the lead stops its work."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from llmgw.control.leader import LeaderElection
from llmgw.control.store import Store, open_store
from llmgw.control.store.base import FencedError
from llmgw.control.store.election import open_election
from llmgw.spec import ModelSpec
from tests.component.test_store import db_url, raw_connection  # noqa: F401 - the fixture and helper
from tests.system.harness import eventually

LEASE = 1.0


def _model(name: str) -> ModelSpec:
    return ModelSpec(name=name, engine="sim", source="sim://x")


async def test_one_control_plane_leads_and_the_epoch_grows_with_each_new_leader(db_url: str) -> None:  # noqa: F811
    async with open_store(db_url):
        pass  # migrated
    first = open_election(db_url, LEASE)
    second = open_election(db_url, LEASE)
    try:
        assert first.try_lead("cp-1", "10.0.0.1:7100", "http://10.0.0.1:8080") == 1
        assert second.try_lead("cp-2", "10.0.0.2:7100", "http://10.0.0.2:8080") is None
        record = second.read()
        assert record is not None and (record.name, record.epoch, record.rpc_address) == ("cp-1", 1, "10.0.0.1:7100")
        assert first.renew(1)
        first.close()  # gives up the lead: the lock goes with the connection (or the flock)
        # PostgreSQL frees a closed session's advisory lock once its backend has noticed the
        # close, a moment later: cp-2 campaigns until then, as a standby does.
        epoch = await eventually(lambda: second.try_lead("cp-2", "10.0.0.2:7100", "http://10.0.0.2:8080"),
                                 "cp-2 leads once cp-1's session is gone")
        assert epoch == 2
        assert not second.renew(1)
        assert second.renew(2)
    finally:
        first.close()
        second.close()


@pytest.mark.postgres
async def test_a_frozen_leader_is_deposed_after_its_lease_and_its_writes_are_refused(pg_dsn: str) -> None:
    async with open_store(pg_dsn) as old_store, open_store(pg_dsn) as new_store:
        frozen = open_election(pg_dsn, LEASE)
        standby = open_election(pg_dsn, LEASE)
        try:
            assert frozen.try_lead("cp-1", "a:1", "http://a:2") == 1
            old_store.set_fence(1)
            await old_store.put_model(_model("before"), create_only=True)
            # The leader renews no more (frozen: its session and lock stay alive).
            assert standby.depose_expired(LEASE) is None  # within its lease: left alone
            assert await eventually(lambda: standby.depose_expired(LEASE), "the frozen leader deposed") == "cp-1"
            epoch = await eventually(lambda: standby.try_lead("cp-2", "b:1", "http://b:2"), "cp-2 leads")
            assert epoch == 2
            new_store.set_fence(2)
            with pytest.raises(FencedError, match="epoch 1.*epoch 2"):
                await old_store.put_model(_model("after"), create_only=True)
            assert not frozen.renew(1)  # what the woken leader's renewal loop sees: it steps down
            await new_store.put_model(_model("by-the-new-leader"), create_only=True)
            assert [m.name for m in await new_store.list_models()] == ["before", "by-the-new-leader"]
        finally:
            frozen.close()
            standby.close()


async def _campaign(election: LeaderElection, log: list[tuple[str, Any]], *, task_status: Any) -> None:
    async def lead(epoch: int, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        log.append((election.name, epoch))
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            log.append((election.name, "stopped"))

    await election.run(lead, task_status=task_status)


@pytest.mark.postgres
async def test_the_leader_stops_its_work_when_the_store_says_another_leads(pg_dsn: str) -> None:
    async with open_store(pg_dsn) as one, open_store(pg_dsn) as two:
        log: list[tuple[str, Any]] = []
        a = LeaderElection(pg_dsn, one, name="cp-1", rpc_address="a:1", http_address="http://a:2", lease=LEASE, poll=0.1)
        b = LeaderElection(pg_dsn, two, name="cp-2", rpc_address="b:1", http_address="http://b:2", lease=LEASE, poll=0.1)
        async with trio.open_nursery() as nursery:
            await nursery.start(_campaign, a, log)
            assert a.leading and a.epoch == 1 and log == [("cp-1", 1)]
            await nursery.start(_campaign, b, log)
            await eventually(lambda: b.leader is not None and b.leader.name == "cp-1", "cp-2 sees who leads")
            assert not b.leading
            # Someone else (an operator's mistake, a split brain) moves the epoch on: cp-1's next
            # renewal is refused, its work is cancelled and its writes are fenced.
            with raw_connection(pg_dsn) as conn:
                conn.execute("UPDATE leadership SET epoch = epoch + 10")
            await eventually(lambda: ("cp-1", "stopped") in log, "cp-1 stopped its work")
            # Writes at cp-1's epoch are refused (cp-1 itself campaigns again at once, and
            # may lead again at a new epoch: the store behind ``one`` then follows it).
            async with open_store(pg_dsn) as late:
                late.set_fence(1)
                with pytest.raises(FencedError):
                    await late.put_model(_model("late"), create_only=True)
            # cp-1 closed its session, so the lock is free: one of the two leads at a new epoch.
            await eventually(lambda: a.leading or b.leading, "a new leader")
            leader = a if a.leading else b
            assert leader.epoch is not None and leader.epoch > 11
            nursery.cancel_scope.cancel()


@pytest.mark.postgres
async def test_a_leader_whose_session_was_terminated_campaigns_again_at_once(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The pause after a store failure is made longer than the test's wait: the lead lost
    # with its connection (the store still answers) must be campaigned for without it.
    monkeypatch.setattr("llmgw.control.leader.STORE_RETRY_S", 3600.0)
    async with open_store(pg_dsn) as store:
        log: list[tuple[str, Any]] = []
        alone = LeaderElection(pg_dsn, store, name="cp-1", rpc_address="a:1", http_address="http://a:2",
                               lease=LEASE, poll=0.1)
        async with trio.open_nursery() as nursery:
            await nursery.start(_campaign, alone, log)
            assert alone.epoch == 1
            with raw_connection(pg_dsn) as conn:
                conn.execute("SELECT pg_terminate_backend(backend_pid::int) FROM leadership WHERE id = 1")
            await eventually(lambda: alone.epoch == 2, "cp-1 leads again on a new session")
            assert log == [("cp-1", 1), ("cp-1", "stopped"), ("cp-1", 2)]
            nursery.cancel_scope.cancel()
