"""vLLM's KV-event wire format: event maps, batches and message frames (pure, no I/O).

A published message is three frames ``[topic, seq, payload]``: the topic in UTF-8
(an empty frame for ""), ``seq`` an 8-byte big-endian counter from 0, and the
payload a msgpack array ``[ts, events, data_parallel_rank]``. Each event is a
msgpack map whose first key is ``"type"``; fields without a default are always
present (``None`` included), optional ones only when set.
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

import msgpack

#: vLLM reports "GPU" as the medium even on CPU.
MEDIUM = "GPU"

#: The replay socket's end-of-replay marker frames (after the empty delimiter).
REPLAY_END_SEQ = b"\xff" * 8

Event = dict[str, Any]


def block_stored(
    block_hashes: Sequence[int],
    parent_block_hash: int | None,
    token_ids: Sequence[int],
    block_size: int,
    lora_id: int | None = None,
    lora_name: str | None = None,
) -> Event:
    """Return a ``BlockStored`` event map; ``token_ids`` are all tokens of the listed blocks."""
    return {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent_block_hash,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": MEDIUM,
        "lora_name": lora_name,
    }


def block_removed(block_hashes: Sequence[int]) -> Event:
    """Return a ``BlockRemoved`` event map."""
    return {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": MEDIUM}


def all_blocks_cleared() -> Event:
    """Return an ``AllBlocksCleared`` event map."""
    return {"type": "AllBlocksCleared"}


def encode_seq(seq: int) -> bytes:
    """Return ``seq`` as the 8-byte big-endian frame vLLM sends."""
    return struct.pack(">Q", seq)


def decode_seq(frame: bytes) -> int:
    """Return the sequence number in an 8-byte big-endian frame; raises ValueError if not 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return struct.unpack(">Q", frame)[0]


def encode_batch(ts: float, events: Sequence[Event], data_parallel_rank: int = 0) -> bytes:
    """Return the msgpack payload of one ``KVEventBatch``."""
    return msgpack.packb([float(ts), list(events), data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[Event], int]:
    """Return ``(ts, events, data_parallel_rank)`` from a batch payload; raises ValueError if malformed."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"KV event batch is not valid msgpack: {exc}") from exc
    if not isinstance(obj, list) or len(obj) != 3 or not isinstance(obj[1], list):
        raise ValueError("KV event batch must be an array [ts, events, data_parallel_rank]")
    return float(obj[0]), obj[1], int(obj[2] or 0)
