"""Cluster settings: which keys exist, what they may hold, and dotted edits of a mapping."""

from __future__ import annotations

import pytest

from llmgw.control.settings import SettingError, SettingKey, agent_layer, edit, parse_key, routing_overrides


def test_dotted_keys_name_a_stored_key_and_a_path_below_it() -> None:
    assert parse_key("serving.stopped") == SettingKey("serving.stopped")
    assert parse_key("routing") == SettingKey("routing")
    assert parse_key("routing.policy") == SettingKey("routing", ("policy",))
    assert parse_key("agents.default") == SettingKey("agents.default")
    assert parse_key("agents.default.log_level") == SettingKey("agents.default", ("log_level",))
    assert parse_key("agents.nodes.gpu-7.llamacpp.threads") == SettingKey("agents.nodes.gpu-7", ("llamacpp", "threads"))


@pytest.mark.parametrize("key, words", [
    ("routings.policy", "unknown setting"),
    ("serving.stopped.now", "unknown setting"),
    ("agents.nodes.Bad_Node!", "not a node id"),
    ("agents.default..log_level", "empty part"),
])
def test_unknown_keys_are_refused_with_the_key(key: str, words: str) -> None:
    with pytest.raises(SettingError, match=words):
        parse_key(key)


def test_a_dotted_set_edits_one_entry_and_unset_prunes_what_it_empties() -> None:
    value = edit(None, parse_key("agents.default.log_level"), "debug")
    assert value == {"log_level": "debug"}
    value = edit(value, parse_key("agents.default.llamacpp.threads"), 8)
    assert value == {"log_level": "debug", "llamacpp": {"threads": 8}}
    value = edit(value, parse_key("agents.default.llamacpp.threads"), None, unset=True)
    assert value == {"log_level": "debug"}
    assert edit(value, parse_key("agents.default.log_level"), None, unset=True) is None
    with pytest.raises(SettingError, match="is not set"):
        edit({"log_level": "debug"}, parse_key("agents.default.heartbeat_interval"), None, unset=True)


@pytest.mark.parametrize("key, value, words", [
    ("serving.stopped", "yes", "expected true or false"),
    ("agents.default", ["log_level"], "expected a mapping"),
    ("agents.default.log_level", "loud", r"agents\.default\.log_level: expected one of"),
    ("agents.default.heartbeat_interval", "soon", r"agents\.default\.heartbeat_interval: expected a duration"),
    ("agents.default.bogus", 1, r"agents\.default: unknown key 'bogus'"),
    ("agents.nodes.gpu-7.node_id", "gpu-8", r"agents\.nodes\.gpu-7\.node_id: only the node's own agent\.yaml"),
    ("agents.default.control_planes", ["10.0.0.1:7070"], "only the node's own agent.yaml"),
    ("agents.default.tls", {"cert": "/x"}, "only the node's own agent.yaml"),
    ("routing", "kv", "expected a mapping of server.yaml routing: keys"),
    ("routing.policy", "fastest", r"routing\.policy: expected one of kv, least-load, round-robin"),
    ("routing.unconfirmed_ttl", "soon", r"routing\.unconfirmed_ttl: expected a duration"),
    ("routing.mismatch_alarm_after", 0, r"routing\.mismatch_alarm_after: "),
    ("routing.bogus", 1, r"routing: unknown key 'bogus'"),
    ("routing.load_gate_min", 16, r"routing\.load_gate_min: no longer used"),
])
def test_bad_values_are_refused_with_the_key_path_and_the_reason(key: str, value: object, words: str) -> None:
    with pytest.raises(SettingError, match=words):
        edit(None, parse_key(key), value)


def test_a_node_layer_goes_over_the_default_one_entry_by_entry() -> None:
    stored = {
        "agents.default": {"log_level": "info", "llamacpp": {"threads": 4}, "heartbeat_interval": "2s"},
        "agents.nodes.gpu-7": {"llamacpp": {"threads": 16}},
    }
    assert agent_layer(stored, "gpu-7") == {"log_level": "info", "llamacpp": {"threads": 16}, "heartbeat_interval": "2s"}
    assert agent_layer(stored, "gpu-8") == stored["agents.default"]


def test_the_routing_setting_gives_typed_values_of_only_the_keys_it_names() -> None:
    value = edit(None, parse_key("routing.policy"), "round-robin")
    value = edit(value, parse_key("routing.tokenize_timeout"), "250ms")
    assert routing_overrides(value) == {"policy": "round-robin", "tokenize_timeout": 0.25}
    assert edit(value, parse_key("routing"), None, unset=True) is None
