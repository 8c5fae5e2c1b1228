"""Approximate prefix routing: a bounded tree of the prompt text routed to each replica.

For engines that publish no KV events (llama.cpp) and for replicas whose events are
missing or stale, the router remembers what it sent where and assumes the replica
still holds it. The prompt's text (:func:`prompt_text`) is cut into chunks of
:data:`CHUNK_CHARS` characters; node *i* of the path is named by a hash chained over
chunks 0..i, so a node stands for a whole prefix and two prompts share the nodes of
their common leading chunks: a radix tree stored as a set of path hashes per
replica. Matching walks the request's chain until the first node the replica lacks.

Each replica keeps at most its *bound* of nodes, least recently used evicted first (a
replica's real cache is bounded too, and forgets old prefixes), and touching a path
refreshes every node on it. The bound starts at :data:`MAX_NODES_PER_REPLICA` and is
learnt from what the engine itself reports holding (its usage's cached prompt tokens,
:meth:`PrefixTree.engine_held`): a tree larger than the replica's cache claims prefixes
the engine evicted long ago, prices that replica's queued work too low, and piles
requests onto it (on an unseen workload: load spread 1.2 and a TTFT p99 1.28x round
robin's). A claim the engine contradicts shrinks the bound by :data:`SHRINK_FACTOR` (once
per window: claims made before the last shrink do not count again); a claim it bears out
while the tree is full lets the bound grow by :data:`GROW_NODES`. Engines that never
report cached tokens leave the bound where it starts.

Synchronous, no I/O; path hashes use Python's ``hash``, so they are only meaningful
within one process (which is all a router needs).
"""

from __future__ import annotations

import collections
import json
from typing import Any, Mapping

#: Characters per tree node. About 32 tokens of English text: fine enough that a shared
#: system prompt and each chat turn map onto whole nodes, coarse enough that an
#: 8k-token prompt is ~250 nodes to hash.
CHUNK_CHARS = 128

#: Nodes remembered per replica (LRU past it): 64k nodes of 128 characters is ~8 MB of
#: prompt text, more than a llama.cpp replica's slots hold, at ~100 bytes of memory each.
MAX_NODES_PER_REPLICA = 65_536

#: The least a learnt bound shrinks to: 64 nodes is ~2k tokens, a couple of system prompts;
#: below that the tree would forget a prefix between two turns of one conversation.
MIN_NODES_PER_REPLICA = 64
#: A claim the engine contradicts multiplies the bound by this (and evicts down to it). A
#: quarter less per window finds a cache 10x smaller than the tree in ~8 windows, without
#: collapsing on one eviction that other traffic caused.
SHRINK_FACTOR = 0.75
#: A claim the engine bears out while the tree is at its bound raises the bound by this
#: many nodes: a slow probe upward (a prompt is tens of nodes), so the bound settles just
#: under the size at which the engine starts to contradict the tree.
GROW_NODES = 8
#: The engine contradicts a claim when it held less than this share of the prompt tokens
#: the tree claimed it held...
CONTRADICTED_SHARE = 0.5
#: ...and at least this many tokens fewer: two nodes of text. Smaller gaps are the
#: estimate's own noise (characters per token, the chat template, block rounding).
CONTRADICTED_TOKENS = 64


def prompt_text(body: Mapping[str, Any]) -> str:
    """Return the text the tree keys a request by: its messages (chat) or prompt (completions).

    Chat messages become ``role\\0content\\0`` per message (content parts as compact
    JSON), so one conversation's next turn extends the previous turn's text. Returns ""
    when the body has neither.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                text = content if isinstance(content, str) else json.dumps(content, separators=(",", ":"))
                parts.append(f"{m.get('role', '')}\0{text}\0")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        return json.dumps(prompt[0] if isinstance(prompt[0], (str, list)) else prompt, separators=(",", ":"))
    return ""


def path_hashes(text: str, salt: object = None, chunk: int = CHUNK_CHARS) -> list[int]:
    """Return the chained node hashes of ``text``'s full chunks (a trailing partial chunk is
    not a node). ``salt`` (LoRA adapter, cache_salt) starts the chain, so salted prompts
    never share nodes with unsalted ones."""
    prev = hash(("llmgw-prefix", salt))
    out: list[int] = []
    for start in range(0, len(text) - chunk + 1, chunk):
        prev = hash((prev, text[start : start + chunk]))
        out.append(prev)
    return out


class PrefixTree:
    """Per-replica sets of prompt-path nodes with LRU eviction and a learnt bound (see the
    module docstring)."""

    def __init__(self, max_nodes_per_replica: int = MAX_NODES_PER_REPLICA) -> None:
        if max_nodes_per_replica <= 0:
            raise ValueError(f"max_nodes_per_replica must be positive, got {max_nodes_per_replica}")
        self.max_nodes = max_nodes_per_replica
        self._nodes: dict[str, collections.OrderedDict[int, None]] = {}
        self._bounds: dict[str, int] = {}  # learnt bounds (absent: max_nodes)
        self._windows: dict[str, int] = {}  # shrinks so far, per replica

    def bound(self, replica_id: str) -> int:
        """Return the most nodes ``replica_id`` keeps now (learnt, or :attr:`max_nodes`)."""
        return self._bounds.get(replica_id, self.max_nodes)

    def window(self, replica_id: str) -> int:
        """Return ``replica_id``'s window: a claim made in an earlier one does not shrink the
        bound again (pass it to :meth:`engine_held` with the claim)."""
        return self._windows.get(replica_id, 0)

    def engine_held(self, replica_id: str, window: int, claimed: float, held: int) -> None:
        """The engine of ``replica_id`` held ``held`` prompt tokens of a request for which
        the tree, in ``window``, claimed ``claimed``: learn the bound from it.

        A contradicted claim (see :data:`CONTRADICTED_SHARE`) shrinks the bound once per
        window; a claim borne out while the tree is at its bound grows it (see the module
        docstring). Never raises.
        """
        if claimed - held >= CONTRADICTED_TOKENS and held < claimed * CONTRADICTED_SHARE:
            if window != self.window(replica_id):
                return  # claimed under a larger bound, already shrunk for
            nodes = self._nodes.get(replica_id)
            size = len(nodes) if nodes is not None else 0
            self._bounds[replica_id] = max(MIN_NODES_PER_REPLICA, int(size * SHRINK_FACTOR))  # size <= bound
            self._windows[replica_id] = window + 1
            if nodes is not None:
                self._evict(nodes, self._bounds[replica_id])
            return
        nodes = self._nodes.get(replica_id)
        bound = self.bound(replica_id)
        if nodes is not None and len(nodes) >= bound and bound < self.max_nodes:
            self._bounds[replica_id] = min(self.max_nodes, bound + GROW_NODES)

    def insert(self, replica_id: str, path: list[int]) -> None:
        """Record that ``path`` (from :func:`path_hashes`) was routed to ``replica_id``.

        Every node on it becomes most recently used; old nodes past the bound are evicted.
        """
        nodes = self._nodes.get(replica_id)
        if nodes is None:
            nodes = self._nodes[replica_id] = collections.OrderedDict()
        # Leaf first, root last: the root becomes the most recent, so eviction drops a
        # path's deep nodes before the shared prefix they hang from.
        for h in reversed(path):
            if h in nodes:
                nodes.move_to_end(h)
            else:
                nodes[h] = None
        self._evict(nodes, self.bound(replica_id))

    @staticmethod
    def _evict(nodes: collections.OrderedDict[int, None], bound: int) -> None:
        while len(nodes) > bound:
            nodes.popitem(last=False)

    def match(self, replica_id: str, path: list[int]) -> int:
        """Return how many leading nodes of ``path`` ``replica_id`` holds."""
        nodes = self._nodes.get(replica_id)
        if not nodes:
            return 0
        n = 0
        for h in path:
            if h not in nodes:
                break
            n += 1
        return n

    def forget(self, replica_id: str) -> None:
        """Drop everything routed to ``replica_id`` and its learnt bound; no-op if unknown."""
        self._nodes.pop(replica_id, None)
        self._bounds.pop(replica_id, None)
        self._windows.pop(replica_id, None)

    def replica_ids(self) -> list[str]:
        """Return the replicas the tree holds nodes for."""
        return list(self._nodes)

    def size(self, replica_id: str | None = None) -> int:
        """Return the nodes held for ``replica_id``, or for all replicas together."""
        if replica_id is not None:
            return len(self._nodes.get(replica_id, ()))
        return sum(len(n) for n in self._nodes.values())
