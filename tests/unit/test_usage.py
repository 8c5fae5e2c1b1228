"""Reading usage from answers and streams, and adding it up."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from llmgw.router.usage import StreamUsage, Usage, UsageCounts, UsageMeter, usage_from_body


def event(value: object) -> bytes:
    return b"data: " + json.dumps(value).encode() + b"\n\n"


CHUNKS = [
    event({"choices": [{"delta": {"content": "a"}}]}),
    event({"choices": [{"delta": {"content": "b"}}], "usage": None}),
    event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}),
    b"data: [DONE]\n\n",
]
STREAM = b"".join(CHUNKS)


def test_usage_from_body() -> None:
    body = json.dumps({"id": "x", "choices": [{"message": {"content": 'say "usage": {'}}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    assert usage_from_body(body) == Usage(3, 4)
    assert usage_from_body(b'{"usage": {"prompt_tokens": 2, "total_tokens": 2}, "data": []}') == Usage(2, 0)
    assert usage_from_body(b'{"choices": []}') is None
    # the engine's own count of prompt tokens found in its prefix cache (vLLM, the simulator)
    assert usage_from_body(b'{"usage": {"prompt_tokens": 40, "completion_tokens": 1, '
                           b'"prompt_tokens_details": {"cached_tokens": 32}}}') == Usage(40, 1, 32, True)
    assert usage_from_body(b'{"usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 0}}}') == Usage(
        40, 0, 0, cached_reported=True)  # said it found nothing
    assert usage_from_body(b'{"usage": {"prompt_tokens": 40, "prompt_tokens_details": null}}') == Usage(40, 0, 0)
    assert usage_from_body(b'{"usage": {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": -1}}}') == Usage(4)
    assert usage_from_body(b'{"usage": null}') is None
    assert usage_from_body(b"not json \"usage\": {") is None
    assert usage_from_body(b'{"usage": {"prompt_tokens": -1, "completion_tokens": "x"}}') == Usage(0, 0)


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=12, unique=True))
def test_stream_split_anywhere_strips_the_usage_chunk(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    pieces = [STREAM[a:b] for a, b in zip(bounds, bounds[1:])]
    for strip in (True, False):
        watch = StreamUsage(strip=strip)
        out = b"".join(watch.feed(p) for p in pieces) + watch.flush()
        assert watch.usage == Usage(5, 2)
        expected = STREAM if not strip else b"".join(CHUNKS[:2] + CHUNKS[3:])
        assert out == expected


def test_complete_events_pass_at_once_and_a_broken_tail_is_flushed() -> None:
    watch = StreamUsage(strip=True)
    assert watch.feed(CHUNKS[0]) == CHUNKS[0]
    assert watch.feed(b"data: {\"cho") == b""
    assert watch.flush() == b"data: {\"cho"
    # A usage object on a chunk that still carries choices is kept (and counted).
    mixed = event({"choices": [{"delta": {}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    assert watch.feed(mixed) == mixed and watch.usage == Usage(1, 1)


def test_meter_drain_restore_pending() -> None:
    meter = UsageMeter()
    meter.record("t", "m", Usage(3, 4))
    meter.record("t", "m", None)
    meter.record("u", "m", Usage(1, 0))
    assert meter.pending()[("t", "m")] == UsageCounts(2, 3, 4)
    drained = meter.drain()
    assert drained.marks == {} and meter.pending() == {}
    meter.record("t", "m", Usage(1, 1))
    meter.restore(drained)
    assert meter.pending() == {("t", "m"): UsageCounts(3, 4, 5), ("u", "m"): UsageCounts(1, 1, 0)}
