"""The simulated engine refuses request fields vLLM refuses (400, OpenAI's shape, the field named) and takes
what vLLM's lax parsing takes; values it quotes back are bounded."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

from llmgw.sim.echo import MAX_ECHO_CHARS
from llmgw.sim.launch import start_sim

MODEL = "sim-model"
TIMEOUT = 10.0

#: (field, value) that vLLM answers with 400 naming the field.
REFUSED = [
    ("temperature", "x"), ("temperature", -0.5), ("temperature", [1]), ("temperature", {"a": 1}),
    ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5), ("min_p", 2),
    ("presence_penalty", 3), ("frequency_penalty", -2.5), ("repetition_penalty", 0),
    ("n", 0), ("n", "x"), ("max_tokens", 0), ("max_tokens", "x"), ("max_completion_tokens", -1),
    ("seed", "x"), ("stream", "maybe"), ("stream", 2), ("stop", 7), ("stop", [1]),
    ("messages", "hi"), ("messages", [{"content": "no role"}]),
]
#: (field, value) that vLLM's lax parsing accepts.
ACCEPTED = [
    ("temperature", 0), ("temperature", "0.7"), ("temperature", True), ("top_p", 1), ("top_k", -1), ("top_k", 0), ("top_k", 40),
    ("min_p", 0), ("presence_penalty", -2), ("frequency_penalty", 2), ("repetition_penalty", 1.1),
    ("seed", 3), ("stream", False), ("stream", None), ("stop", ["a", "b"]), ("max_tokens", 3),
]


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with start_sim(["--port", "0", "--model", MODEL, "--max-model-len", "512"]) as proc:
        with httpx.Client(base_url=proc.url, timeout=TIMEOUT) as client:
            yield client


def chat(field: str, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body[field] = value
    return body


@pytest.mark.parametrize(("field", "value"), REFUSED, ids=lambda v: repr(v))
def test_refused_fields_are_400_naming_the_field(http: httpx.Client, field: str, value: Any) -> None:
    response = http.post("/v1/chat/completions", json=chat(field, value))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    assert error["param"] == field and error["type"] == "BadRequestError"
    if field not in ("messages", "stop"):
        assert field in error["message"]


@pytest.mark.parametrize(("field", "value"), ACCEPTED, ids=lambda v: repr(v))
def test_accepted_fields_are_served(http: httpx.Client, field: str, value: Any) -> None:
    response = http.post("/v1/chat/completions", json=chat(field, value))
    assert response.status_code == 200, response.text


def test_a_lax_stream_flag_streams(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=chat("stream", "true"))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize(("field", "value"), [("model", "m" * 1_000_000), ("temperature", "t" * 1_000_000)])
def test_echoed_values_are_bounded(http: httpx.Client, field: str, value: str) -> None:
    response = http.post("/v1/chat/completions", json=chat(field, value))
    assert response.status_code in (400, 404)
    assert len(response.json()["error"]["message"]) < MAX_ECHO_CHARS + 200
