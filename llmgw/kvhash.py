"""vLLM's ``sha256_cbor`` prefix-cache block hashing, reproduced exactly.

vLLM names every *full* block of a request's tokens by a chained hash::

    NONE_HASH = sha256_cbor(seed)                       # seed: PYTHONHASHSEED or "vllm-none-hash"
    block[i]  = sha256_cbor((parent, tuple(tokens_i), extra_keys_i))
    parent    = NONE_HASH for block 0, else block[i-1]

where ``sha256_cbor(x) = sha256(cbor2.dumps(x, canonical=True)).digest()`` and
``extra_keys_i`` is ``None`` or a tuple of keys: ``("lora", name, path)`` on every
block of a LoRA request, then ``("cache_salt", salt)`` on block 0 only.

KV events carry each digest folded to a uint64 (:func:`event_hash`). The simulated
engine (``llmgw.sim``) and the router both use these functions, so the router's
hashes match what any vLLM started with ``--prefix-caching-hash-algo sha256_cbor``
and the same seed publishes. Everything here is pure: no I/O, no global state.
:class:`BlockHashMemo` remembers digests in its own instance, so that a prompt which
extends one hashed before (a conversation's next turn) hashes only its new blocks.
"""

from __future__ import annotations

import collections
import hashlib
import os
from typing import Iterable, Sequence

import cbor2

#: The seed vLLM hashes when ``PYTHONHASHSEED`` is not set.
DEFAULT_SEED = "vllm-none-hash"

#: The ``PYTHONHASHSEED`` the agent starts every engine that publishes KV events with
#: (vLLM and the simulator), and so the seed the router hashes requests with. A profile
#: that overrides it breaks precise routing; the router's hash-agreement check says so.
KV_HASH_SEED = "0"

#: Tokens per KV block when an engine is not told otherwise: vLLM's default on GPUs, and the
#: simulator's (the agent reads it to know the block size of a sim shard started without one).
DEFAULT_BLOCK_SIZE = 16

#: Mask applied by vLLM (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default)
#: to turn a 32-byte digest into the uint64 it puts in KV events.
UINT64_MASK = (1 << 64) - 1

ExtraKeys = tuple[tuple[object, ...], ...] | None


def sha256_cbor(value: object) -> bytes:
    """Return the 32-byte SHA-256 digest of ``value`` encoded as canonical CBOR."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def seed_from_env(environ: "os._Environ[str] | dict[str, str] | None" = None) -> str | None:
    """Return the hash seed vLLM would use from the environment (``PYTHONHASHSEED``), or None.

    ``None`` means "not set", for which :func:`none_hash` uses :data:`DEFAULT_SEED`.
    """
    env = os.environ if environ is None else environ
    return env.get("PYTHONHASHSEED")


def none_hash(seed: str | None = None) -> bytes:
    """Return vLLM's ``NONE_HASH``: the parent digest of block 0.

    ``seed`` is the ``PYTHONHASHSEED`` string as vLLM sees it; ``None`` (unset)
    selects :data:`DEFAULT_SEED`.
    """
    return sha256_cbor(DEFAULT_SEED if seed is None else seed)


def block_extra_keys(
    block_index: int,
    *,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
) -> ExtraKeys:
    """Return the ``extra_keys`` vLLM hashes into block ``block_index``, or None when empty.

    ``lora`` is ``(lora_name, lora_path)`` as given to ``load_lora_adapter``; it is
    keyed into every block. ``cache_salt`` is keyed into block 0 only.
    """
    keys: list[tuple[object, ...]] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    if cache_salt is not None and block_index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def hash_block(parent: bytes, tokens: Sequence[int], extra_keys: ExtraKeys = None) -> bytes:
    """Return the digest of one full block given its parent's digest, tokens and extra keys."""
    return sha256_cbor((parent, tuple(tokens), extra_keys))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: str | None = None,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
    parent: bytes | None = None,
    first_block_index: int = 0,
) -> list[bytes]:
    """Return the 32-byte digests of every full block of ``token_ids``, in order.

    A trailing partial block is not hashed (vLLM never caches it). ``seed``,
    ``lora`` and ``cache_salt`` are as for :func:`none_hash` and
    :func:`block_extra_keys`.

    ``parent`` and ``first_block_index`` continue an existing chain: pass the
    digest of block ``first_block_index - 1`` and the tokens from that block on
    (used to hash the blocks a decode fills without re-hashing the prompt).

    Raises ValueError if ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = none_hash(seed) if parent is None else parent
    out: list[bytes] = []
    full = len(token_ids) // block_size
    for i in range(full):
        index = first_block_index + i
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        prev = hash_block(prev, chunk, block_extra_keys(index, lora=lora, cache_salt=cache_salt))
        out.append(prev)
    return out


def event_hash(digest: bytes) -> int:
    """Return the uint64 vLLM publishes in KV events for ``digest`` (its low 64 bits, big-endian)."""
    return int.from_bytes(digest, "big") & UINT64_MASK


def event_hashes(digests: Iterable[bytes]) -> list[int]:
    """Return :func:`event_hash` of each digest, in order."""
    return [event_hash(d) for d in digests]


#: Blocks a :class:`BlockHashMemo` remembers by default. An entry is about 700 bytes
#: (measured: the key's tuple of 16 token ints and the ints themselves, the digests, the
#: LRU entry): 150,000 blocks is ~100 MB and 2.4 million tokens of recent prompts, a
#: thousand conversations of a few thousand tokens each.
DEFAULT_MEMO_BLOCKS = 150_000


class BlockHashMemo:
    """Block digests remembered by what they hash: (parent digest, block tokens, extra keys).

    vLLM's chain makes a block's digest a function of that triple alone, so a prompt that
    extends one seen before (a conversation's next turn: the same system prompt and earlier
    turns, then new tokens) finds its leading blocks here with a dictionary lookup each
    and hashes only the blocks after them. At most ``max_blocks`` are kept, least recently
    used dropped first. Counters: ``hashed`` (blocks hashed), ``remembered`` (blocks found).
    Not thread-safe; one per router.
    """

    def __init__(self, max_blocks: int = DEFAULT_MEMO_BLOCKS) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self._known: collections.OrderedDict[tuple[bytes, tuple[int, ...], ExtraKeys], tuple[bytes, int]] = (
            collections.OrderedDict()
        )
        self._roots: dict[str | None, bytes] = {}
        self.hashed = 0
        self.remembered = 0

    def __len__(self) -> int:
        return len(self._known)

    def event_hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        seed: str | None = None,
        lora: tuple[str, str] | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Return :func:`event_hash` of every full block of ``token_ids``, as
        ``event_hashes(block_hashes(token_ids, block_size, ...))`` would.

        Raises ValueError if ``block_size`` is not positive.
        """
        out: list[int] = []
        self.extend(out, self.root(seed), token_ids, block_size, lora=lora, cache_salt=cache_salt)
        return out

    def root(self, seed: str | None) -> bytes:
        """Return the parent digest of a chain's first block (:func:`none_hash` of ``seed``)."""
        parent = self._roots.get(seed)
        if parent is None:
            parent = self._roots[seed] = none_hash(seed)
        return parent

    def extend(
        self,
        out: list[int],
        parent: bytes,
        token_ids: Sequence[int],
        block_size: int,
        *,
        lora: tuple[str, str] | None = None,
        cache_salt: str | None = None,
    ) -> bytes:
        """Append to ``out`` the event hashes of the full blocks of ``token_ids``, which follow
        the ``len(out)`` blocks already chained to ``parent`` (:meth:`root` for none); return
        the digest of the last block (``parent`` when no block is full).

        Raises ValueError if ``block_size`` is not positive.
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        first_extra = block_extra_keys(0, lora=lora, cache_salt=cache_salt)
        extra = block_extra_keys(1, lora=lora, cache_salt=cache_salt)
        known = self._known
        first = not out
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            key = (parent, tuple(token_ids[start:start + block_size]), first_extra if first else extra)
            first = False
            found = known.get(key)
            if found is None:
                digest = sha256_cbor(key)
                found = (digest, int.from_bytes(digest, "big") & UINT64_MASK)
                known[key] = found
                self.hashed += 1
                if len(known) > self.max_blocks:
                    known.popitem(last=False)
            else:
                known.move_to_end(key)
                self.remembered += 1
            parent = found[0]
            out.append(found[1])
        return parent
