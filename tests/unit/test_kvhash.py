"""llmgw.kvhash against the golden values measured on a live vLLM (shared/reference/vllm.md)."""

import hashlib

import cbor2
import pytest

from llmgw import kvhash

TOKENS_32 = list(range(1, 33))
TOKENS_64 = list(range(1, 65))


def test_none_hash_seed_unset():
    assert kvhash.none_hash().hex() == "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    assert kvhash.none_hash(None) == kvhash.none_hash(kvhash.DEFAULT_SEED)


def test_block_hashes_seed_unset_golden():
    hashes = kvhash.block_hashes(TOKENS_32, 16)
    assert [h.hex() for h in hashes] == [
        "cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682",
        "2533ea50426b36e9e4d68296cac6bce8cf602e46957d0fe40b368b33d87bf3bf",
    ]
    assert kvhash.event_hashes(hashes) == [8866452693264111234, 807986237951177663]


def test_block_hashes_pythonhashseed_0_golden():
    assert kvhash.none_hash("0").hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    hashes = kvhash.block_hashes(TOKENS_32, 16, seed="0")
    assert [h.hex() for h in hashes] == [
        "202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea",
        "4a0a393805c6d2f0ed831000d41bb65980336c4c04895d5e26470bbec927f5bf",
    ]
    assert kvhash.event_hashes(hashes) == [3236607068019569386, 2758186210834249151]


def test_block_size_32_live_events():
    assert kvhash.event_hashes(kvhash.block_hashes(TOKENS_64, 32)) == [12204319907483556814, 4209074748214054702]


def test_cache_salt_on_block_0_golden():
    hashes = kvhash.block_hashes(TOKENS_64, 32, cache_salt="tenant-A")
    assert kvhash.event_hashes(hashes) == [14674343608358853909, 11118100713856289451]


def test_lora_keys_every_block():
    plain = kvhash.block_hashes(TOKENS_64, 32)
    lora = kvhash.block_hashes(TOKENS_64, 32, lora=("my-lora", "/adapters/my-lora"))
    assert lora[0] != plain[0] and lora[1] != plain[1]
    # Built by hand from the documented recipe: ("lora", name, path) in every block's extra keys.
    key = (("lora", "my-lora", "/adapters/my-lora"),)
    b0 = hashlib.sha256(cbor2.dumps((kvhash.none_hash(), tuple(TOKENS_64[:32]), key), canonical=True)).digest()
    b1 = hashlib.sha256(cbor2.dumps((b0, tuple(TOKENS_64[32:]), key), canonical=True)).digest()
    assert lora == [b0, b1]
    # A different path is a different adapter.
    assert kvhash.block_hashes(TOKENS_64, 32, lora=("my-lora", "/other"))[0] != lora[0]


def test_lora_then_salt_order():
    assert kvhash.block_extra_keys(0, lora=("a", "/p"), cache_salt="s") == (("lora", "a", "/p"), ("cache_salt", "s"))
    assert kvhash.block_extra_keys(1, lora=("a", "/p"), cache_salt="s") == (("lora", "a", "/p"),)
    assert kvhash.block_extra_keys(1, cache_salt="s") is None


def test_partial_block_not_hashed_and_prefix_stable():
    assert kvhash.block_hashes(list(range(15)), 16) == []
    assert kvhash.block_hashes(TOKENS_32 + [7, 8, 9], 16) == kvhash.block_hashes(TOKENS_32, 16)
    assert kvhash.block_hashes(TOKENS_32, 16)[0] == kvhash.block_hashes(TOKENS_32[:16], 16)[0]


def test_chain_continuation_equals_full_hash():
    full = kvhash.block_hashes(TOKENS_64, 16, cache_salt="x", lora=("a", "/p"))
    tail = kvhash.block_hashes(TOKENS_64[32:], 16, cache_salt="x", lora=("a", "/p"), parent=full[1], first_block_index=2)
    assert full[2:] == tail


def test_event_hash_is_low_64_bits_big_endian():
    digest = bytes(range(32))
    assert kvhash.event_hash(digest) == int.from_bytes(digest[24:], "big")


def test_seed_from_env():
    assert kvhash.seed_from_env({"PYTHONHASHSEED": "0"}) == "0"
    assert kvhash.seed_from_env({}) is None


def test_bad_block_size():
    with pytest.raises(ValueError):
        kvhash.block_hashes([1, 2], 0)


def test_memo_golden_values_and_next_turn_hashes_only_new_blocks():
    memo = kvhash.BlockHashMemo()
    # vLLM 0.32, PYTHONHASHSEED=0, block size 16, tokens 1..32 (shared/reference/vllm.md)
    assert memo.event_hashes(TOKENS_32, 16, seed="0") == [3236607068019569386, 2758186210834249151]
    assert memo.hashed == 2 and memo.remembered == 0
    # The next turn: the same 32 tokens, then 40 new ones (2 new full blocks, a partial one).
    turn = TOKENS_32 + list(range(500, 540))
    assert memo.event_hashes(turn, 16, seed="0") == kvhash.event_hashes(kvhash.block_hashes(turn, 16, seed="0"))
    assert memo.hashed == 4 and memo.remembered == 2


def test_memo_keys_seed_salt_lora_and_block_size():
    memo = kvhash.BlockHashMemo()
    for kwargs in ({}, {"seed": "0"}, {"cache_salt": "tenant-A"}, {"lora": ("a", "/p")},
                   {"lora": ("a", "/p"), "cache_salt": "s"}, {"seed": "0", "lora": ("a", "/other")}):
        for size in (16, 32):
            expected = kvhash.event_hashes(kvhash.block_hashes(TOKENS_64, size, **kwargs))
            assert memo.event_hashes(TOKENS_64, size, **kwargs) == expected, (kwargs, size)
            assert memo.event_hashes(TOKENS_64, size, **kwargs) == expected, (kwargs, size)
    # A salt changes block 0 and so, through the chain, every block after it.
    assert memo.event_hashes(TOKENS_64, 32, cache_salt="tenant-A") == [14674343608358853909, 11118100713856289451]


def test_memo_bounded_least_recently_used_dropped_first():
    memo = kvhash.BlockHashMemo(max_blocks=3)
    first = memo.event_hashes(TOKENS_32, 16)
    memo.event_hashes(list(range(100, 132)), 16)  # 2 more blocks: one of the first prompt's is dropped
    assert len(memo) == 3
    hashed = memo.hashed
    assert memo.event_hashes(TOKENS_32, 16) == first  # still right, though partly hashed again
    assert memo.hashed > hashed and len(memo) == 3
    with pytest.raises(ValueError):
        kvhash.BlockHashMemo(max_blocks=0)
    with pytest.raises(ValueError):
        memo.event_hashes([1, 2], 0)
