"""ChunkedDecoder: an HTTP/1.1 chunked body decoded whole however the wire splits it."""

from __future__ import annotations

import random

import httpx
import pytest

from llmgw.router.http.upstream_pool import MAX_CHUNK_LINE_BYTES, ChunkedDecoder

PAYLOADS = [b"data: {\"a\": 1}\n\n", b"x" * 300, b"\r\n\r\n", b"0\r\n", b"data: [DONE]\n\n"]


def encode(payloads: list[bytes], *, extensions: bool = False, trailers: bytes = b"") -> bytes:
    parts = []
    for payload in payloads:
        size = b"%x" % len(payload)
        parts.append(size + (b";name=value" if extensions else b"") + b"\r\n" + payload + b"\r\n")
    return b"".join(parts) + b"0\r\n" + trailers + b"\r\n"


def decode(pieces: list[bytes]) -> tuple[bytes, ChunkedDecoder]:
    decoder = ChunkedDecoder()
    out = []
    for piece in pieces:
        assert not decoder.ended
        out.append(decoder.feed(piece))
    return b"".join(out), decoder


@pytest.mark.parametrize("extensions", [False, True])
@pytest.mark.parametrize("trailers", [b"", b"x-usage: 3\r\nx-more: 4\r\n"])
def test_every_split_point_decodes_the_same(extensions: bool, trailers: bytes) -> None:
    wire = encode(PAYLOADS, extensions=extensions, trailers=trailers) + b"NEXT"
    body_end = len(wire) - len(b"NEXT")
    for cut in range(1, body_end):
        payload, decoder = decode([wire[:cut], wire[cut:]])
        assert payload == b"".join(PAYLOADS), cut
        assert decoder.ended and decoder.rest == b"NEXT"


def test_byte_by_byte_and_random_splits() -> None:
    wire = encode(PAYLOADS)
    payload, decoder = decode([wire[i:i + 1] for i in range(len(wire))])
    assert payload == b"".join(PAYLOADS) and decoder.ended and decoder.rest == b""
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(wire)), 5))
        pieces = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)])]
        payload, decoder = decode(pieces)
        assert payload == b"".join(PAYLOADS) and decoder.ended


def test_one_chunk_per_read_is_returned_as_it_came() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"5\r\nhello\r\n") == b"hello"
    assert decoder.feed(b"1\r\n!\r\n") == b"!"
    assert decoder.feed(b"0\r\n") == b"" and not decoder.ended
    assert decoder.feed(b"\r\n") == b"" and decoder.ended


@pytest.mark.parametrize("wire, message", [
    (b"zz\r\nhello\r\n", "invalid chunk size"),
    (b"-5\r\nhello\r\n", "negative chunk size"),
    (b"5\r\nhelloXX", "without its closing CRLF"),
    (b"f" * (MAX_CHUNK_LINE_BYTES + 1), "over-long chunk-size line"),
])
def test_invalid_framing_is_refused(wire: bytes, message: str) -> None:
    with pytest.raises(httpx.RemoteProtocolError, match=message):
        ChunkedDecoder().feed(wire)
