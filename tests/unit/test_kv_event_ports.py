"""A shard's KV-event ports are apart from each other and from every port of the node's shards.

Each port is drawn free from the kernel, which can hand a port just released out again: an
engine given its own HTTP port as a KV-event port failed to listen at every start (seen when
several test clusters shared one machine).
"""

from __future__ import annotations

from typing import Iterator

import pytest

from llmgw.node.kvevents import KvEventsConfig
from llmgw.node.supervisor import KV_PORT_ATTEMPTS, kv_events_for
from llmgw.spec import ShardSpec


def config(events: int, replay: int) -> KvEventsConfig:
    return KvEventsConfig(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}", "kv", 16)


class DrawingEngine:
    """An engine adapter whose fresh KV-event endpoints come from a list, in order."""

    def __init__(self, draws: list[KvEventsConfig | None]) -> None:
        self._draws: Iterator[KvEventsConfig | None] = iter(draws)
        self.asked = 0

    def kv_events_for(self, spec: ShardSpec, host: str) -> KvEventsConfig | None:
        self.asked += 1
        return next(self._draws)


SPEC = ShardSpec(id="m-1", model="m", engine="sim", source="m")


def test_the_ports_of_the_endpoints() -> None:
    assert config(5001, 5002).ports() == (5001, 5002)
    assert KvEventsConfig("ipc:///tmp/events", "tcp://[::1]:5003").ports() == (5003,)


def test_a_draw_that_meets_a_taken_port_or_itself_is_drawn_again() -> None:
    engine = DrawingEngine([config(4000, 5001), config(5002, 5002), config(5003, 5004)])
    chosen = kv_events_for(engine, SPEC, avoid={4000, 4001})  # type: ignore[arg-type]
    assert chosen == config(5003, 5004)
    assert engine.asked == 3


def test_an_engine_without_kv_events_is_asked_once() -> None:
    engine = DrawingEngine([None])
    assert kv_events_for(engine, SPEC, avoid={4000}) is None  # type: ignore[arg-type]
    assert engine.asked == 1


def test_no_draw_apart_is_an_error_that_says_so() -> None:
    engine = DrawingEngine([config(4000, 5001)] * KV_PORT_ATTEMPTS)
    with pytest.raises(OSError, match="no free TCP ports for KV events"):
        kv_events_for(engine, SPEC, avoid={4000})  # type: ignore[arg-type]
    assert engine.asked == KV_PORT_ATTEMPTS
