"""The supervisor fetches a shard's LoRA adapters like its weights and reports where they are."""

from __future__ import annotations

from pathlib import Path

import attrs
import trio

from llmgw.node.fetch import FetchSettings
from llmgw.node.supervisor import Supervisor
from llmgw.spec import Adapter, ShardState
from tests.component.test_fetch import COMMIT, Hub, hub  # noqa: F401  (hub is a fixture)
from tests.component.test_supervisor import FAST, FakeEngine, Recorder, spec, state_dir  # noqa: F401


def supervisor(state_dir: Path, hub: Hub) -> Supervisor:  # noqa: F811
    settings = FetchSettings(weights_dir=state_dir.parent / "weights", hf_endpoint=hub.url)
    return Supervisor(state_dir, engines={"fake": FakeEngine(tag=str(state_dir))}, policy=FAST,
                      fetch_settings=settings)


async def test_adapters_are_fetched_and_reported_in_order(state_dir: Path, hub: Hub) -> None:  # noqa: F811
    hub.files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"a" * 10_000}
    local = state_dir.parent / "chat-lora"
    local.mkdir(parents=True)
    shard = attrs.evolve(spec("s1"), adapters=(Adapter("sql", "hf://org/tiny"), Adapter("chat", str(local))))
    fetched = state_dir.parent / "weights" / "hf" / "org" / "tiny" / COMMIT
    expected = (("sql", str(fetched)), ("chat", str(local)))
    rec = Recorder()
    async with trio.open_nursery() as agent1:
        sup = supervisor(state_dir, hub)
        await agent1.start(sup.run)
        await sup.start_shard(shard, rec)
        await rec.wait_for(lambda s: s.message.startswith("fetching adapter sql: "))
        ready = await rec.wait_state(ShardState.READY)
        assert ready.adapters == expected
        assert (fetched / "adapter_model.safetensors").stat().st_size == 10_000
        agent1.cancel_scope.cancel()  # the agent exits; the engine keeps running

    hub.files = {}  # a restarted agent must not need the hub to know where the adapters are
    async with trio.open_nursery() as agent2:
        sup2 = supervisor(state_dir, hub)
        await agent2.start(sup2.run)
        rec2 = Recorder()
        sup2.bind_reporter("s1", rec2)
        adopted = await rec2.wait_state(ShardState.READY)
        assert adopted.pid == ready.pid and adopted.adapters == expected
        await sup2.stop_shard("s1", grace=5)
        agent2.cancel_scope.cancel()


async def test_missing_adapter_is_named_and_the_engine_not_started(state_dir: Path, hub: Hub) -> None:  # noqa: F811
    shard = attrs.evolve(spec("s1"), adapters=(Adapter("sql", "/nowhere/sql-lora"),))
    rec = Recorder()
    async with trio.open_nursery() as nursery:
        sup = supervisor(state_dir, hub)
        await nursery.start(sup.run)
        await sup.start_shard(shard, rec)
        restarting = await rec.wait_state(ShardState.RESTARTING)
        assert "LoRA adapter 'sql': adapter sql path /nowhere/sql-lora does not exist on this node" in restarting.message
        assert all(s.pid == 0 for s in rec.statuses)
        await sup.stop_shard("s1", grace=5)
        nursery.cancel_scope.cancel()
