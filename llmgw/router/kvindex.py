"""The router's KV index: which replica holds which KV-cache block, from the engines' KV events.

Blocks are named by vLLM's 64-bit event hashes (:func:`llmgw.kvhash.event_hash`). The
agent mirrors each shard's engine and sends net changes (:class:`llmgw.spec.KvDelta`)
up; the control plane hands them to :meth:`KvIndex.apply`. A delta with ``reset``
replaces the replica's whole set (a full copy at session start, a resync after a gap,
an engine restart or ``AllBlocksCleared``); :meth:`KvIndex.forget` drops a replica
that left (its session ended or it stopped).

Storage is one insertion-ordered dict of hashes per replica. The question the router
asks is "how many leading blocks of this request does replica r hold", answered by
walking the request's hashes until the first one r lacks: a set lookup per block, so
an 8k-token prompt at block size 16 (512 blocks) costs at most 512 lookups per
candidate and usually stops early. Per-replica sets also make removal and full
replacement O(size of that replica) with no cross-replica bookkeeping.

Memory bound: at most :data:`MAX_INDEX_BLOCKS` entries in all. An engine cannot hold
more blocks than its cache, so the bound is only reached when a fleet is very large or
removals were lost; then the replica holding the most entries loses its oldest-stored
:data:`EVICT_FRACTION` (its least recently *stored* blocks: the ones most likely
evicted by the engine already). The router then under-counts that replica's hits,
which costs cache hits, never correctness.

Everything here is synchronous, does no I/O and runs on the trio thread.
"""

from __future__ import annotations

from typing import Container, Iterable, Sequence

import attrs

from llmgw.spec import KvDelta

#: Entries (block hash, replica) held in all. About 100 bytes each in CPython (dict slot
#: plus int object), so 4 million is ~400 MB at worst: enough for 100 replicas of
#: 40,000 blocks each (a large GPU's cache at block size 16).
MAX_INDEX_BLOCKS = 4_000_000

#: Share of the largest replica's entries dropped (oldest first) when the bound is hit.
#: Evicting in bulk keeps the amortised cost per stored block O(1).
EVICT_FRACTION = 0.1


@attrs.define
class ReplicaKv:
    """What the index knows about one replica's cache.

    ``blocks`` are its block hashes in the order they were stored (oldest first);
    ``block_size`` the tokens per block its engine reported (0: unknown); the counters
    are the agent subscriber's cumulative totals from the last delta (events applied,
    sequence gaps, resyncs).
    """

    blocks: dict[int, None] = attrs.field(factory=dict)
    block_size: int = 0
    events_applied: int = 0
    gaps: int = 0
    resyncs: int = 0


class KvIndex:
    """Block hash -> replicas holding it, bounded in memory (see the module docstring).

    ``max_blocks`` overrides :data:`MAX_INDEX_BLOCKS`.
    """

    def __init__(self, *, max_blocks: int = MAX_INDEX_BLOCKS) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self._replicas: dict[str, ReplicaKv] = {}
        self._size = 0
        #: Entries dropped by the memory bound since start (a metric: nonzero means the
        #: bound is too small for this fleet).
        self.evicted = 0

    # -- updates ----------------------------------------------------------------------

    def apply(self, replica_id: str, delta: KvDelta) -> ReplicaKv:
        """Apply one delta from ``replica_id``'s engine; return that replica's entry.

        ``reset``: the replica now holds exactly ``delta.stored``. Otherwise ``removed``
        are dropped (unknown hashes are ignored) and ``stored`` added (a hash already
        held is refreshed to newest, like a repeated BlockStored). A ``block_size`` of 0
        keeps the one known. May evict to stay under the memory bound.
        """
        entry = self._replicas.get(replica_id)
        if entry is None:
            entry = self._replicas[replica_id] = ReplicaKv()
        blocks = entry.blocks
        if delta.reset:
            self._size -= len(blocks)
            blocks = entry.blocks = dict.fromkeys(delta.stored)
            self._size += len(blocks)
        else:
            for h in delta.removed:
                if blocks.pop(h, 0) is None:
                    self._size -= 1
            for h in delta.stored:
                if blocks.pop(h, 0) is None:
                    self._size -= 1
                blocks[h] = None
                self._size += 1
        if delta.block_size > 0:
            entry.block_size = delta.block_size
        entry.events_applied = delta.events_applied
        entry.gaps = delta.gaps
        entry.resyncs = delta.resyncs
        if self._size > self.max_blocks:
            self._enforce_bound()
        return entry

    def forget(self, replica_id: str) -> None:
        """Drop everything known about ``replica_id``; no-op if unknown."""
        entry = self._replicas.pop(replica_id, None)
        if entry is not None:
            self._size -= len(entry.blocks)

    def _enforce_bound(self) -> None:
        """Drop the oldest entries of the largest replicas until under the bound."""
        while self._size > self.max_blocks:
            largest = max(self._replicas.values(), key=lambda e: len(e.blocks))
            n = len(largest.blocks)
            drop = max(self._size - self.max_blocks, int(n * EVICT_FRACTION), 1)
            keep = list(largest.blocks)[drop:]
            largest.blocks = dict.fromkeys(keep)
            self._size -= n - len(keep)
            self.evicted += n - len(keep)

    # -- queries ----------------------------------------------------------------------

    def __len__(self) -> int:
        """Return the number of (block, replica) entries held."""
        return self._size

    def replica(self, replica_id: str) -> ReplicaKv | None:
        """Return what is known about ``replica_id``, or None if no delta came from it."""
        return self._replicas.get(replica_id)

    def has_replicas(self) -> bool:
        """Return whether any replica's delta came in (else every replica is routed approximately)."""
        return bool(self._replicas)

    def replica_ids(self) -> list[str]:
        """Return the replicas the index has deltas from."""
        return list(self._replicas)

    def full_copy(self, replica_id: str) -> KvDelta | None:
        """Return ``replica_id``'s state as one reset delta (every block, oldest first, with
        its block size and counters): applied to another index it reproduces this one's
        entry. None if the replica is unknown."""
        entry = self._replicas.get(replica_id)
        if entry is None:
            return None
        return KvDelta(True, tuple(entry.blocks), (), entry.block_size,
                       entry.events_applied, entry.gaps, entry.resyncs)

    def block_size(self, replica_id: str) -> int:
        """Return ``replica_id``'s block size (0: unknown)."""
        entry = self._replicas.get(replica_id)
        return entry.block_size if entry is not None else 0

    def holds(self, replica_id: str, block_hash: int) -> bool:
        """Return whether ``replica_id`` holds ``block_hash``."""
        entry = self._replicas.get(replica_id)
        return entry is not None and block_hash in entry.blocks

    def holders(self, block_hash: int) -> list[str]:
        """Return the replicas holding ``block_hash`` (a scan over replicas: for tools and tests)."""
        return [rid for rid, entry in self._replicas.items() if block_hash in entry.blocks]

    def leading_match(
        self, replica_id: str, hashes: Sequence[int], also: Container[int] | None = None
    ) -> int:
        """Return how many leading ``hashes`` ``replica_id`` holds (0 if unknown).

        A hash also counts if it is in ``also`` (the router's routed-but-unconfirmed
        blocks). Stops at the first block held by neither.
        """
        entry = self._replicas.get(replica_id)
        blocks: Container[int] = entry.blocks if entry is not None else ()
        n = 0
        if also is None:
            for h in hashes:
                if h not in blocks:
                    break
                n += 1
        else:
            for h in hashes:
                if h not in blocks and h not in also:
                    break
                n += 1
        return n

    def leading_matches(self, replica_ids: Iterable[str], hashes: Sequence[int]) -> dict[str, int]:
        """Return :meth:`leading_match` for each of ``replica_ids``."""
        return {rid: self.leading_match(rid, hashes) for rid in replica_ids}
