"""A shard's KV-event ports are apart from each other and from every port of the node's shards.

Each port is drawn free from the kernel, which can hand a port just released out again: an
engine given its own HTTP port as a KV-event port failed to listen at every start (seen when
several test clusters shared one machine).
"""

from __future__ import annotations

import pytest

from llmgw.node import kvevents
from llmgw.node.engines.sim import SimEngine
from llmgw.node.kvevents import KvEventsConfig
from llmgw.node.supervisor import kv_events_for
from llmgw.spec import ShardSpec

SPEC = ShardSpec(id="m-1", model="m", engine="sim", source="m")


def test_the_ports_of_the_endpoints() -> None:
    config = KvEventsConfig("tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002")
    assert config.ports() == (5001, 5002)
    assert KvEventsConfig("ipc:///tmp/events", "tcp://[::1]:5003").ports() == (5003,)


def test_the_two_ports_are_drawn_apart_from_each_other_and_the_ports_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's draws are replaced by the lowest of a few ports outside what is avoided, so
    that each draw would land on a port taken if the avoidance were missing."""
    asked: list[set[int]] = []

    def lowest_free(host: str, avoid: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        asked.append(set(avoid))
        return min(p for p in (4000, 4001, 4002, 4003) if p not in avoid)

    monkeypatch.setattr(kvevents, "free_port", lowest_free)
    config = kv_events_for(SimEngine(), SPEC, avoid={4000, 4001})  # type: ignore[arg-type]
    assert config is not None and config.ports() == (4002, 4003)
    assert asked == [{4000, 4001}, {4000, 4001, 4002}]

