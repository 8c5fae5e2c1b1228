"""Which agents a control plane drives: the node protocol named in the registration's features."""

from __future__ import annotations

import pytest

from llmgw.control.registry import Registry
from llmgw.control.sessions import NodeSession
from llmgw.nodeprotocol import AGENT_FEATURES, NODE_PROTOCOL, protocol_of, refusal


def test_this_releases_agent_and_an_agent_older_than_the_marker_are_driven() -> None:
    assert protocol_of(AGENT_FEATURES) == NODE_PROTOCOL
    assert refusal("gpu-1", "0.1.0", AGENT_FEATURES, "0.1.0") is None
    assert protocol_of(["adopt", "stop-grace"]) == 1  # before features named a protocol
    assert refusal("gpu-1", "0.0.9", ["adopt", "stop-grace"], "0.1.0") is None


def test_another_protocol_is_refused_saying_what_to_upgrade() -> None:
    newer = refusal("gpu-1", "2.0.0", ["protocol:2"], "0.1.0")
    assert newer is not None and "upgrade the control planes to llmgw 2.0.0 or later" in newer
    older = refusal("gpu-1", "0.0.1", ["protocol:0"], "0.1.0")
    assert older is not None and "upgrade llmgw on gpu-1 to 0.1.0" in older
    assert protocol_of(["protocol:x"]) == 0 and refusal("gpu-1", "", ["protocol:x"], "0.1.0") is not None


async def test_logs_are_asked_only_of_an_agent_that_lists_them() -> None:
    # an agent object without a logs method: any call to it would fail differently
    session = NodeSession(Registry(), "old-node", 1, agent=object(), close=lambda: None)
    session.features = frozenset({"adopt", "stop-grace"})
    with pytest.raises(RuntimeError, match="the agent on old-node is too old to send its logs"):
        await session.node_logs("agent", 10)
