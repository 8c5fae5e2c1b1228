"""The supervisor under the faults an operator meets: a full state disk, lost records,
a stranger on a shard's port, a second agent on the same state directory, unknown ids.

Real engine processes (tests/component/fake_engine.py) on 127.0.0.1; "no orphan" is
checked by the engines' marker (llmgw.node.markers), the way the next agent finds them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest
import trio

from llmgw.node import markers, shard_state
from llmgw.node.statelock import StateDirLocked, lock_state_dir
from llmgw.spec import ShardState, UnknownShard
from tests.component.test_supervisor import (  # noqa: F401  (state_dir is a fixture)
    WAIT,
    Recorder,
    dead,
    fake_engine_processes,
    kill_group,
    make_supervisor,
    next_agent,
    ready_then_agent_exits,
    spec,
    state_dir,
    wait_until,
)


async def _ready_then_agent_exits(state_dir: Path) -> tuple[int, str]:  # noqa: F811
    """Runs a first agent until shard s1 is READY, then ends it; returns (engine pid, endpoint)."""
    ready = await ready_then_agent_exits(state_dir)
    return ready.pid, ready.endpoint


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


async def test_second_supervisor_on_one_state_dir_is_refused(state_dir: Path, nursery: trio.Nursery) -> None:  # noqa: F811
    sup = make_supervisor(state_dir)
    await nursery.start(sup.run)
    with pytest.raises(StateDirLocked, match=f"in use by process {os.getpid()}"):
        await make_supervisor(state_dir).run()
    assert sup.shards() == []  # the first one is untouched


async def test_state_dir_lock_names_the_holder_and_dies_with_it(tmp_path: Path) -> None:
    """Another process holds the lock: refused with its pid; once it is killed (-9) the lock is free."""
    holder = await trio.lowlevel.open_process(
        [sys.executable, "-c", (
            "import sys, time\nfrom pathlib import Path\nfrom llmgw.node.statelock import lock_state_dir\n"
            f"lock_state_dir(Path({str(tmp_path)!r}))\nprint('locked', flush=True)\ntime.sleep(600)\n"
        )],
        stdout=-1,
    )
    try:
        with trio.fail_after(WAIT):
            assert (await holder.stdout.receive_some()).startswith(b"locked")
        with pytest.raises(StateDirLocked) as refused:
            lock_state_dir(tmp_path)
        assert refused.value.holder == holder.pid
        assert f"in use by process {holder.pid}" in str(refused.value)
    finally:
        holder.kill()
        await holder.wait()
    lock_state_dir(tmp_path).release()  # a killed holder leaves no stale lock


async def test_engine_whose_pid_cannot_be_recorded_is_stopped(
    state_dir: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """The disk is full when a spawned engine's pid is to be persisted (ENOSPC at the
    persistence boundary): every such engine is stopped, the reason is one line, and no
    marked engine is left once the shard gives up."""
    real_save = shard_state.save
    refused: list[int] = []

    def full_disk(directory: Path, record: shard_state.ShardRecord) -> None:
        if record.identity is not None:
            refused.append(record.identity.pid)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(directory, record)

    monkeypatch.setattr(shard_state, "save", full_disk)
    sup = make_supervisor(state_dir)
    await nursery.start(sup.run)
    rec = Recorder()
    await sup.start_shard(spec(), rec)
    restarting = await rec.wait_state(ShardState.RESTARTING)
    assert "could not be recorded" in restarting.message and "No space left on device" in restarting.message
    assert "stopped it rather than leave it unmanaged" in restarting.message
    assert "\n" not in restarting.message
    failed = await rec.wait_state(ShardState.FAILED)
    assert "could not be recorded" in failed.message
    assert len(refused) == 3  # FAST.max_failures spawns, each refused ...
    assert all(dead(pid) for pid in refused)  # ... and each stopped before the next
    assert markers.find_marked(state_dir) == []
    assert not any(fake_engine_processes(_port(failed.endpoint)))


async def test_engine_whose_record_lost_its_pid_is_adopted_by_its_marker(state_dir: Path) -> None:  # noqa: F811
    pid, endpoint = await _ready_then_agent_exits(state_dir)
    (record,) = shard_state.load_all(state_dir)
    record.identity = None  # the pid was never persisted (or the file went stale)
    shard_state.save(state_dir, record)

    async with next_agent(state_dir) as (sup2, rec2):
        adopted = await rec2.wait_state(ShardState.READY)
        assert (adopted.pid, adopted.endpoint, adopted.restarts) == (pid, endpoint, 0)
        assert [p.pid for p in fake_engine_processes(_port(endpoint))] == [pid]  # no second engine
        await sup2.stop_shard("s1", grace=5)
        await wait_until(lambda: dead(pid))


async def test_marked_engine_without_a_record_is_stopped(state_dir: Path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    pid, _ = await _ready_then_agent_exits(state_dir)
    shutil.rmtree(shard_state.shard_dir(state_dir, "s1"))  # its record is lost entirely

    caplog.set_level(logging.WARNING, logger="llmgw.node.supervisor")
    async with trio.open_nursery() as agent2:
        sup2 = make_supervisor(state_dir)
        await agent2.start(sup2.run)
        assert sup2.shards() == []

        def stopped() -> bool:
            # The stray is stopped once it is dead and said so: the supervisor logs after its
            # wait for the exit returns, which can come after this test sees the pid gone.
            return dead(pid) and any(f"stopped engine pid {pid} of shard s1" in r.getMessage()
                                     for r in caplog.records)

        await wait_until(stopped)
        agent2.cancel_scope.cancel()


async def test_port_taken_by_a_stranger_moves_the_engine(state_dir: Path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """The shard's engine is gone and a stranger listens on its port: the restarted engine
    gets a fresh port (said so) instead of failing to bind while the stranger answers."""
    pid, endpoint = await _ready_then_agent_exits(state_dir)
    kill_group(pid)
    await wait_until(lambda: dead(pid))
    port = _port(endpoint)

    caplog.set_level(logging.WARNING, logger="llmgw.node.shard")
    with socket.socket() as stranger:
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        stranger.bind(("127.0.0.1", port))
        stranger.listen()
        async with next_agent(state_dir) as (sup2, rec2):
            again = await rec2.wait_state(ShardState.READY)
            new_port = _port(again.endpoint)
            assert new_port != port and again.pid != pid
            assert [p.pid for p in fake_engine_processes(new_port)] == [again.pid]
            persisted = json.loads((shard_state.shard_dir(state_dir, "s1") / shard_state.STATE_FILE).read_text())
            assert persisted["port"] == new_port
            await sup2.stop_shard("s1", grace=5)
    assert any(f"port {port} is taken" in r.getMessage() and str(new_port) in r.getMessage() for r in caplog.records)


async def test_unknown_shard_is_a_typed_answer(state_dir: Path, nursery: trio.Nursery) -> None:  # noqa: F811
    sup = make_supervisor(state_dir)
    await nursery.start(sup.run)
    for call in (lambda: sup.bind_reporter("nope", None), lambda: sup.status("nope"), lambda: sup.logs("nope", 5)):
        with pytest.raises(UnknownShard) as unknown:
            call()
        assert unknown.value.shard_id == "nope"
        assert UnknownShard.in_text(str(unknown.value))
    with pytest.raises(UnknownShard):
        await sup.stop_shard("nope")
