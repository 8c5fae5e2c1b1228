"""What a node may report about its shards: endpoints on its own address, shard ids of its own."""

from __future__ import annotations

import pytest

from llmgw.control.reports import endpoint_hosts, endpoint_refusal, screen_shards
from llmgw.spec import ShardSpec, ShardState, ShardStatus

HOSTS = endpoint_hosts("10.0.0.5", "::1")


@pytest.mark.parametrize("endpoint", [
    "", "http://10.0.0.5:8000", "http://[::1]:9", "http://[0:0:0:0:0:0:0:1]:9", "http://10.0.0.5",
])
def test_endpoints_on_the_node_are_accepted(endpoint: str) -> None:
    assert endpoint_refusal(endpoint, HOSTS) is None


@pytest.mark.parametrize(("endpoint", "reason"), [
    ("http://10.0.0.6:8000", "'10.0.0.6' is not this node's address (10.0.0.5, ::1)"),
    ("http://evil.example/v1", "'evil.example' is not this node's address"),
    ("http://10.0.0.5.evil.example:80", "is not this node's address"),
    ("http://user@10.0.0.6:80", "'10.0.0.6' is not"),
    ("10.0.0.5:8000", "is not a URL with a host"),
    ("http://[zz", "is not a URL with a host"),
])
def test_other_endpoints_are_refused_with_the_reason(endpoint: str, reason: str) -> None:
    refusal = endpoint_refusal(endpoint, HOSTS)
    assert refusal is not None and reason in refusal


def test_names_compare_in_one_spelling() -> None:
    hosts = endpoint_hosts("GPU-1.Example.", None)
    assert endpoint_refusal("http://gpu-1.example:80", hosts) is None
    assert endpoint_hosts("h", "") == frozenset({"h"})


def shard(sid: str, endpoint: str) -> tuple[ShardSpec, ShardStatus]:
    return (ShardSpec(id=sid, model="m", engine="sim", source="/w"),
            ShardStatus(id=sid, state=ShardState.READY, endpoint=endpoint))


def test_a_join_keeps_only_its_own_shards(caplog: pytest.LogCaptureFixture) -> None:
    owners = {"mine": "a", "theirs": "b"}
    shards = [shard("mine", "http://10.0.0.5:1"), shard("theirs", "http://10.0.0.5:2"),
              shard("new", "http://10.0.0.5:3"), shard("elsewhere", "http://10.9.9.9:4")]
    accepted = screen_shards("a", HOSTS, shards, owners.get)
    assert [spec.id for spec, _ in accepted] == ["mine", "new"]
    text = caplog.text
    assert "node a: refused shard 'theirs' at join: that shard id runs on node b" in text
    assert "node a: refused shard 'elsewhere' of 'm' at join: endpoint host '10.9.9.9'" in text
