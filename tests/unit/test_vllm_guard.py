"""The middleware that makes every vLLM path but its liveness checks need the shard's secret
(vLLM's own VLLM_API_KEY check covers /v1, /v2, /inference and /cohere only), and how the
agent wires it in: ``--middleware`` on the command line, the secret and the module's directory
in the environment."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from llmgw.node.engines.vllm import GUARD_MIDDLEWARE, GUARD_PATH, vllm_argv, vllm_env
from llmgw.node.engine_secret import secret_env
from llmgw.spec import ShardSpec

sys.path.insert(0, GUARD_PATH)  # as vLLM's interpreter finds it
import llmgw_vllm_guard  # noqa: E402
sys.path.remove(GUARD_PATH)

KEY = "shard-secret-123"


class App:
    """The wrapped app: records what reached it."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.paths.append(scope.get("path") or scope["type"])
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})


async def call(guard: llmgw_vllm_guard.Guard, path: str, *headers: tuple[bytes, bytes],
               method: str = "POST", kind: str = "http") -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await guard({"type": kind, "method": method, "path": path, "headers": list(headers)}, receive, send)
    return sent


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> tuple[llmgw_vllm_guard.Guard, App]:
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    app = App()
    return llmgw_vllm_guard.Guard(app), app


@pytest.mark.parametrize("path", ["/invocations", "/tokenize", "/pooling", "/v1/completions", "/metrics", "/anything"])
async def test_every_path_but_liveness_needs_the_secret(guarded: tuple[llmgw_vllm_guard.Guard, App], path: str) -> None:
    guard, app = guarded
    for headers in ((), ((b"authorization", b"Bearer wrong"),), ((b"authorization", KEY.encode()),),
                    ((b"authorization", b"Basic " + KEY.encode()),)):
        start, body = await call(guard, path, *headers)
        assert start["status"] == 401 and b"invalid_api_key" in body["body"] and KEY.encode() not in body["body"]
    assert app.paths == []
    assert (await call(guard, path, (b"authorization", f"Bearer {KEY}".encode())))[0]["status"] == 200
    assert (await call(guard, path, (b"Authorization", f"bearer {KEY}".encode())))[0]["status"] == 200
    assert app.paths == [path, path]


async def test_liveness_preflights_and_lifespan_pass(guarded: tuple[llmgw_vllm_guard.Guard, App]) -> None:
    guard, app = guarded
    assert (await call(guard, "/health", method="GET"))[0]["status"] == 200
    assert (await call(guard, "/ping", method="GET"))[0]["status"] == 200
    assert (await call(guard, "/v1/completions", method="OPTIONS"))[0]["status"] == 200
    assert await call(guard, "", kind="lifespan") == []
    assert app.paths == ["/health", "/ping", "/v1/completions", "lifespan"]


async def test_a_websocket_without_the_secret_is_closed(guarded: tuple[llmgw_vllm_guard.Guard, App]) -> None:
    guard, app = guarded
    assert await call(guard, "/v1/realtime", kind="websocket") == [{"type": "websocket.close", "code": 1008}]
    assert app.paths == []


async def test_without_a_secret_everything_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    app = App()
    assert (await call(llmgw_vllm_guard.Guard(app), "/invocations"))[0]["status"] == 200


def test_the_agent_adds_the_guard_and_hands_the_secret_over_in_the_environment() -> None:
    spec = ShardSpec(id="v", model="m", engine="vllm", source="/w/m", api_key=KEY)
    argv = vllm_argv("py", spec, "h", 1)
    assert argv[argv.index("--middleware") + 1] == GUARD_MIDDLEWARE and KEY not in " ".join(argv)
    env = {**vllm_env(spec), **secret_env(spec)}
    assert env["VLLM_API_KEY"] == KEY and env["PYTHONPATH"] == GUARD_PATH
    modules = sorted(n for n in os.listdir(GUARD_PATH) if n != "__pycache__")
    assert modules == ["llmgw_sglang_launch.py", "llmgw_undumpable.py", "llmgw_vllm_guard.py"]  # stdlib only
    for module in modules:  # they run in vLLM's and SGLang's Python: no llmgw package there
        assert not re.search(r"(import|from) llmgw\b(?!_)", Path(GUARD_PATH, module).read_text()), module
    keyless = ShardSpec(id="v", model="m", engine="vllm", source="/w/m")
    assert "--middleware" not in vllm_argv("py", keyless, "h", 1) and "PYTHONPATH" not in vllm_env(keyless)
