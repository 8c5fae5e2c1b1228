"""Usage journals into the store, exactly once: the store's marks, replay at start (also after a
crash between any two of its steps), and AccessSync pruning what it stored."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from llmgw.control.keys import AccessSync
from llmgw.control.store import open_store
from llmgw.control.store.base import UsageRecord
from llmgw.control.usage_replay import replay_usage_journals
from llmgw.router import ReplicaTable
from llmgw.router.app import Gateway
from llmgw.router.local import LocalGateway
from llmgw.router.usage import Usage, UsageMeter
from llmgw.usage_journal import UsageJournal, read_journals


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/llmgw.db"
    return request.getfixturevalue("pg_dsn")


def totals(rows: list[UsageRecord]) -> list[tuple[str, str, int, int, int]]:
    return [(u.tenant, u.model, u.requests, u.prompt_tokens, u.completion_tokens) for u in rows]


async def test_marks_are_stored_with_the_usage_and_never_go_down(db_url: str) -> None:
    async with open_store(db_url) as store:
        await store.add_usage([UsageRecord("acme", "m", 1, 2, 3)], marks={"j1": 5})
        await store.add_usage([], marks={"j1": 3, "j2": 1})
        assert await store.usage_marks() == {"j1": 5, "j2": 1}
        await store.forget_usage_marks(["j1", "nope"])
        assert await store.usage_marks() == {"j2": 1}
        assert totals(await store.list_usage()) == [("acme", "m", 1, 2, 3)]


async def test_replay_stores_what_is_above_the_mark_once_then_deletes_the_journal(db_url: str, tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    journal = UsageJournal(directory, journal_id="crashed")
    for _ in range(5):
        journal.append("acme", "m", 10, 1)
    async with open_store(db_url) as store:
        # The last flush before the crash stored the first three (mark 3) ...
        await store.add_usage([UsageRecord("acme", "m", 3, 30, 3)], marks={"crashed": 3})
        # ... and a first replay stored the other two, then crashed before deleting the files.
        await store.add_usage([UsageRecord("acme", "m", 2, 20, 2)], marks={"crashed": 5})
        assert await replay_usage_journals(store, directory) == 0
        assert totals(await store.list_usage()) == [("acme", "m", 5, 50, 5)]
        assert read_journals(directory) == {} and await store.usage_marks() == {}
        journal.close()
        # A journal the store has never heard of counts whole, once.
        other = UsageJournal(directory, journal_id="unflushed")
        other.append("acme", "m", 10, 1)
        other.close()
        assert await replay_usage_journals(store, directory) == 1
        assert await replay_usage_journals(store, directory) == 0
        assert totals(await store.list_usage()) == [("acme", "m", 6, 60, 6)]


async def test_a_gateway_killed_between_flushes_loses_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    async with open_store(f"sqlite://{tmp_path}/llmgw.db") as store:
        gateway = Gateway(ReplicaTable(), usage=UsageMeter(UsageJournal(directory)))
        sync = AccessSync(store, LocalGateway(gateway), usage_flush_interval=3600, usage_journal=directory)
        for _ in range(3):
            gateway.usage.record("acme", "m", Usage(2, 1))
        await sync.flush_usage()
        for _ in range(2):
            gateway.usage.record("acme", "m", Usage(2, 1))
        # kill -9 here: two requests counted in memory only, and in the journal.

        restarted = Gateway(ReplicaTable(), usage=UsageMeter(UsageJournal(directory)))
        again = AccessSync(store, LocalGateway(restarted), usage_flush_interval=3600, usage_journal=directory)
        async with trio.open_nursery() as nursery:
            await nursery.start(again.run)  # replays before reporting started
            assert totals(await store.list_usage()) == [("acme", "m", 5, 10, 5)]
            assert read_journals(directory) == {}
            restarted.usage.record("acme", "m", Usage(2, 1))
            nursery.cancel_scope.cancel()  # a clean stop: the last flush stores it
        assert totals(await store.list_usage()) == [("acme", "m", 6, 12, 6)]
