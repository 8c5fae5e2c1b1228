"""KvIndex: deltas, resets, forgetting, the memory bound, leading matches."""

from __future__ import annotations

import pytest

from llmgw.router.kvindex import KvIndex
from llmgw.spec import KvDelta


def test_stored_removed_and_reset() -> None:
    index = KvIndex()
    index.apply("a", KvDelta(reset=True, stored=(1, 2, 3), block_size=16, events_applied=4))
    index.apply("b", KvDelta(stored=(1, 9)))
    assert len(index) == 5
    assert index.holders(1) == ["a", "b"]
    assert index.block_size("a") == 16 and index.block_size("b") == 0
    index.apply("a", KvDelta(stored=(4, 2), removed=(1, 77)))  # repeated store, unknown removal
    assert len(index) == 5
    assert not index.holds("a", 1) and index.holds("a", 4)
    index.apply("a", KvDelta(reset=True, stored=(7,)))
    assert len(index) == 3 and index.holders(2) == [] and index.block_size("a") == 16
    assert index.replica("a").events_applied == 0  # counters follow the latest delta


def test_forget_drops_replica() -> None:
    index = KvIndex()
    index.apply("a", KvDelta(stored=(1, 2)))
    index.apply("b", KvDelta(stored=(2,)))
    index.forget("a")
    index.forget("nobody")
    assert len(index) == 1 and index.holders(2) == ["b"] and index.replica("a") is None


def test_leading_match_stops_at_first_gap() -> None:
    index = KvIndex()
    index.apply("a", KvDelta(stored=(1, 2, 4)))
    assert index.leading_match("a", [1, 2, 3, 4]) == 2
    assert index.leading_match("a", [5, 1]) == 0
    assert index.leading_match("unknown", [1]) == 0
    assert index.leading_match("a", [1, 2, 3, 4], also={3: 1.0}) == 4
    assert index.leading_matches(["a", "x"], [1, 2]) == {"a": 2, "x": 0}


def test_memory_bound_evicts_oldest_of_largest_replica() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("small", KvDelta(stored=tuple(range(1000, 1010))))
    index.apply("big", KvDelta(stored=tuple(range(95))))
    assert len(index) <= 100
    assert index.evicted > 0
    big = index.replica("big")
    assert big is not None and 0 not in big.blocks and 94 in big.blocks  # oldest went first
    assert len(index.replica("small").blocks) == 10  # the smaller replica kept everything


def test_invalid_bound() -> None:
    with pytest.raises(ValueError):
        KvIndex(max_blocks=0)
