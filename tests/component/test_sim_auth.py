"""The simulated engine's secret: like vLLM's and llama-server's ``--api-key``, every route but
/health needs ``Authorization: Bearer <secret>``, and a refusal is a 401 in OpenAI's shape."""

from __future__ import annotations

import httpx
import pytest

from llmgw.sim import SimConfig, serve
from llmgw.sim.api import OPEN_PATHS, ROUTES
from llmgw.sim.config import API_KEY_ENV, parse_args

MODEL = "auth"
KEY = "engine-secret-0123456789"


def test_the_secret_comes_from_the_environment_never_the_command_line() -> None:
    cfg = parse_args(["--model", MODEL], environ={API_KEY_ENV: KEY})
    assert cfg.api_key == KEY and KEY not in repr(cfg)
    assert parse_args(["--model", MODEL], environ={}).api_key == ""
    with pytest.raises(SystemExit):
        parse_args(["--model", MODEL, "--api-key", KEY], environ={})


async def test_every_route_but_health_needs_the_secret(nursery) -> None:  # type: ignore[no-untyped-def]
    _, port = await nursery.start(serve, SimConfig(model=MODEL, port=0, api_key=KEY))
    good = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as client:
        for path, (method, _) in sorted(ROUTES.items()):
            if path in OPEN_PATHS:
                continue
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
                r = await client.request(method, path, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.json()["error"]["type"] == "invalid_request_error"
                assert KEY not in r.text
        assert (await client.get("/nowhere")).status_code == 401  # not even a 404 for strangers
        assert (await client.get("/health")).status_code == 200
        r = await client.post("/v1/completions", headers=good, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert (await client.get("/v1/models", headers={"authorization": f"bearer {KEY}"})).status_code == 200
        assert (await client.post("/tokenize", headers=good, json={"model": MODEL, "prompt": "hi"})).status_code == 200
        assert (await client.get("/metrics", headers=good)).status_code == 200
        assert (await client.get("/nowhere", headers=good)).status_code == 404


async def test_without_a_secret_the_engine_answers_anyone(nursery) -> None:  # type: ignore[no-untyped-def]
    _, port = await nursery.start(serve, SimConfig(model=MODEL, port=0))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
