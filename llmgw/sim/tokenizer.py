"""A deterministic word-level tokenizer and chat template for the simulated engine.

Text is cut into pieces (a special token, an optional leading space plus a word,
an optional leading space plus a run of punctuation, or a run of whitespace) and
each piece maps to a stable id derived from a hash of its UTF-8 bytes, so the
same text gives the same ids in every process and on every machine. Decoding
uses the pieces this process has seen (every generated word is pre-registered);
an id never seen decodes to ``<|id|>``.

The chat template is ChatML-like::

    <|im_start|>{role}\\n{content}<|im_end|>\\n ... [<|im_start|>assistant\\n]
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Any, Iterable, Sequence

#: Size of the id space; ids of ordinary pieces fall in [FIRST_PIECE_ID, VOCAB_SIZE).
VOCAB_SIZE = 50_000
#: Ids below this are reserved for special tokens.
FIRST_PIECE_ID = 100

SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 1,
    "<|im_start|>": 2,
    "<|im_end|>": 3,
}
EOS_TOKEN_ID = SPECIAL_TOKENS["<|im_end|>"]

#: Bound on the id -> piece memory, so a benchmark feeding random text cannot grow
#: the process without limit; pieces past it still encode, they just decode as ``<|id|>``.
MAX_REMEMBERED_PIECES = 500_000

_PIECE_RE = re.compile(
    "|".join(re.escape(s) for s in SPECIAL_TOKENS) + r"| ?\w+| ?[^\s\w]+|\s+",
)

_id_to_piece: dict[int, str] = {v: k for k, v in SPECIAL_TOKENS.items()}


@functools.lru_cache(maxsize=65_536)
def piece_id(piece: str) -> int:
    """Return the stable id of one piece (special tokens have their fixed ids)."""
    special = SPECIAL_TOKENS.get(piece)
    if special is not None:
        return special
    digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest()
    tid = FIRST_PIECE_ID + int.from_bytes(digest, "big") % (VOCAB_SIZE - FIRST_PIECE_ID)
    if tid not in _id_to_piece and len(_id_to_piece) < MAX_REMEMBERED_PIECES:
        _id_to_piece[tid] = piece
    return tid


def split(text: str) -> list[str]:
    """Return the pieces of ``text``; joining them gives ``text`` back."""
    return _PIECE_RE.findall(text)


def encode(text: str) -> list[int]:
    """Return the token ids of ``text``."""
    return [piece_id(p) for p in _PIECE_RE.findall(text)]


def decode(token_ids: Iterable[int]) -> str:
    """Return the text of ``token_ids``; unknown ids render as ``<|id|>``."""
    get = _id_to_piece.get
    return "".join(get(t) or f"<|{t}|>" for t in token_ids)


def message_text(content: Any) -> str:
    """Return the text of a chat message's ``content`` (a string, None, or a list of parts).

    Text parts are concatenated; other parts (images, audio) are ignored.
    Raises ValueError for any other shape.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif not isinstance(part, dict):
                raise ValueError("message content parts must be objects")
        return "".join(texts)
    raise ValueError("message content must be a string or a list of content parts")


def render_chat(messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
    """Return the prompt text for ``messages`` (a list of ``{"role", "content"}`` objects).

    Raises ValueError if ``messages`` is not a list of objects with a string role.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    parts = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("each message must be an object with a string 'role'")
        parts.append(f"<|im_start|>{m['role']}\n{message_text(m.get('content'))}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def encode_chat(messages: Sequence[Any], add_generation_prompt: bool = True) -> list[int]:
    """Return the token ids of the rendered chat template (see :func:`render_chat`)."""
    return encode(render_chat(messages, add_generation_prompt))


#: The words generated text is made of (each is one token, with a leading space).
WORDS: tuple[str, ...] = tuple(
    (
        "the of and to in is that for it as with was on be by at this are from or an have not "
        "model token cache block prefix route node gpu engine replica shard event batch prompt "
        "river stone cloud light quiet green swift north amber echo lantern meadow harbor signal "
        "orbit pixel vector kernel tensor layer weight sample stream reply answer"
    ).split()
)
GENERATED_PIECES: tuple[str, ...] = tuple(" " + w for w in WORDS)
GENERATED_IDS: tuple[int, ...] = tuple(piece_id(p) for p in GENERATED_PIECES)
