"""The KV subscriber's mirror and delta logic (pure): idempotence, net changes, resets, splitting."""

import pytest

from llmgw.node.kvevents import KvEventsConfig, KvMirror
from llmgw import kvwire as wire
from llmgw.spec import KvDelta, split_delta


def stored(*hashes, block_size=16, medium="GPU"):
    ev = wire.block_stored(hashes, None, list(range(len(hashes) * block_size)), block_size)
    ev["medium"] = medium
    return ev


def test_first_take_is_a_full_copy_then_net_changes():
    m = KvMirror()
    m.apply(stored(1, 2))
    first = m.take()
    assert first.reset and set(first.stored) == {1, 2} and first.removed == ()
    assert first.block_size == 16, "learned from BlockStored"
    assert not m.has_pending
    m.apply(stored(3))
    m.apply(wire.block_removed([1]))
    d = m.take()
    assert not d.reset and d.stored == (3,) and d.removed == (1,)
    assert d.events_applied == 3


def test_repeated_block_stored_is_idempotent():
    m = KvMirror(block_size=32)
    m.apply(stored(5))
    m.take()
    m.apply(stored(5))
    m.apply(stored(5))
    assert not m.has_pending and m.blocks == {5}
    assert m.block_size == 32, "the launch block size wins over the event's"


def test_stored_then_removed_between_sends_cancels_out():
    m = KvMirror()
    m.take()
    m.apply(stored(7))
    m.apply(wire.block_removed([7]))
    assert not m.has_pending and m.blocks == set()
    # removed then stored again: the router already has it, so nothing to send either
    m.apply(stored(8))
    m.take()
    m.apply(wire.block_removed([8]))
    m.apply(stored(8))
    assert not m.has_pending and m.blocks == {8}


def test_removing_an_unknown_block_changes_nothing():
    m = KvMirror()
    m.take()
    m.apply(wire.block_removed([99]))
    assert not m.has_pending


def test_all_blocks_cleared_makes_the_next_send_a_reset():
    m = KvMirror()
    m.apply(stored(1, 2))
    m.take()
    m.apply(wire.all_blocks_cleared())
    m.apply(stored(3))
    d = m.take()
    assert d.reset and d.stored == (3,)


def test_other_media_are_not_mirrored():
    m = KvMirror()
    m.take()
    m.apply(stored(4, medium="CPU"))
    assert not m.has_pending and m.blocks == set()


def test_digest_hashes_are_folded_to_uint64():
    m = KvMirror()
    digest = bytes(range(32))
    m.apply({"type": "BlockStored", "block_hashes": [digest], "block_size": 16})
    assert m.blocks == {int.from_bytes(digest, "big") & (2**64 - 1)}


def test_malformed_hash_is_an_error():
    with pytest.raises(ValueError):
        KvMirror().apply({"type": "BlockStored", "block_hashes": ["x"]})


def test_full_copy_does_not_consume_pending():
    m = KvMirror()
    m.take()
    m.apply(stored(1))
    full = m.full_copy()
    assert full.reset and full.stored == (1,)
    assert m.take().stored == (1,)


def test_split_keeps_meaning_and_bounds_size():
    d = KvDelta(reset=True, stored=tuple(range(10)), removed=(), events_applied=4, gaps=1)
    parts = split_delta(d, 4)
    assert [len(p.stored) for p in parts] == [4, 4, 2]
    assert [p.reset for p in parts] == [True, False, False]
    assert all(p.events_applied == 4 and p.gaps == 1 for p in parts)
    mixed = split_delta(KvDelta(stored=(1, 2, 3), removed=(4, 5)), 2)
    assert sum((p.stored for p in mixed), ()) == (1, 2, 3) and sum((p.removed for p in mixed), ()) == (4, 5)
    assert all(len(p.stored) + len(p.removed) <= 2 for p in mixed)
    assert split_delta(KvDelta(reset=True), 4) == [KvDelta(reset=True)]
    with pytest.raises(ValueError):
        split_delta(d, 0)


def test_config_round_trips_json():
    c = KvEventsConfig("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", block_size=128)
    assert KvEventsConfig.from_dict(c.to_dict()) == c
