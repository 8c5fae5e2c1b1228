"""The supervisor's KV-event relay with real simulated engines (``python -m llmgw.sim``):
deltas up the bound reporter, a full copy at every binding, a reset when the engine
restarts, and adoption by a new agent that binds the same persisted endpoint."""

from __future__ import annotations

import logging

import os
import signal
from pathlib import Path
from typing import Callable, Iterator

import httpx
import psutil
import pytest
import trio

from llmgw import kvhash
from llmgw.node import shard_state
from llmgw.node.engines.sim import SimEngine
from llmgw.node.shard import RestartPolicy
from llmgw.node.supervisor import Supervisor
from llmgw.spec import KvDelta, ShardSpec, ShardState, ShardStatus

WAIT = 30.0
BS = 16
POLICY = RestartPolicy(backoff_initial=0.05, backoff_max=0.2, health_interval=0.05, report_timeout=2.0, kill_grace=2.0)


class KvRecorder:
    """A reporter with kv_update: the router's view of the shard, and its statuses."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.deltas: list[KvDelta] = []
        self.statuses: list[ShardStatus] = []
        self._changed = trio.Event()

    async def status(self, status: ShardStatus) -> None:
        self.statuses.append(status)
        self._notify()

    async def kv_update(self, delta: KvDelta) -> None:
        if delta.reset:
            self.blocks = set(delta.stored)
        else:
            self.blocks = (self.blocks | set(delta.stored)) - set(delta.removed)
        self.deltas.append(delta)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, pred: Callable[[], object], timeout: float = WAIT) -> None:
        with trio.fail_after(timeout):
            while not pred():
                await self._changed.wait()

    def ready(self) -> ShardStatus | None:
        return next((s for s in reversed(self.statuses) if s.state is ShardState.READY), None)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """The agent state directory; every engine running in it is killed at teardown."""
    directory = tmp_path / "state"
    yield directory
    for proc in psutil.process_iter():
        try:
            if str(directory) in proc.cwd():
                os.killpg(proc.pid, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    psutil.wait_procs(psutil.Process().children(), timeout=5)


def spec() -> ShardSpec:
    return ShardSpec(id="kv1", model="sim-kv", engine="sim", source="sim", args=("--block-size", str(BS)))


async def complete(endpoint: str, prompt: list[int]) -> None:
    async with httpx.AsyncClient(timeout=WAIT) as http:
        r = await http.post(endpoint + "/v1/completions", json={"model": "sim-kv", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text


def hashes(prompt: list[int]) -> set[int]:
    return set(kvhash.event_hashes(kvhash.block_hashes(prompt, BS, seed=kvhash.KV_HASH_SEED)))


async def test_deltas_full_copy_on_bind_reset_on_restart_and_adoption(state_dir: Path) -> None:
    rec = KvRecorder()
    prompt = list(range(10, 10 + 2 * BS + 1))
    async with trio.open_nursery() as agent1:
        sup = Supervisor(state_dir, engines={"sim": SimEngine()}, policy=POLICY)
        await agent1.start(sup.run)
        await sup.start_shard(spec(), rec)
        await rec.until(rec.ready)
        endpoint = rec.ready().endpoint
        (record,) = shard_state.load_all(state_dir)
        assert record.kv_events is not None and record.kv_events.block_size == BS, "persisted with the shard"

        await complete(endpoint, prompt)
        await rec.until(lambda: hashes(prompt) <= rec.blocks)
        assert rec.deltas[0].reset and rec.deltas[-1].block_size == BS

        # A new session: the new reporter starts from a full copy.
        rec2 = KvRecorder()
        sup.bind_reporter("kv1", rec2)
        await rec2.until(lambda: rec2.deltas)
        assert rec2.deltas[0].reset and hashes(prompt) <= set(rec2.deltas[0].stored)

        # The engine dies: the restarted one holds nothing, and the view is reset to that.
        pid = rec2.ready().pid
        os.kill(pid, signal.SIGKILL)
        await rec2.until(lambda: any(s.state is ShardState.READY and s.pid != pid for s in rec2.statuses))
        await rec2.until(lambda: not rec2.blocks)
        assert rec2.deltas[-1].reset
        restarted = rec2.ready().pid
        agent1.cancel_scope.cancel()  # the agent exits; the engine keeps running

    # The next agent adopts the engine, binds the same endpoint, and events flow again.
    rec3 = KvRecorder()
    async with trio.open_nursery() as agent2:
        sup2 = Supervisor(state_dir, engines={"sim": SimEngine()}, policy=POLICY)
        await agent2.start(sup2.run)
        sup2.bind_reporter("kv1", rec3)
        await rec3.until(rec3.ready)
        assert rec3.ready().pid == restarted, "adopted, not restarted"
        other = list(range(500, 500 + 3 * BS + 1))
        await complete(rec3.ready().endpoint, other)
        await rec3.until(lambda: hashes(other) <= rec3.blocks)
        assert rec3.deltas[0].reset
        await sup2.stop_shard("kv1", grace=5)
        agent2.cancel_scope.cancel()


async def test_no_kv_events_option_and_reporters_without_kv_update(state_dir: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    class StatusOnly:
        def __init__(self) -> None:
            self.ready = trio.Event()
            self.endpoint = ""

        async def status(self, status: ShardStatus) -> None:
            if status.state is ShardState.READY:
                self.endpoint = status.endpoint
                self.ready.set()

    async with trio.open_nursery() as agent:
        sup = Supervisor(state_dir, engines={"sim": SimEngine()}, policy=POLICY)
        await agent.start(sup.run)
        off = ShardSpec(id="off", model="m", engine="sim", source="sim", args=("--llmgw-no-kv-events",))
        plain, quiet = StatusOnly(), StatusOnly()
        await sup.start_shard(off, plain)
        await sup.start_shard(spec(), quiet)  # events on, but the reporter takes none
        records = {r.spec.id: r for r in shard_state.load_all(state_dir)}
        assert records["off"].kv_events is None and records["kv1"].kv_events is not None
        with trio.fail_after(WAIT):
            await plain.ready.wait()
            await quiet.ready.wait()
        prompt = list(range(700, 700 + 2 * BS + 1))
        await complete(quiet.endpoint, prompt)  # events while the reporter cannot take them
        rec = KvRecorder()
        sup.bind_reporter("kv1", rec)  # a reporter that can: a full copy, then the deltas
        await rec.until(lambda: hashes(prompt) <= rec.blocks)
        assert rec.deltas[0].reset
        await sup.stop_shard("off", grace=5)
        await sup.stop_shard("kv1", grace=5)
        agent.cancel_scope.cancel()
    # A reporter without kv_update is not a failed send ("sending a delta failed" warnings).
    failures = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "llmgw.node.kvevents"]
    assert not failures, [r.getMessage() for r in failures]
