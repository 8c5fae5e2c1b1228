"""Tokenize request bodies and the hashing of given token ids (no engine needed)."""

from __future__ import annotations

from llmgw.router.replicas import Replica, RequestInfo
from llmgw.router.tokens import TokenHasher, cache_salt, token_ids_given, tokenize_request

R = Replica("r", "m", "http://127.0.0.1:1")


def test_tokenize_request_bodies() -> None:
    chat = RequestInfo("/v1/chat/completions", "m", body={"messages": [{"role": "user", "content": "hi"}],
                                                         "tools": [], "temperature": 1})
    assert tokenize_request(chat, "m") == (
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":true,"tools":[]}')
    comp = RequestInfo("/v1/completions", "m", body={"prompt": ["once"]})
    assert tokenize_request(comp, "m") == b'{"model":"m","prompt":"once"}'
    assert tokenize_request(RequestInfo("/v1/embeddings", "m", body={"input": "x"}), "m") is None
    assert tokenize_request(RequestInfo("/v1/chat/completions", "m", body={"messages": []}), "m") is None
    assert tokenize_request(RequestInfo("/v1/completions", "m", body={"prompt": ["a", "b"]}), "m") is None


def test_token_ids_and_salt() -> None:
    assert token_ids_given(RequestInfo("/v1/completions", "m", body={"prompt": [1, 2, 3]})) == [1, 2, 3]
    assert token_ids_given(RequestInfo("/v1/completions", "m", body={"prompt": [[4, 5]]})) == [4, 5]
    assert token_ids_given(RequestInfo("/v1/completions", "m", body={"prompt": [1, True]})) is None
    assert cache_salt({"cache_salt": "t"}) == "t" and cache_salt({"cache_salt": ""}) is None


async def test_given_ids_hash_like_vllm_and_are_cached() -> None:
    hasher = TokenHasher(seed="0")  # no client: only given ids can be hashed
    request = RequestInfo("/v1/completions", "m", body={"prompt": list(range(1, 33)) + [7]})
    # vLLM 0.32 with PYTHONHASHSEED=0, block size 16, tokens 1..32 (shared/reference/vllm.md)
    assert await hasher.hashes(R, request, 16, None) == (3236607068019569386, 2758186210834249151)
    assert await hasher.hashes(R, request, 16, None) is not None and hasher.cache_hits == 1
    salted = RequestInfo("/v1/completions", "m", body={"prompt": list(range(1, 33)), "cache_salt": "tenant-A"})
    assert (await hasher.hashes(R, salted, 16, None))[0] != 3236607068019569386


async def test_no_client_means_no_tokens() -> None:
    hasher = TokenHasher()
    chat = RequestInfo("/v1/chat/completions", "m", body={"messages": [{"role": "user", "content": "hi"}]})
    assert await hasher.hashes(R, chat, 16, None) is None
