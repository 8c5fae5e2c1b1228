"""The simulated prefix cache: vLLM's hit rule, events with vLLM's hashes, LRU eviction."""

from llmgw import kvhash
from llmgw.sim.cache import LoraRef, PrefixCache

BS = 4


def make(num_blocks=8, seed=None):
    events = []
    return PrefixCache(BS, num_blocks, seed=seed, emit=events.append), events


def test_first_prefill_stores_all_full_blocks_with_vllm_hashes():
    cache, events = make(seed="0")
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    pre = cache.prefill(prompt)
    assert pre.cached_tokens == 0
    assert list(pre.hashes) == kvhash.block_hashes(prompt, BS, seed="0")
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": kvhash.event_hashes(pre.hashes),
            "parent_block_hash": None,
            "token_ids": prompt[:8],
            "block_size": BS,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
    ]
    assert (cache.queries, cache.hits) == (10, 0)


def test_repeat_hits_leading_blocks_but_never_the_last_token():
    cache, events = make()
    prompt = list(range(1, 13))  # exactly 3 blocks: at most 2 can hit
    cache.prefill(prompt)
    events.clear()
    pre = cache.prefill(prompt)
    assert pre.cached_tokens == 8
    assert cache.hits == 8 and cache.queries == 24
    # The last block is re-stored (a repeat BlockStored is what vLLM does too), parented on block 1.
    assert len(events) == 1 and events[0]["block_hashes"] == [kvhash.event_hash(pre.hashes[2])]
    assert events[0]["parent_block_hash"] == kvhash.event_hash(pre.hashes[1])
    assert events[0]["token_ids"] == prompt[8:]


def test_shared_prefix_hits_then_stores_the_rest():
    cache, events = make()
    cache.prefill([1, 2, 3, 4, 5, 6, 7, 8, 9])
    events.clear()
    pre = cache.prefill([1, 2, 3, 4, 9, 9, 9, 9, 9])
    assert pre.cached_tokens == 4
    assert events[0]["parent_block_hash"] == kvhash.event_hash(pre.hashes[0])
    assert events[0]["token_ids"] == [9, 9, 9, 9]


def test_eviction_emits_block_removed_lru_tail_first():
    cache, events = make(num_blocks=3)
    a = cache.prefill(list(range(100, 108)) + [0]).hashes  # 2 blocks
    b = cache.prefill(list(range(200, 204)) + [0]).hashes  # 1 block -> full
    events.clear()
    c = cache.prefill(list(range(300, 304)) + [0]).hashes  # evicts a's leaf (its tail block) first
    assert events[0] == {"type": "BlockRemoved", "block_hashes": [kvhash.event_hash(a[1])], "medium": "GPU"}
    assert events[1]["type"] == "BlockStored"
    assert a[0] in cache and a[1] not in cache and b[0] in cache and c[0] in cache
    assert len(cache) == 3


def test_lora_and_salt_change_hashes_and_events():
    cache, events = make()
    lora = LoraRef("ad", "/p/ad", 7)
    prompt = list(range(1, 10))
    pre = cache.prefill(prompt, lora=lora, cache_salt="t")
    assert list(pre.hashes) == kvhash.block_hashes(prompt, BS, lora=("ad", "/p/ad"), cache_salt="t")
    assert events[0]["lora_id"] == 7 and events[0]["lora_name"] == "ad"
    # The same tokens without the adapter do not hit.
    assert cache.prefill(prompt).cached_tokens == 0


def test_store_decoded_extends_the_chain():
    cache, events = make()
    prompt = [1, 2, 3, 4, 5, 6]
    pre = cache.prefill(prompt)
    events.clear()
    everything = prompt + [7, 8, 9, 10, 11]
    cache.store_decoded(everything, pre.hashes)
    full = kvhash.block_hashes(everything, BS)
    assert events[0]["block_hashes"] == [kvhash.event_hash(full[1])]
    assert events[0]["parent_block_hash"] == kvhash.event_hash(full[0])
    assert events[0]["token_ids"] == [5, 6, 7, 8]
    # The next turn with the whole conversation hits both blocks.
    assert cache.prefill(everything + [12]).cached_tokens == 8


def test_clear_emits_all_blocks_cleared():
    cache, events = make()
    cache.prefill(list(range(9)))
    cache.clear()
    assert events[-1] == {"type": "AllBlocksCleared"} and len(cache) == 0


def test_cached_blocks_reports_the_leading_hit_without_changing_anything() -> None:
    from llmgw.sim.cache import PrefixCache

    events: list = []
    cache = PrefixCache(16, 64, seed="0", emit=events.append)
    prompt = list(range(1, 50))  # 3 full blocks
    assert cache.cached_blocks(prompt) == 0
    cache.prefill(prompt)
    emitted, queries = len(events), cache.queries
    assert cache.cached_blocks(prompt) == 3
    assert cache.cached_blocks(prompt[:48]) == 2  # the last token is always computed
    assert cache.cached_blocks(list(range(1, 33)) + [999] * 17) == 2  # the first two blocks match
    assert cache.cached_blocks(prompt, cache_salt="other") == 0
    assert (len(events), cache.queries) == (emitted, queries)
