"""A stream's request body is sent asking for the usage chunk: spliced in where it can be,
serialized again where it cannot, and left alone when the client asked itself."""

from __future__ import annotations

import json

import pytest

from llmgw.router.app import _ask_for_usage

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi \u00e9\u4e16"}], "stream": True}


@pytest.mark.parametrize("body", [
    json.dumps(CHAT).encode(),
    b" \r\n\t" + json.dumps(CHAT, ensure_ascii=False, indent=2).encode(),
    json.dumps(CHAT, separators=(",", ":")).encode() + b"\n",
])
def test_a_body_without_stream_options_gets_the_member_first_and_keeps_the_rest_byte_for_byte(body: bytes) -> None:
    sent, strip = _ask_for_usage(json.loads(body), body)
    assert strip
    assert json.loads(sent) == {**CHAT, "stream_options": {"include_usage": True}}
    start = body.index(b"{") + 1
    assert sent[:start] == body[:start] and sent.endswith(body[start:])


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-8-sig"])
def test_a_body_in_another_encoding_or_with_a_bom_is_serialized_again(encoding: str) -> None:
    body = json.dumps(CHAT).encode(encoding)
    sent, strip = _ask_for_usage(json.loads(body), body)
    assert strip
    assert json.loads(sent) == {**CHAT, "stream_options": {"include_usage": True}}
    assert sent.startswith(b"{")


def test_other_stream_options_are_kept_and_include_usage_set() -> None:
    parsed = {**CHAT, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    body = json.dumps(parsed).encode()
    sent, strip = _ask_for_usage(parsed, body)
    assert strip
    assert json.loads(sent)["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert sent.count(b"stream_options") == 1


def test_a_client_that_asked_for_usage_gets_its_body_sent_unchanged_and_the_chunk() -> None:
    parsed = {**CHAT, "stream_options": {"include_usage": True}}
    body = json.dumps(parsed).encode()
    assert _ask_for_usage(parsed, body) == (body, False)
