"""Block hashes of prompts remembered by their segments, so a conversation's next turn
costs only its new text.

A locally tokenized prompt is a chain of segments (llmgw/hftokenizer.py), and a
conversation's next turn repeats the segments of the last one and adds some. After each
segment :class:`TurnHashMemo` remembers where the block chain stood (the event hashes of
the full blocks so far, the last block's digest, and the tokens after it), keyed by the
segment chain (a hash over the tokenizer, the hashing parameters and every segment up
to there). A new prompt walks its chain, resumes from the longest remembered one and
tokenizes and hashes only what follows: for a 4k-token conversation whose earlier turns
were seen, a few hundred microseconds less rendering and tokenizing than the whole
(bench/routing.py ``router_cost``).
"""

from __future__ import annotations

import collections
from typing import Sequence

import attrs

from llmgw import kvhash

from llmgw.hftokenizer import LocalTokenizer, Parts

#: Chain states remembered (about 200 bytes each plus a share of the hashes list of the
#: request that made it: ~50 MB at this bound), least recently used dropped first.
MAX_CHAIN_STATES = 200_000


@attrs.frozen
class _ChainState:
    """Where a chain stood after one segment: ``hashes[:count]`` are its full blocks' event
    hashes (the list is shared with the request that made it), ``parent`` the last block's
    digest, ``pending`` the tokens not yet in a full block."""

    hashes: list[int]
    count: int
    parent: bytes
    pending: tuple[int, ...]


class TurnHashMemo:
    """See the module docstring. ``resumed`` counts prompts that resumed a remembered chain,
    ``segments_skipped`` the segments they did not tokenize again. Not thread-safe."""

    def __init__(self, max_states: int = MAX_CHAIN_STATES) -> None:
        self.max_states = max_states
        self._states: collections.OrderedDict[int, _ChainState] = collections.OrderedDict()
        self.resumed = 0
        self.segments_skipped = 0

    def __len__(self) -> int:
        return len(self._states)

    def event_hashes(
        self,
        tokenizer: LocalTokenizer,
        parts: Parts,
        block_size: int,
        blocks: kvhash.BlockHashMemo,
        *,
        seed: str | None,
        lora: tuple[str, str] | None,
        cache_salt: str | None,
    ) -> list[int]:
        """Return the event hashes of every full block of ``parts`` (as
        ``blocks.event_hashes(tokenizer.ids(parts), ...)`` would), resuming the longest
        remembered chain. Raises ValueError if ``block_size`` is not positive."""
        segments = parts.segments
        key = hash((tokenizer.digest, block_size, seed, lora, cache_salt, parts.prefix))
        keys: list[int] = []
        for segment in segments:
            key = hash((key, segment))
            keys.append(key)
        states = self._states
        start, state = 0, None
        for i in range(len(keys) - 1, -1, -1):
            state = states.get(keys[i])
            if state is not None:
                states.move_to_end(keys[i])
                start = i + 1
                break
        if state is None:
            out: list[int] = []
            parent = blocks.root(seed)
            pending: list[int] = list(parts.prefix)
        else:
            self.resumed += 1
            self.segments_skipped += start
            out = state.hashes[:state.count]
            parent = state.parent
            pending = list(state.pending)
        for i in range(start, len(segments)):
            pending.extend(tokenizer.segment_ids(segments[i]))
            full = len(pending) - len(pending) % block_size
            if full:
                parent = blocks.extend(out, parent, pending[:full], block_size, lora=lora, cache_salt=cache_salt)
                del pending[:full]
            self._remember(keys[i], _ChainState(out, len(out), parent, tuple(pending)))
        if parts.suffix:
            pending.extend(parts.suffix)
            blocks.extend(out, parent, _full_blocks(pending, block_size), block_size, lora=lora,
                          cache_salt=cache_salt)
        return out

    def _remember(self, key: int, state: _ChainState) -> None:
        self._states[key] = state
        if len(self._states) > self.max_states:
            self._states.popitem(last=False)


def _full_blocks(tokens: Sequence[int], block_size: int) -> Sequence[int]:
    return tokens[:len(tokens) - len(tokens) % block_size]
