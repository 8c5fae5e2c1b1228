"""An agent asked to adopt or stop a shard it never had answers "unknown shard" over the
real RPC, and the control plane's session turns that answer into UnknownShard."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.control.registry import Registry
from llmgw.control.sessions import NodeSession
from llmgw.node.agent import _make_agent_server
from llmgw.rpc import schema
from llmgw.rpc.connection import open_client, serve_stream
from llmgw.rpc.kjtrio import capnp_runtime
from llmgw.spec import UnknownShard
from tests.component.test_supervisor import make_supervisor, state_dir  # noqa: F401  (state_dir is a fixture)


async def test_adopt_and_stop_of_an_unknown_shard_are_typed_on_the_control_plane(state_dir: Path) -> None:  # noqa: F811
    supervisor = make_supervisor(state_dir)
    a, b = trio.testing.memory_stream_pair()
    async with capnp_runtime(), trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        nursery.start_soon(serve_stream, a, _make_agent_server(supervisor))
        async with open_client(b) as client:
            agent = client.bootstrap().cast_as(schema.load().Agent)
            session = NodeSession(Registry(lost_after=10, replace_grace=10), "node-a", 1, agent, lambda: None)
            with trio.fail_after(10):
                with pytest.raises(UnknownShard) as adopt:
                    await session.adopt("never-here")
                with pytest.raises(UnknownShard) as stop:
                    await session.stop_shard("never-here", grace=1)
        nursery.cancel_scope.cancel()
    assert adopt.value.shard_id == stop.value.shard_id == "never-here"
    assert session.shards == {}
