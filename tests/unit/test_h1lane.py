"""Which requests the fast lane takes (llmgw.router.http.h1lane.parse_simple_request), and how it reads them."""

from __future__ import annotations

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.router.http.h1lane import parse_simple_request

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


# -- differential: whatever the lane takes, h11 reads the same way ---------------------------

_TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Mostly names and values a client sends (three draws in four), else anything.
_known_names = st.sampled_from(["Host", "content-length", "content-type", "connection", "expect", "transfer-encoding",
                                "upgrade", "x-request-id", "authorization", "te", "accept", "user-agent"])
_names = st.one_of(_known_names, _known_names, _known_names,
                   st.text(alphabet=_TOKEN_CHARS + " :\t", min_size=0, max_size=12))
_known_values = st.sampled_from(["x", "2", " 2 ", "keep-alive", "close", "chunked", "100-continue", "", "Bearer k",
                                 "-1", "02", "\tapplication/json ", "caf\xe9"])
_values = st.one_of(_known_values, _known_values, _known_values,
                    st.binary(max_size=12).map(lambda b: b.decode("latin-1")))
_good_lines = st.sampled_from(["POST /v1/chat/completions HTTP/1.1", "GET /v1/models HTTP/1.1",
                               "POST /a%20b?x=1 HTTP/1.1", "PUT /x HTTP/1.1"])
_lines = st.one_of(_good_lines, _good_lines, _good_lines,
                   st.sampled_from(["HEAD / HTTP/1.1", "POST / HTTP/1.0", "post / HTTP/1.1", "POST  / HTTP/1.1",
                                    "POST / HTTP/1.1 ", "POST http://x/ HTTP/1.1"]))


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    line = draw(_lines)
    headers = draw(st.lists(st.tuples(_names, _values), max_size=3))
    if draw(st.integers(0, 3)):
        headers.insert(draw(st.integers(0, len(headers))), ("Host", "gw"))
    body = draw(st.binary(max_size=8))
    if draw(st.integers(0, 3)):
        headers.append(("Content-Length", str(len(body))))
    sep = draw(st.sampled_from(["\r\n"] * 5 + ["\n"]))
    head = sep.join([line, *(f"{n}:{v}" for n, v in headers)]) + "\r\n\r\n"
    return head.encode("latin-1") + body + draw(st.binary(max_size=4))


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_requests())
def test_what_the_lane_takes_h11_reads_the_same_way(data: bytes) -> None:
    request = parse_simple_request(data, MAX_HEAD)
    if request is None:
        return  # h11's to judge, as before the lane existed
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(data[:request.size])
    event = connection.next_event()  # raises RemoteProtocolError if h11 would have refused it
    assert isinstance(event, h11.Request)
    assert event.method.decode() == request.method
    assert event.target == request.target
    assert list(event.headers) == request.headers
    body = b""
    while True:
        event = connection.next_event()
        if isinstance(event, h11.Data):
            body += event.data
        else:
            break
    assert isinstance(event, h11.EndOfMessage), event
    assert body == request.body
