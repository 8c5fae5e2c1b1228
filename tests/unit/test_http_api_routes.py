"""Which /api/v1/* paths and methods the admin API answers, and what it says for the rest."""

from __future__ import annotations

import pytest

from llmgw.control import http_api
from llmgw.router.admin_api import ApiResponse


@pytest.mark.parametrize("method, path, action, key", [
    ("GET", "status", http_api._status, ""),
    ("GET", "replicas/", http_api._replicas, ""),
    ("GET", "settings", http_api._settings, ""),
    ("GET", "settings/routing.policy", http_api._settings, "routing.policy"),
    ("GET", "settings/agents.default/history", http_api._history, "agents.default"),
    ("PUT", "settings/routing.policy", http_api._set, "routing.policy"),
    ("DELETE", "settings/routing", http_api._unset, "routing"),
    ("POST", "stop", http_api._stop, ""),
])
def test_routes_name_an_action_and_a_key(method: str, path: str, action: object, key: str) -> None:
    assert http_api.route(method, path) == (action, key)


@pytest.mark.parametrize("method, path, status, words", [
    ("GET", "bogus", 404, "no admin API route /api/v1/bogus"),
    ("GET", "status/extra", 404, "no admin API route"),
    ("POST", "models", 405, "/api/v1/models answers GET, not POST"),
    ("GET", "stop", 405, "answers POST"),
    ("PUT", "settings", 404, "needs a key"),
])
def test_other_paths_and_methods_are_answered_with_the_reason(method: str, path: str, status: int, words: str) -> None:
    answer = http_api.route(method, path)
    assert isinstance(answer, ApiResponse) and answer.status == status
    assert words in answer.payload["error"]["message"]
