"""Replica table, load tracking and the least-outstanding policy (pure logic, no I/O)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from llmgw.router.replicas import (
    LeastOutstanding,
    LoadTracker,
    Replica,
    ReplicaTable,
    RequestInfo,
    replicas_by_model,
)

A = Replica("a", "m", "http://127.0.0.1:1", "n1")
B = Replica("b", "m", "http://127.0.0.1:2", "n2")
C = Replica("c", "m", "http://127.0.0.1:3", "n2")
INFO = RequestInfo(path="/v1/chat/completions", model="m")


def test_table_distinguishes_unknown_from_empty() -> None:
    table = ReplicaTable()
    table.set_model_replicas("m", [A, B])
    table.set_model_replicas("empty", [])
    assert table.replicas("m") == (A, B)
    assert table.replicas("empty") == ()
    assert table.replicas("nope") is None
    assert [m.name for m in table.models()] == ["empty", "m"]
    table.remove_model("empty")
    assert table.replicas("empty") is None


def test_replace_all_sets_exact_catalog_and_keeps_created() -> None:
    table = ReplicaTable()
    table.set_model_replicas("m", [A])
    created = table.models()[0].created
    table.replace_all({"m": [A, B], "other": []})
    assert table.replicas("m") == (A, B)
    assert [m.name for m in table.models()] == ["m", "other"]
    assert table.models()[0].created == created
    table.replace_all(replicas_by_model([B]))
    assert table.replicas("other") is None
    assert table.replicas("m") == (B,)


def test_table_rejects_inconsistent_updates_without_changing() -> None:
    table = ReplicaTable()
    table.set_model_replicas("m", [A])
    with pytest.raises(ValueError, match="serves 'm', not 'x'"):
        table.replace_all({"m": [A], "x": [B]})
    with pytest.raises(ValueError, match="twice"):
        table.set_model_replicas("m", [A, A])
    assert table.replicas("m") == (A,)
    assert table.replicas("x") is None


def test_lease_release_is_idempotent() -> None:
    load = LoadTracker()
    first = load.acquire("a")
    second = load.acquire("a")
    assert load.outstanding("a") == 2
    first.release()
    first.release()
    assert load.outstanding("a") == 1
    second.release()
    assert load.snapshot() == {} and load.total() == 0


def test_least_outstanding_prefers_idle_and_rotates_ties() -> None:
    load = LoadTracker()
    policy = LeastOutstanding(load)
    picks = [policy.choose([A, B, C], INFO).id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    busy = [load.acquire("a"), load.acquire("b")]
    assert {policy.choose([A, B, C], INFO).id for _ in range(3)} == {"c"}
    held_c = load.acquire("c")
    load.acquire("c")
    # a and b have one each, c two: only a and b are chosen, alternately.
    picks = [policy.choose([A, B, C], INFO).id for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]
    for lease in busy + [held_c]:
        lease.release()
    assert load.outstanding("c") == 1


async def test_wait_until_wakes_on_release() -> None:
    load = LoadTracker()
    lease = load.acquire("a")
    woke = trio.Event()

    async def waiter() -> None:
        await load.wait_until(lambda t: t.total() == 0)
        woke.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert not woke.is_set()
        lease.release()
        with trio.fail_after(5):
            await woke.wait()
