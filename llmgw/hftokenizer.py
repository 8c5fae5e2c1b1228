"""A model's own tokenizer, loaded in the gateway from the files its engine serves.

:class:`LocalTokenizer` is built from the files a vLLM replica's guard answers on
``GET /llmgw/tokenizer`` (llmgw/node/engines/engine_path/llmgw_vllm_guard.py):
``tokenizer.json`` (loaded with the ``tokenizers`` library, the Rust tokenizer Hugging Face
models ship), ``tokenizer_config.json`` (special tokens, the chat template),
``special_tokens_map.json``, and ``chat_template.jinja`` / ``chat_template.json`` (which
newer models keep beside the config and which win over it, as in transformers).

A prompt is cut into *segments* before each occurrence of an added token (``<|im_start|>``,
``<|eot_id|>``, ...): the tokenizer splits its input at added tokens before anything else,
so each segment's ids do not depend on the text around it, and a conversation's next turn
consists of the same segments as the last plus new ones. :meth:`LocalTokenizer.segment_ids`
remembers each segment's ids (bounded), so a turn tokenizes only its new text; the caller
(llmgw/router/tokens.py) also remembers block hashes by segment chain.

Ids equal vLLM's: chat prompts are encoded without special tokens added (the template
wrote them), completions with the tokenizer's post-processor (a BOS, usually), which
:meth:`LocalTokenizer.completion_parts` reads off the tokenizer once as a fixed prefix and
suffix. What this cannot prove, the gateway's sampled ``/tokenize`` check does.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import attrs
import tokenizers

from llmgw.chattemplate import SPECIAL_TOKEN_NAMES, ChatTemplate

#: The files a tokenizer is built from; only ``tokenizer.json`` is required.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")
#: Token ids of segments remembered per tokenizer (ints of about 28 bytes plus the tuple: about
#: 40 MB at this bound), least recently used dropped first.
MAX_REMEMBERED_SEGMENT_TOKENS = 1_000_000
#: A segment longer than this (characters) is tokenized every time rather than remembered:
#: one huge unsegmented document would otherwise push out every conversation.
MAX_REMEMBERED_SEGMENT_CHARS = 200_000


def read_tokenizer_files(directory: str | Path) -> dict[str, bytes]:
    """Return the :data:`TOKENIZER_FILES` present in ``directory`` by name.

    Raises TokenizerFilesError when it holds no tokenizer.json, OSError when one cannot be read.
    """
    folder = Path(directory)
    if not (folder / "tokenizer.json").is_file():
        raise TokenizerFilesError(f"{folder} holds no tokenizer.json")
    return {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}


class TokenizerFilesError(ValueError):
    """The files do not make a tokenizer (missing tokenizer.json, bad JSON, bad template)."""


@attrs.frozen
class Parts:
    """A prompt as the tokenizer sees it: ``prefix`` ids (the post-processor's, for
    completions), the text ``segments`` in order, then ``suffix`` ids."""

    prefix: tuple[int, ...]
    segments: tuple[str, ...]
    suffix: tuple[int, ...]


def _token_text(value: Any) -> str | None:
    """Return a special token's text from its config form (a string or an AddedToken dict)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template_source(files: Mapping[str, bytes], config: Mapping[str, Any]) -> str | None:
    """Return the default chat template's source, found where transformers looks, or None."""
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].decode("utf-8")
    if "chat_template.json" in files:
        found = json.loads(files["chat_template.json"]).get("chat_template")
        if isinstance(found, str):
            return found
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one renders plain chats
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class LocalTokenizer:
    """One model's tokenizer and chat template (see the module docstring).

    ``digest`` names the files (SHA-256 over names and contents); ``chat`` is None when the
    model has no chat template (chat requests then go to the engine's ``/tokenize``).
    Raises :class:`TokenizerFilesError` when the files do not make a tokenizer.
    """

    def __init__(self, files: Mapping[str, bytes]) -> None:
        if "tokenizer.json" not in files:
            raise TokenizerFilesError("no tokenizer.json among the files")
        digest = hashlib.sha256()
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        self.digest = digest.hexdigest()
        try:
            self.tokenizer = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
            config = json.loads(files.get("tokenizer_config.json", b"{}"))
            special_map = json.loads(files.get("special_tokens_map.json", b"{}"))
            if not isinstance(config, dict) or not isinstance(special_map, dict):
                raise TokenizerFilesError("tokenizer_config.json and special_tokens_map.json must hold objects")
            special: dict[str, str] = {}
            for name in SPECIAL_TOKEN_NAMES:
                text = _token_text(config.get(name))
                if text is None:
                    text = _token_text(special_map.get(name))
                if text is not None:
                    special[name] = text
            source = _chat_template_source(files, config)
            self.chat = ChatTemplate(source, special) if source is not None else None
        except TokenizerFilesError:
            raise
        except Exception as error:  # the Rust loader, JSON and Jinja each raise their own types
            raise TokenizerFilesError(f"cannot load the tokenizer: {type(error).__name__}: {error}") from error
        self._splitter = self._added_token_splitter()
        self._prefix, self._suffix = self._post_processor_parts()
        self._memo: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        self._remembered = 0
        self.segments_tokenized = 0
        self.segments_remembered = 0

    # -- prompts ---------------------------------------------------------------------------

    def chat_parts(self, body: Mapping[str, Any]) -> Parts | None:
        """Return the prompt of a chat request ``body`` as :class:`Parts`, or None when it
        needs the engine's rendering (see llmgw/chattemplate.py) or the template
        refuses it."""
        chat = self.chat
        if chat is None:
            return None
        messages = chat.conversation(body)
        kwargs = chat.template_kwargs(body)
        if messages is None or kwargs is None:
            return None
        try:
            text = chat.render(messages, body.get("add_generation_prompt", True) is not False, kwargs)
        except Exception:  # noqa: BLE001 - a template that raises means the engine answers 400
            return None
        return Parts((), self.split(text), ())

    def completion_parts(self, prompt: str) -> Parts:
        """Return a completions prompt as :class:`Parts` (special tokens added, as vLLM adds them)."""
        return Parts(self._prefix, self.split(prompt), self._suffix)

    def ids(self, parts: Parts) -> list[int]:
        """Return the token ids of ``parts``."""
        out = list(parts.prefix)
        for segment in parts.segments:
            out.extend(self.segment_ids(segment))
        out.extend(parts.suffix)
        return out

    # -- segments --------------------------------------------------------------------------

    def split(self, text: str) -> tuple[str, ...]:
        """Return ``text`` cut before each added token it holds (joined, they give ``text``)."""
        splitter = self._splitter
        if splitter is None:
            return (text,) if text else ()
        cuts = [m.start() for m in splitter.finditer(text)]
        if not cuts or cuts[0] != 0:
            cuts.insert(0, 0)
        cuts.append(len(text))
        return tuple(text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a)

    def segment_ids(self, segment: str) -> tuple[int, ...]:
        """Return the ids of one segment (remembered, least recently used dropped first)."""
        memo = self._memo
        found = memo.get(segment)
        if found is not None:
            memo.move_to_end(segment)
            self.segments_remembered += 1
            return found
        ids = tuple(self.tokenizer.encode(segment, add_special_tokens=False).ids)
        self.segments_tokenized += 1
        if len(segment) <= MAX_REMEMBERED_SEGMENT_CHARS:
            memo[segment] = ids
            self._remembered += len(ids) + 1
            while self._remembered > MAX_REMEMBERED_SEGMENT_TOKENS:
                _, old = memo.popitem(last=False)
                self._remembered -= len(old) + 1
        return ids

    def _added_token_splitter(self) -> re.Pattern[str] | None:
        """Return a pattern matching the added tokens a prompt can be cut before, or None.

        Tokens matched after normalization, or that swallow whitespace on their left, are
        left out: cutting before them could change the ids. Longest first, as the
        tokenizer matches them (:func:`longest_first_pattern`).
        """
        contents = {
            token.content for token in self.tokenizer.get_added_tokens_decoder().values()
            if token.content and not token.normalized and not token.lstrip and not token.single_word
        }
        if not contents:
            return None
        return re.compile(longest_first_pattern(contents))

    def _post_processor_parts(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Return the ids the post-processor puts before and after a single sequence.

        Read off the tokenizer by encoding a probe with and without special tokens. Raises
        TokenizerFilesError when the post-processor does more than wrap the sequence.
        """
        probe = "hello world"
        plain = self.tokenizer.encode(probe, add_special_tokens=False).ids
        full = self.tokenizer.encode(probe, add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return tuple(full[:start]), tuple(full[start + len(plain):])
        raise TokenizerFilesError("the post-processor changes a prompt's own tokens; cannot add special tokens locally")


def longest_first_pattern(words: Iterable[str]) -> str:
    """Return a regular expression matching any of ``words`` (non-empty), the longest one
    where several match at a position: what an alternation of the words sorted longest
    first matches, with their common prefixes factored out (a trie).

    The splitter searches every prompt for the added tokens, and tokenizers have many that
    share a prefix (Llama 3: 256, ``<|reserved_special_token_N|>`` and the like). Searched
    for as one flat alternation, they took 86 us in a 4k-token Llama 3 prompt here; as a
    trie, 15 us (bench/README.md). Greedy optional groups keep the longest match first
    where one word is a prefix of another.
    """
    trie: dict[str, dict] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # a word ends here
    return _trie_pattern(trie)


def _trie_pattern(node: dict[str, dict]) -> str:
    """Return the pattern of what follows ``node`` in the trie of :func:`longest_first_pattern`."""
    branches = []
    for char in sorted(key for key in node if key):
        child, run = node[char], char
        while len(child) == 1 and "" not in child:  # a chain of single children: one literal
            ((next_char, child),) = child.items()
            run += next_char
        branches.append(re.escape(run) + _trie_pattern(child))
    if not branches:
        return ""
    if "" in node:  # a word ends here: the longer ones first, then none of them
        return "(?:" + "|".join(branches) + ")?"
    return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
