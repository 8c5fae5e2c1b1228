"""server.yaml `routing:`: defaults, values, refusals, docs."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from llmgw.config import ConfigError, RoutingConfig, load_server_config


def load(tmp_path: Path, text: str) -> RoutingConfig:
    path = tmp_path / "server.yaml"
    path.write_text(text)
    return load_server_config(path).routing


def test_defaults_and_values(tmp_path: Path) -> None:
    assert load(tmp_path, "") == RoutingConfig()
    assert RoutingConfig().policy == "kv"
    config = load(tmp_path, "routing:\n  policy: least-load\n"
                            "  unconfirmed_ttl: 500ms\n  tokenize_timeout: 1s\n  agreement_window: 30\n"
                            "  mismatch_alarm_after: 5\n")
    assert config == RoutingConfig("least-load", 0.5, 1.0, 30.0, 5)


def test_the_retired_load_gate_keys_start_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = load(tmp_path, "routing:\n  load_gate_min: 4\n  load_gate_share: 0.25\n")
    assert config == RoutingConfig()
    warned = [r.getMessage() for r in caplog.records if "no longer used" in r.getMessage()]
    assert len(warned) == 2 and "routing.load_gate_min" in warned[0] and "remove it" in warned[0]


@pytest.mark.parametrize("text, message", [
    ("routing:\n  policy: random\n", "routing.policy: expected one of kv, least-load, round-robin"),
    ("routing:\n  mismatch_alarm_after: 0\n", "routing.mismatch_alarm_after"),
    ("routing:\n  polcy: kv\n", "polcy"),
])
def test_refusals_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load(tmp_path, text)


def test_docs_list_every_routing_key() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    missing = [f"routing.{f.name}" for f in attrs.fields(RoutingConfig) if f"| `routing.{f.name}` |" not in docs]
    assert not missing, f"docs/config.md does not document {missing}"
