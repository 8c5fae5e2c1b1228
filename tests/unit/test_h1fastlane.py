"""Which requests the fast lane takes (llmgw.router.h1fastlane.parse_simple_request), and how it reads them."""

from __future__ import annotations

import pytest

from llmgw.router.h1fastlane import parse_simple_request

MAX_HEAD = 16 * 1024


def _post(headers: bytes = b"host: x\r\ncontent-length: 2\r\n", body: bytes = b"{}", line: bytes = b"POST /v1/chat/completions HTTP/1.1") -> bytes:
    return line + b"\r\n" + headers + b"\r\n" + body


def test_a_simple_post_is_parsed_with_lower_case_names_and_stripped_values() -> None:
    data = _post(b"Host: gw:8080\r\nContent-Length:  2 \r\nX-Request-Id:\tabc\t\r\nX-Empty:\r\n")
    request = parse_simple_request(data, MAX_HEAD)
    assert request is not None
    assert request.method == "POST"
    assert request.target == b"/v1/chat/completions"
    assert request.headers == [(b"host", b"gw:8080"), (b"content-length", b"2"), (b"x-request-id", b"abc"),
                               (b"x-empty", b"")]
    assert request.body == b"{}"
    assert request.size == len(data)


def test_pipelined_requests_are_taken_one_at_a_time() -> None:
    first = _post(body=b"{}")
    second = _post(b"host: x\r\ncontent-length: 3\r\n", b"[1]")
    request = parse_simple_request(first + second, MAX_HEAD)
    assert request is not None and request.size == len(first) and request.body == b"{}"
    rest = (first + second)[request.size:]
    again = parse_simple_request(rest, MAX_HEAD)
    assert again is not None and again.body == b"[1]" and again.size == len(rest)


def test_a_get_without_body_and_a_query_and_keep_alive() -> None:
    data = b"GET /v1/models?x=1 HTTP/1.1\r\nhost: x\r\nconnection: Keep-Alive\r\n\r\n"
    request = parse_simple_request(data, MAX_HEAD)
    assert request is not None
    assert (request.method, request.target, request.body, request.size) == ("GET", b"/v1/models?x=1", b"", len(data))


@pytest.mark.parametrize("data", [
    pytest.param(_post()[:20], id="head incomplete"),
    pytest.param(_post()[:-1], id="body incomplete"),
    pytest.param(_post(line=b"HEAD / HTTP/1.1"), id="HEAD"),
    pytest.param(_post(line=b"CONNECT x:1 HTTP/1.1"), id="CONNECT"),
    pytest.param(_post(line=b"POST / HTTP/1.0"), id="HTTP/1.0"),
    pytest.param(_post(line=b"POST http://x/ HTTP/1.1"), id="absolute target"),
    pytest.param(_post(line=b"POST /a b HTTP/1.1"), id="space in target"),
    pytest.param(_post(line=b"post / HTTP/1.1"), id="lower-case method"),
    pytest.param(_post(b"host: x\r\ntransfer-encoding: chunked\r\n", b"2\r\n{}\r\n0\r\n\r\n"), id="chunked"),
    pytest.param(_post(b"host: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n"), id="expect"),
    pytest.param(_post(b"host: x\r\ncontent-length: 2\r\nupgrade: h2c\r\n"), id="upgrade"),
    pytest.param(_post(b"host: x\r\ncontent-length: 2\r\nconnection: close\r\n"), id="connection close"),
    pytest.param(_post(b"host: x\r\ncontent-length: 2\r\ncontent-length: 2\r\n"), id="two content-lengths"),
    pytest.param(_post(b"host: x\r\ncontent-length: -2\r\n"), id="negative content-length"),
    pytest.param(_post(b"host: x\r\ncontent-length: 0x2\r\n"), id="hex content-length"),
    pytest.param(_post(b"host: x\r\ncontent-length: %s\r\n" % (b"9" * 16)), id="huge content-length"),
    pytest.param(_post(b"content-length: 2\r\n"), id="no host"),
    pytest.param(_post(b"host: x\r\nhost: y\r\ncontent-length: 2\r\n"), id="two hosts"),
    pytest.param(_post(b"host: x\r\ncontent-length: 2\r\nx-a: 1\r\n folded\r\n"), id="obs-fold"),
    pytest.param(_post(b"host: x\r\ncontent-length: 2\r\nbad name: 1\r\n"), id="space in name"),
    pytest.param(_post(b"host: x\r\ncontent-length: 2\r\n: 1\r\n"), id="empty name"),
    pytest.param(_post(b"host: x\r\ncontent-length: 2\r\nx-a: 1\x002\r\n"), id="NUL in value"),
    pytest.param(_post(b"host: x\r\ncontent-length: 2\r\nx-a: 1\r2\r\n"), id="lone CR in value"),
    pytest.param(_post(b"host: x\r\ncontent-length: 2\r\nx-a: 1\n2\r\n"), id="lone LF"),
    pytest.param(_post(b"host: x\r\ncontent-length: 2\r\nnovalue\r\n"), id="no colon"),
    pytest.param(b"\r\n" + _post(), id="leading blank line"),
    pytest.param(_post(b""), id="no headers"),
])
def test_anything_not_simple_is_left_to_h11(data: bytes) -> None:
    assert parse_simple_request(data, MAX_HEAD) is None


def test_a_head_longer_than_the_limit_is_left_to_h11() -> None:
    data = _post(b"host: x\r\ncontent-length: 2\r\nx-big: %s\r\n" % (b"a" * 200))
    assert parse_simple_request(data, 100) is None
    assert parse_simple_request(data, 1000) is not None
