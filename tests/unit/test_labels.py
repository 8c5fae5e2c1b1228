"""Node labels (llmgw/labels.py) and a node token's overrides (llmgw.jointoken.NodeOverrides)."""

from __future__ import annotations

import pytest

from llmgw import labels
from llmgw.jointoken import NodeOverrides


def test_pairs_parse_from_repeated_and_comma_separated_items_and_print_back_sorted() -> None:
    parsed = labels.parse_pairs(["rack=r1,gpu=a100", "example.com/zone=eu-1", "empty="])
    assert parsed == {"empty": "", "example.com/zone": "eu-1", "gpu": "a100", "rack": "r1"}
    assert list(parsed) == sorted(parsed)
    assert labels.to_pairs(parsed) == ["empty=", "example.com/zone=eu-1", "gpu=a100", "rack=r1"]
    assert labels.parse_pairs(labels.to_pairs(parsed)) == parsed
    assert labels.describe(parsed) == "empty=,example.com/zone=eu-1,gpu=a100,rack=r1"
    assert labels.describe({}) == "-"


@pytest.mark.parametrize("items, reason", [
    (["rack"], "'rack' is not key=value"),
    (["rack=r1", "rack=r2"], "label rack is given twice"),
    (["-rack=r1"], "'-rack' cannot be a label key"),
    (["rack=r 1"], "label rack: 'r 1' cannot be a label value"),
    ([f"k{i}=v" for i in range(labels.MAX_LABELS + 1)], f"at most {labels.MAX_LABELS} labels"),
    (["k=" + "v" * 64], "cannot be a label value"),
])
def test_bad_pairs_are_refused_with_the_reason(items: list[str], reason: str) -> None:
    with pytest.raises(ValueError, match=reason.replace("(", r"\(")):
        labels.parse_pairs(items)


def test_check_labels_takes_yaml_scalars_as_text_but_not_lists_or_booleans() -> None:
    assert labels.check_labels({"tier": 2}) == {"tier": "2"}
    with pytest.raises(ValueError, match="expected a text value"):
        labels.check_labels({"tier": True})
    with pytest.raises(ValueError, match="expected a text value"):
        labels.check_labels({"tier": ["a"]})
    with pytest.raises(ValueError, match="expected a mapping"):
        labels.check_labels(["tier=a"])  # type: ignore[arg-type]


def test_a_node_matches_when_it_carries_every_wanted_label_with_the_same_value() -> None:
    node = {"rack": "r1", "gpu": "a100"}
    assert labels.matches(node, {})
    assert labels.matches(node, {"rack": "r1"})
    assert labels.matches(node, {"rack": "r1", "gpu": "a100"})
    assert not labels.matches(node, {"rack": "r2"})
    assert not labels.matches(node, {"rack": "r1", "zone": "eu"})


def test_node_overrides_round_trip_through_the_store_and_write_only_what_is_set() -> None:
    overrides = NodeOverrides({"rack": "r1"}, ["vllm", "sglang", "vllm"])
    assert overrides.disabled_engines == ("sglang", "vllm")
    assert NodeOverrides.from_json(overrides.to_json()) == overrides
    assert overrides.agent_yaml() == {"labels": {"rack": "r1"}, "disabled_engines": ["sglang", "vllm"]}
    assert overrides.describe() == "labels rack=r1; sglang, vllm disabled"
    none = NodeOverrides.from_json("{}")
    assert not none and none.agent_yaml() == {} and none.describe() == ""
    assert NodeOverrides({}, ["vllm"]).agent_yaml() == {"disabled_engines": ["vllm"]}
    with pytest.raises(ValueError, match="cannot be a label key"):
        NodeOverrides({"bad key": "x"})
    with pytest.raises(ValueError, match="JSON object"):
        NodeOverrides.from_json("[]")
