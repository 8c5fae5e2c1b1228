"""The simulated engine's prefix cache: fixed-size blocks named by vLLM's hashes, LRU eviction.

Pure bookkeeping, no I/O: every change is reported as a KV event map through the
``emit`` callback given at construction (the publisher batches them per step).

Behaviour copied from vLLM where it is visible from outside:

- only full blocks are cached; a hit is the run of *leading* blocks present, and
  at most ``(len(prompt) - 1) // block_size`` blocks can hit (the last prompt
  token is always computed);
- prefix-cache queries and hits are counted in tokens;
- blocks after the hit run are (re)stored and announced with one ``BlockStored``
  (a repeat for a block already held is allowed, as in vLLM);
- when full, the least recently used block is evicted with a ``BlockRemoved``;
  a request's chain is touched tail first, so a prefix's leaf blocks go before
  its root.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import attrs

from llmgw import kvhash
from llmgw import kvwire


@attrs.frozen
class LoraRef:
    """A LoRA adapter as the cache needs it: its name and path (hashed) and vLLM's int id (published)."""

    name: str
    path: str
    int_id: int


@attrs.frozen
class Prefill:
    """What :meth:`PrefixCache.prefill` found: the prompt's block digests and how many tokens hit."""

    hashes: tuple[bytes, ...]
    cached_tokens: int


class PrefixCache:
    """LRU cache of block digests; reports changes as vLLM KV events through ``emit``."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        *,
        seed: str | None,
        emit: Callable[[kvwire.Event], None],
    ) -> None:
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError("block_size and num_blocks must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.seed = seed
        self._emit = emit
        self._none_hash = kvhash.none_hash(seed)
        # digest -> None; iteration order is LRU first.
        self._blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.queries = 0  # tokens looked up
        self.hits = 0  # tokens found

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def prefill(
        self,
        prompt: Sequence[int],
        *,
        lora: LoraRef | None = None,
        cache_salt: str | None = None,
    ) -> Prefill:
        """Look up ``prompt``'s leading blocks, count the hit, store the rest; return the result.

        Emits ``BlockRemoved`` for evictions and one ``BlockStored`` for the
        blocks after the hit run.
        """
        hashes, hit = self._lookup(prompt, lora, cache_salt)
        bs = self.block_size
        self.queries += len(prompt)
        self.hits += hit * bs
        self._store(hashes, hit, prompt, lora)
        return Prefill(hashes=tuple(hashes), cached_tokens=hit * bs)

    def cached_blocks(self, prompt: Sequence[int], *, lora: LoraRef | None = None, cache_salt: str | None = None) -> int:
        """Return how many leading blocks of ``prompt`` a prefill would find now (no change, no counting).

        For benchmarks: the truth an oracle router would route by.
        """
        return self._lookup(prompt, lora, cache_salt)[1]

    def _lookup(self, prompt: Sequence[int], lora: LoraRef | None, cache_salt: str | None) -> tuple[list[bytes], int]:
        """Return ``prompt``'s block hashes and how many leading ones are cached (at most all
        but the block holding the last token: vLLM always computes that one)."""
        bs = self.block_size
        hashes = kvhash.block_hashes(prompt, bs, seed=self.seed, lora=(lora.name, lora.path) if lora else None,
                                     cache_salt=cache_salt)
        max_hit = max(0, (len(prompt) - 1) // bs)
        hit = 0
        while hit < max_hit and hit < len(hashes) and hashes[hit] in self._blocks:
            hit += 1
        return hashes, hit

    def store_decoded(
        self,
        all_tokens: Sequence[int],
        prompt_hashes: Sequence[bytes],
        *,
        lora: LoraRef | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Store the full blocks that generation completed after the prompt's full blocks.

        ``all_tokens`` is prompt plus output; ``prompt_hashes`` what :meth:`prefill`
        returned. Emits as :meth:`prefill` does.
        """
        bs = self.block_size
        start = len(prompt_hashes)
        if (len(all_tokens) // bs) <= start:
            return
        tail = kvhash.block_hashes(
            all_tokens[start * bs :],
            bs,
            seed=self.seed,
            lora=(lora.name, lora.path) if lora else None,
            cache_salt=cache_salt,
            parent=prompt_hashes[-1] if prompt_hashes else None,
            first_block_index=start,
        )
        chain = list(prompt_hashes) + tail
        self._store(chain, start, all_tokens, lora)

    def clear(self) -> None:
        """Drop every block and emit ``AllBlocksCleared``."""
        self._blocks.clear()
        self._emit(kvwire.all_blocks_cleared())

    def _store(self, chain: list[bytes], first_new: int, tokens: Sequence[int], lora: LoraRef | None) -> None:
        """Store ``chain[first_new:]``, evicting LRU blocks, then touch the chain tail first."""
        bs = self.block_size
        # A chain longer than the whole cache cannot be held: keep its head.
        chain = chain[: self.num_blocks]
        blocks = self._blocks
        if first_new < len(chain):
            for digest in reversed(chain[:first_new]):
                blocks.move_to_end(digest)  # protect the hit run from eviction
            new = chain[first_new:]
            evicted: list[int] = []
            for digest in new:
                if digest in blocks:
                    blocks.move_to_end(digest)
                    continue
                if len(blocks) >= self.num_blocks:
                    old, _ = blocks.popitem(last=False)
                    evicted.append(kvhash.event_hash(old))
                blocks[digest] = None
            for h in evicted:
                self._emit(kvwire.block_removed([h]))
            self._emit(
                kvwire.block_stored(
                    block_hashes=kvhash.event_hashes(new),
                    parent_block_hash=kvhash.event_hash(chain[first_new - 1]) if first_new > 0 else None,
                    token_ids=tokens[first_new * bs : len(chain) * bs],
                    block_size=bs,
                    lora_id=lora.int_id if lora else None,
                    lora_name=lora.name if lora else None,
                )
            )
        for digest in reversed(chain):
            if digest in blocks:
                blocks.move_to_end(digest)
