"""bench/drills.py counts every request's end by what the client saw (the figures rest on it),
and sums its rounds into medians and totals. Driven through httpx's mock transport: no
process, no socket."""

from __future__ import annotations

import json
from typing import Callable

import httpx

from bench.drills import Load, Workload, one_request, summarize

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def client(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url="http://gateway", transport=httpx.MockTransport(handler))


async def one(kind: str, handler: Callable[[httpx.Request], httpx.Response], load: Load | None = None) -> tuple[str, Load]:
    load = load or Load()
    async with client(handler) as http:
        return await one_request(http, kind, Workload(clients=1), load), load


async def test_each_way_a_request_ends_is_its_own_kind() -> None:
    chunk = {"choices": [{"delta": {"content": "x"}}]}
    error = {"error": {"code": "server_shutting_down", "message": "shutting down"}}
    cases = {
        "plain": (httpx.Response(200, json={"usage": USAGE}), "ok"),
        "stream": (httpx.Response(200, content=sse(chunk, {"choices": [], "usage": USAGE}, "[DONE]")), "ok"),
        "long": (httpx.Response(200, content=sse(chunk, error)), "stream_error"),
    }
    for kind, (response, expected) in cases.items():
        assert (await one(kind, lambda _r, response=response: response))[0] == expected, kind
    assert (await one("stream", lambda _r: httpx.Response(200, content=sse(chunk))))[0] == "cut_bare"
    assert (await one("plain", lambda _r: httpx.Response(503, json={"error": {}})))[0] == "status_503"

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    def drop(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    assert (await one("plain", refuse))[0] == "refused"
    assert (await one("plain", drop))[0] == "no_response"


async def test_usage_and_counts_add_up_by_request_type() -> None:
    load = Load()
    await one("plain", lambda _r: httpx.Response(200, json={"usage": USAGE}), load)
    await one("stream", lambda _r: httpx.Response(200, content=sse({"choices": [], "usage": USAGE}, "[DONE]")), load)
    await one("plain", lambda _r: httpx.Response(502, json={}), load)
    figures = load.figures()
    assert (figures["total"], figures["ok"], figures["failed"]) == (3, 2, 1)
    assert figures["by_request"] == {"plain": {"ok": 1, "status_502": 1}, "stream": {"ok": 1}}
    assert (load.answered, load.prompt_tokens, load.completion_tokens, load.in_flight) == (2, 10, 4, 0)
    assert list(figures["failure_samples"]) == ["status_502"]


def test_rounds_sum_into_medians_and_totals() -> None:
    rounds = [
        {"recovery_s": 1.0, "elapsed_s": 9.0, "requests": {"total": 10, "failed": 0}},
        {"recovery_s": 3.0, "elapsed_s": 9.0, "requests": {"total": 20, "failed": 2}},
        {"recovery_s": 2.0, "elapsed_s": 9.0, "requests": {"total": 30, "failed": 1}},
        {"error": "AssertionError: timed out", "elapsed_s": 60.0},
    ]
    report = summarize(rounds)
    assert report["median_s"] == {"recovery_s": 2.0}
    assert (report["requests_total"], report["requests_failed"]) == (60, 3)
    assert report["errors"] == ["AssertionError: timed out"]
