"""The gateway's own tokenization against what transformers (as vLLM runs it) recorded.

tests/fixtures/tokenizer/golden.json holds the ids transformers 5.19 (vLLM 0.32's) gave
for the fixture tokenizers (record.py there says how it was made): chat with the template
applied, completions with special tokens added, with and without a BOS post-processor.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jinja2
import jinja2.sandbox
import pytest
from hypothesis import given, settings, strategies as st

from llmgw import kvhash
from llmgw.chattemplate import OPENAI, STRING, ChatTemplate
from llmgw.hftokenizer import (
    TOKENIZER_FILES, LocalTokenizer, TokenizerFilesError, longest_first_pattern, read_tokenizer_files,
)
from llmgw.node.engines.engine_path import llmgw_vllm_guard
from llmgw.router.replicas import Replica, RequestInfo
from llmgw.router.tokens import TokenHasher
from llmgw.router.turnhash import TurnHashMemo

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text())


@pytest.fixture(scope="module")
def chatml() -> LocalTokenizer:
    return LocalTokenizer(read_tokenizer_files(FIXTURES / "chatml"))


@pytest.fixture(scope="module")
def bos() -> LocalTokenizer:
    return LocalTokenizer(read_tokenizer_files(FIXTURES / "bos"))


def chat_ids(tokenizer: LocalTokenizer, body: dict) -> list[int]:
    parts = tokenizer.chat_parts(body)
    assert parts is not None
    return tokenizer.ids(parts)


@pytest.mark.parametrize("case", range(len(GOLDEN["chats"])))
def test_chat_ids_are_transformers_ids(chatml: LocalTokenizer, bos: LocalTokenizer, case: int) -> None:
    body = {"messages": GOLDEN["chats"][case]}
    assert chat_ids(chatml, body) == GOLDEN["chat_ids"][case]
    assert chat_ids(bos, body) == GOLDEN["bos_chat_ids"][case]  # the template writes its own specials


@pytest.mark.parametrize("case", range(len(GOLDEN["completions"])))
def test_completion_ids_get_the_post_processors_tokens(chatml: LocalTokenizer, bos: LocalTokenizer, case: int) -> None:
    prompt = GOLDEN["completions"][case]
    assert chatml.ids(chatml.completion_parts(prompt)) == GOLDEN["completion_ids"][case]
    assert bos.ids(bos.completion_parts(prompt)) == GOLDEN["bos_completion_ids"][case]


def test_text_parts_are_joined_by_newlines_as_vllm_does(chatml: LocalTokenizer) -> None:
    joined = {"messages": [{"role": "user", "content": "one\ntwo"}]}
    parted = {"messages": [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]}
    assert chat_ids(chatml, parted) == chat_ids(chatml, joined)


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"messages": [{"role": "user", "content": "hi"}], "documents": [{"title": "t", "text": "x"}]},
    {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
    {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
    {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages }}"},
    {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": False}},
    {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"add_generation_prompt": False}},
    {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "no"},
    {"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]},
    {"messages": [{"role": "developer", "content": "be brief"}]},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nrest"}]},
    {"messages": [{"role": "user", "content": "hi", "name": 3}]},
    {"messages": []},
    {"messages": "hi"},
    {"prompt": "hi"},
])
def test_what_only_the_engine_renders_is_left_to_it(chatml: LocalTokenizer, body: dict) -> None:
    assert chatml.chat_parts(body) is None


def test_a_template_that_refuses_the_conversation_is_left_to_the_engine(chatml: LocalTokenizer) -> None:
    body = {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]}
    assert chatml.chat_parts(body) is None  # raise_exception('system only first'): the engine answers 400


def test_chat_template_kwargs_reach_the_template_only_where_it_reads_them() -> None:
    template = ChatTemplate("{{ messages[0].content }}{% if enable_thinking %}<think>{% endif %}", {})
    assert template.template_kwargs({"chat_template_kwargs": {"enable_thinking": True, "other": 1}}) == {
        "enable_thinking": True}
    assert template.template_kwargs({"chat_template_kwargs": {"enable_thinking": None}}) == {}  # unset, as vLLM
    body = {"messages": [{"role": "user", "content": "q"}]}
    assert template.render(template.conversation(body) or [], True, {"enable_thinking": True}) == "q<think>"


def test_a_template_that_loops_over_content_gets_parts() -> None:
    looping = ChatTemplate("{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}", {})
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {})
    assert (looping.content_format, plain.content_format) == (OPENAI, STRING)
    body = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert looping.render(looping.conversation(body) or [], False) == "[a][b]"


def test_template_globals_and_filters_are_transformers_ones() -> None:
    template = ChatTemplate("{{ bos_token }}{{ messages | tojson }}{% generation %}g{% endgeneration %}"
                            "{{ strftime_now('%Y') | length }}", {"bos_token": "<s>"})
    out = template.render([{"role": "user", "content": "é<>"}], False)
    assert out == '<s>[{"role": "user", "content": "é<>"}]g4'  # no HTML escaping, no ASCII escaping


@pytest.mark.parametrize("name", ["role", "content", "absent", "_private", "items", "get", "keys", "pop",
                                  "__class__", "__dict__", "__name__", "mro"])
def test_a_dicts_attributes_read_in_a_template_are_what_jinjas_sandbox_reads(name: str) -> None:
    # The gateway's sandbox reads a message's keys without Jinja's attribute attempt first:
    # keys, missing keys, dict methods and unsafe names must come out as the sandbox gives them.
    message = {"role": "user", "content": "q", "_private": 1, "items": "shadowed", "pop": 2}
    template = ChatTemplate("", {})
    ours = template._template.environment
    theirs = jinja2.sandbox.ImmutableSandboxedEnvironment()
    got, expected = ours.getattr(message, name), theirs.getattr(message, name)
    assert type(got) is type(expected)
    if isinstance(expected, jinja2.Undefined):
        assert (got._undefined_name, got._undefined_obj) == (expected._undefined_name, expected._undefined_obj)
    elif callable(expected):
        assert got == expected  # the same bound method
    else:
        assert got is expected
    rendered = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}{{ m.absent }}|{% endfor %}", {})
    assert rendered.render([message, {"role": "assistant", "content": "a"}], False) == "user:q|assistant:a|"
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{{ m.pop('role') }}", {})._template.render(m=message)  # still immutable


def test_files_that_make_no_tokenizer_are_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFilesError, match="no tokenizer.json"):
        read_tokenizer_files(tmp_path)
    files = read_tokenizer_files(FIXTURES / "chatml")
    with pytest.raises(TokenizerFilesError, match="cannot load"):
        LocalTokenizer({**files, "tokenizer.json": b"{not json"})
    with pytest.raises(TokenizerFilesError, match="cannot load"):
        LocalTokenizer({**files, "chat_template.jinja": b"{% for %}"})


def test_the_guard_serves_the_files_the_gateway_reads(tmp_path: Path) -> None:
    assert llmgw_vllm_guard.TOKENIZER_FILES == TOKENIZER_FILES
    status, body = llmgw_vllm_guard.tokenizer_files(str(FIXTURES / "chatml"))
    assert status == 200
    served = {k: v.encode() for k, v in json.loads(body)["files"].items()}
    assert served == read_tokenizer_files(FIXTURES / "chatml")
    assert llmgw_vllm_guard.tokenizer_files(str(tmp_path))[0] == 404
    assert llmgw_vllm_guard.tokenizer_files("")[0] == 404


SPECIALS = ["<|im_start|>", "<|im_end|>", "<s>", "</s>"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(SPECIALS), st.text(max_size=12)), max_size=12))
def test_segments_tokenize_as_the_whole(chatml: LocalTokenizer, pieces: list[str]) -> None:
    text = "".join(pieces)
    segments = chatml.split(text)
    assert "".join(segments) == text
    assert chatml.ids(chatml.completion_parts(text)) == chatml.tokenizer.encode(text).ids


@settings(max_examples=300, deadline=None)
@given(st.sets(st.text(alphabet="ab<|>", min_size=1, max_size=5), min_size=1, max_size=8),
       st.text(alphabet="ab<|>xy", max_size=60))
def test_the_added_token_pattern_matches_as_a_longest_first_alternation(words: set[str], text: str) -> None:
    # Words that are prefixes of others, share prefixes, or overlap in the text: the trie
    # must cut where the tokenizer does (the longest added token at the leftmost place).
    alternation = re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))
    trie = re.compile(longest_first_pattern(words))
    assert [m.span() for m in trie.finditer(text)] == [m.span() for m in alternation.finditer(text)]


def conversation(turns: int, rng: random.Random) -> list[dict]:
    words = "the quick brown fox jumps over lazy dog cache block token prefix".split()
    messages = [{"role": "system", "content": "You are a careful assistant. " * 8}]
    for _ in range(turns):
        messages.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randrange(5, 60)))})
        messages.append({"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(20))})
    return messages[:-1]


@pytest.mark.parametrize("lora, salt", [(None, None), (("a", "/w/a"), None), (None, "tenant-1")])
def test_turn_hashes_resume_earlier_turns_and_equal_hashing_from_scratch(chatml: LocalTokenizer, lora, salt) -> None:
    memo, blocks, rng = TurnHashMemo(), kvhash.BlockHashMemo(), random.Random(3)
    history = conversation(6, rng)
    for turn in range(1, 7):
        parts = chatml.chat_parts({"messages": history[:2 * turn]})
        assert parts is not None
        got = memo.event_hashes(chatml, parts, 16, blocks, seed=kvhash.KV_HASH_SEED, lora=lora, cache_salt=salt)
        ids = chatml.ids(parts)
        want = kvhash.event_hashes(kvhash.block_hashes(ids, 16, seed=kvhash.KV_HASH_SEED, lora=lora, cache_salt=salt))
        assert got == want
    assert memo.resumed == 5 and memo.segments_skipped > 5 * 4  # each turn resumed the last one's chain


def test_completion_hashes_include_the_bos(bos: LocalTokenizer) -> None:
    memo, blocks = TurnHashMemo(), kvhash.BlockHashMemo()
    prompt = "The quick brown fox jumps over the lazy dog. " * 10
    parts = bos.completion_parts(prompt)
    got = memo.event_hashes(bos, parts, 16, blocks, seed=None, lora=None, cache_salt=None)
    ids = bos.ids(parts)
    assert ids[0] == 1
    assert got == kvhash.event_hashes(kvhash.block_hashes(ids, 16))


async def test_the_hasher_uses_the_local_tokenizer_and_falls_back_when_it_fails(
        chatml: LocalTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    hasher = TokenHasher()  # no upstream client: /tokenize answers nothing
    replica = Replica("r1", "m", "http://127.0.0.1:1", engine="vllm")
    hasher.shelf.put("r1", "m", chatml)
    body = {"model": "m", "messages": [{"role": "user", "content": "The quick brown fox jumps. " * 6}]}
    request = RequestInfo("/v1/chat/completions", "m", body=body)
    got = await hasher.hashes(replica, request, 16, None)
    parts = chatml.chat_parts(body)
    assert parts is not None
    assert got == tuple(kvhash.event_hashes(kvhash.block_hashes(chatml.ids(parts), 16, seed=kvhash.KV_HASH_SEED)))
    assert hasher.local == 1

    def broken(segment: str) -> tuple[int, ...]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(chatml, "segment_ids", broken)
    other = RequestInfo("/v1/chat/completions", "m", body={**body, "messages": [{"role": "user", "content": "new"}]})
    assert await hasher.hashes(replica, other, 16, None) is None  # went to /tokenize instead of failing the request
    assert hasher.local == 1
