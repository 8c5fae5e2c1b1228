"""Supervisor with real engine processes (tests/component/fake_engine.py) on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator

import attrs
import httpx
import psutil
import pytest
import trio

from llmgw.node import shard_state
from llmgw.catalog.engine_flags import AGENT, Table, opt
from llmgw.node.engines import EngineRefused, UnknownEngine, check_refused
from llmgw.node.process import ProcessIdentity, identity_of
from llmgw.node.shard import RestartPolicy
from llmgw.node.ports import free_port
from llmgw.node.supervisor import Supervisor
from llmgw.spec import EngineInfo, ShardSpec, ShardState, ShardStatus

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")
REPO_ROOT = Path(__file__).resolve().parents[2]

# Fast timings so crash loops finish in well under a second; never asserted on.
FAST = RestartPolicy(
    backoff_initial=0.05,
    backoff_max=0.2,
    backoff_reset_after=60.0,
    max_failures=3,
    health_interval=0.05,
    health_timeout=2.0,
    unhealthy_after=2,
    report_timeout=0.5,
    kill_grace=2.0,
)
WAIT = 20.0  # deadline for any awaited state: generous for a loaded 2-core machine
# Every fake engine (and its children, by inheritance) carries its test's state dir in
# this variable, so teardown finds and kills exactly the processes that test started.
TAG_VAR = "LLMGW_FAKE_ENGINE_TAG"


#: fake_engine.py's options, classified as llmgw classifies an engine's (anything else is refused).
FAKE_TABLE = Table("fake", "test", "argparse", (
    opt("--host", refused=AGENT), opt("--port", refused=AGENT), opt("--model", refused=AGENT),
    opt("--lines"), opt("--health-status"), opt("--ignore-term", values=0), opt("--spawn-child", values=0),
    opt("--exit-at-start"),
))


@attrs.define
class FakeEngine:
    """Engine adapter running fake_engine.py; spec.args are fake_engine options."""

    name: str = "fake"
    health_path: str = "/health"
    startup_timeout: float = 15.0
    tag: str = ""

    def probe(self) -> EngineInfo:
        return EngineInfo(name=self.name, installed=True, version="test")

    def argv(self, spec: ShardSpec, host: str, port: int) -> list[str]:
        return [sys.executable, str(FAKE_ENGINE), "--host", host, "--port", str(port), "--model", spec.model, *spec.args]

    def env(self, spec: ShardSpec) -> dict[str, str]:
        return {**spec.env, TAG_VAR: self.tag}

    def check_args(self, spec: ShardSpec) -> None:
        check_refused(spec, table=FAKE_TABLE)


class Recorder:
    """A ShardReporter that keeps every status and lets a test wait for one."""

    def __init__(self) -> None:
        self.statuses: list[ShardStatus] = []
        self._cursor = 0
        self._changed = trio.Event()

    async def status(self, status: ShardStatus) -> None:
        self.statuses.append(status)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, pred: Callable[[ShardStatus], bool], timeout: float = WAIT) -> ShardStatus:
        """Returns the first status after the previous match that satisfies ``pred``."""
        with trio.fail_after(timeout):
            while True:
                for i in range(self._cursor, len(self.statuses)):
                    if pred(self.statuses[i]):
                        self._cursor = i + 1
                        return self.statuses[i]
                self._cursor = len(self.statuses)
                await self._changed.wait()

    async def wait_state(self, state: ShardState, timeout: float = WAIT) -> ShardStatus:
        return await self.wait_for(lambda s: s.state == state, timeout)


def spec(shard_id: str = "s1", *args: str, **env: str) -> ShardSpec:
    return ShardSpec(id=shard_id, model="tiny", engine="fake", source="/models/tiny", args=args, env=env)


def dead(pid: int) -> bool:
    """True if ``pid`` has exited (a zombie counts: it runs no code)."""
    return identity_of(pid) is None


async def wait_until(pred: Callable[[], bool], timeout: float = WAIT) -> None:
    """Polls ``pred`` (an external fact, e.g. a process exit) until true, with a deadline."""
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.02)


def fake_engine_processes(port: int) -> list[psutil.Process]:
    """Returns the live fake engines serving ``port``, from the whole process table."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and str(FAKE_ENGINE) in cmd and str(port) in cmd:
            found.append(proc)
    return found


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """The agent state directory; at teardown every process the test started is killed.

    That is our children, and every process (wherever it was reparented) whose
    environment carries this directory as its fake-engine tag.
    """
    directory = tmp_path / "state"
    yield directory
    doomed = {child.pid for child in psutil.Process().children(recursive=True)}
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG_VAR) == str(directory):
                doomed.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    psutil.wait_procs(psutil.Process().children(), timeout=5)  # reaps our children


def make_supervisor(state_dir: Path, policy: RestartPolicy = FAST, **engine_options: float) -> Supervisor:
    engine = FakeEngine(tag=str(state_dir), **engine_options)  # type: ignore[arg-type]
    return Supervisor(state_dir, engines={"fake": engine}, policy=policy)


async def ready_then_agent_exits(state_dir: Path, *args: str) -> ShardStatus:
    """Runs a first agent until shard s1 (fake engine options ``args``) is READY, then ends
    that agent (its engine keeps running); returns the READY status."""
    rec = Recorder()
    async with trio.open_nursery() as agent1:
        sup1 = make_supervisor(state_dir)
        await agent1.start(sup1.run)
        await sup1.start_shard(spec("s1", *args), rec)
        ready = await rec.wait_state(ShardState.READY)
        agent1.cancel_scope.cancel()  # the agent exits
    return ready


@asynccontextmanager
async def next_agent(state_dir: Path) -> AsyncIterator[tuple[Supervisor, Recorder]]:
    """The next agent's supervisor on ``state_dir``, running, with a recorder bound to s1;
    the agent ends (engines left running) when the block does."""
    async with trio.open_nursery() as agent:
        sup = make_supervisor(state_dir)
        await agent.start(sup.run)
        rec = Recorder()
        sup.bind_reporter("s1", rec)
        yield sup, rec
        agent.cancel_scope.cancel()


async def test_start_becomes_ready_and_serves(state_dir: Path, nursery: trio.Nursery) -> None:
    sup = make_supervisor(state_dir)
    await nursery.start(sup.run)
    rec = Recorder()
    await sup.start_shard(spec("s1", "--lines", "3"), rec)
    ready = await rec.wait_state(ShardState.READY)
    assert ready.pid > 0 and ready.restarts == 0
    assert ready.endpoint.startswith("http://127.0.0.1:")
    async with httpx.AsyncClient(timeout=5) as client:
        assert (await client.get(ready.endpoint + "/health")).status_code == 200
    assert [s.state for s in rec.statuses][-1] == ShardState.READY
    assert ShardState.STARTING in [s.state for s in rec.statuses]
    assert sup.status("s1") == ready
    assert sup.shards() == [(spec("s1", "--lines", "3"), ready)]
    await wait_until(lambda: any("listening on" in line for line in sup.logs("s1", 10)))
    assert sup.logs("s1", 2)[-1].endswith(f"listening on 127.0.0.1:{ready.endpoint.rsplit(':', 1)[1]} model tiny")
    assert any(line.endswith("line 2") for line in sup.logs("s1", 100))
    # The engine runs in its own session and process group, its stdin is /dev/null.
    assert os.getsid(ready.pid) == ready.pid and os.getpgid(ready.pid) == ready.pid
    # Persisted: spec, port, identity matching the live process.
    (record,) = shard_state.load_all(state_dir)
    assert record.spec == spec("s1", "--lines", "3")
    assert record.identity == identity_of(ready.pid)
    await sup.stop_shard("s1", grace=5)


async def test_ready_turns_unhealthy_and_back(state_dir: Path, nursery: trio.Nursery) -> None:
    sup = make_supervisor(state_dir)
    await nursery.start(sup.run)
    rec = Recorder()
    await sup.start_shard(spec(), rec)
    ready = await rec.wait_state(ShardState.READY)
    async with httpx.AsyncClient(timeout=5) as client:
        await client.post(ready.endpoint + "/health-status?code=500")
        unhealthy = await rec.wait_state(ShardState.UNHEALTHY)
        assert "failed 2 times in a row" in unhealthy.message and "HTTP 500" in unhealthy.message
        assert unhealthy.pid == ready.pid  # not restarted: a sick engine may recover
        await client.post(ready.endpoint + "/health-status?code=200")
        back = await rec.wait_state(ShardState.READY)
    assert back.pid == ready.pid and back.restarts == 0
    await sup.stop_shard("s1", grace=5)


async def test_start_shard_is_idempotent_and_refuses_conflicts(state_dir: Path, nursery: trio.Nursery) -> None:
    sup = make_supervisor(state_dir)
    with pytest.raises(RuntimeError, match="not running"):
        await sup.start_shard(spec(), None)
    await nursery.start(sup.run)
    first = Recorder()
    await sup.start_shard(spec(), first)
    ready = await first.wait_state(ShardState.READY)
    second = Recorder()
    await sup.start_shard(spec(), second)  # same spec: only rebinds, sends current status
    assert (await second.wait_state(ShardState.READY)).pid == ready.pid
    assert len(sup.shards()) == 1 and len(fake_engine_processes(int(ready.endpoint.rsplit(":", 1)[1]))) == 1
    with pytest.raises(ValueError, match="different spec"):
        await sup.start_shard(spec("s1", "--lines", "1"), None)
    with pytest.raises(EngineRefused, match="--trust-remote-code"):
        await sup.start_shard(spec("s2", "--trust-remote-code"), None)
    with pytest.raises(EngineRefused, match="LD_PRELOAD"):
        await sup.start_shard(spec("s3", LD_PRELOAD="/tmp/evil.so"), None)
    with pytest.raises(UnknownEngine, match="not known"):
        await sup.start_shard(attrs.evolve(spec("s4"), engine="vllm"), None)
    with pytest.raises(ValueError, match="not usable"):
        await sup.start_shard(spec("../escape"), None)
    with pytest.raises(KeyError):
        sup.status("s2")
    await sup.stop_shard("s1", grace=5)


async def test_crash_is_reported_with_last_output_and_restarted(state_dir: Path, nursery: trio.Nursery) -> None:
    sup = make_supervisor(state_dir)
    await nursery.start(sup.run)
    rec = Recorder()
    await sup.start_shard(spec(), rec)
    first = await rec.wait_state(ShardState.READY)
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(httpx.HTTPError):  # the engine dies without answering
            await client.post(first.endpoint + "/crash?code=3")
    crash = await rec.wait_state(ShardState.RESTARTING)
    assert "exited with code 3" in crash.message and f"pid {first.pid}" in crash.message
    assert crash.last_output[-1].endswith("last words: crashing with code 3")
    assert crash.restarts == 1
    again = await rec.wait_state(ShardState.READY)
    assert again.pid != first.pid and again.endpoint == first.endpoint and again.restarts == 1
    assert dead(first.pid)
    (record,) = shard_state.load_all(state_dir)
    assert record.restarts == 1 and record.identity is not None and record.identity.pid == again.pid
    await sup.stop_shard("s1", grace=5)


async def test_engine_that_never_gets_healthy_is_restarted_then_failed(state_dir: Path, nursery: trio.Nursery) -> None:
    sup = make_supervisor(state_dir, startup_timeout=0.5)
    await nursery.start(sup.run)
    rec = Recorder()
    await sup.start_shard(spec("s1", "--health-status", "503", "--lines", "2"), rec)
    restarting = await rec.wait_state(ShardState.RESTARTING)
    assert "not healthy within 0.5 s" in restarting.message and "HTTP 503" in restarting.message
    failed = await rec.wait_state(ShardState.FAILED)
    assert "failed 3 times in a row" in failed.message
    assert any("listening on" in line for line in failed.last_output)  # the engine's last words
    assert failed.restarts == 3 and failed.pid == 0
    assert ShardState.READY not in [s.state for s in rec.statuses]
    for pid in {s.pid for s in rec.statuses if s.pid}:
        await wait_until(lambda: dead(pid))
    # FAILED is persisted: a new agent reports it without starting anything.
    (record,) = shard_state.load_all(state_dir)
    assert record.failed and record.identity is None


async def test_engine_dying_at_start_fails_with_its_last_words(state_dir: Path, nursery: trio.Nursery) -> None:
    sup = make_supervisor(state_dir)
    await nursery.start(sup.run)
    rec = Recorder()
    await sup.start_shard(spec("s1", "--exit-at-start", "7"), rec)
    failed = await rec.wait_state(ShardState.FAILED)
    assert "exited with code 7" in failed.message
    assert failed.last_output[-1].endswith("fatal: cannot load model tiny (exit 7)")
    assert [s.state for s in rec.statuses].count(ShardState.RESTARTING) == 2
    await sup.stop_shard("s1", grace=1)
    assert (await rec.wait_state(ShardState.STOPPED)).pid == 0
    assert not (state_dir / "shards" / "s1").exists()


async def test_stop_kills_group_of_engine_ignoring_sigterm(state_dir: Path, nursery: trio.Nursery) -> None:
    sup = make_supervisor(state_dir)
    await nursery.start(sup.run)
    rec = Recorder()
    await sup.start_shard(spec("s1", "--ignore-term", "--spawn-child"), rec)
    ready = await rec.wait_state(ShardState.READY)
    await wait_until(lambda: any("grandchild pid" in line for line in sup.logs("s1", 50)))
    grandchild = int(next(line for line in sup.logs("s1", 50) if "grandchild pid" in line).rsplit(" ", 1)[1])
    assert os.getpgid(grandchild) == ready.pid  # in the engine's group
    await sup.stop_shard("s1", grace=0.3)
    stopping = await rec.wait_state(ShardState.STOPPING)
    stopped = await rec.wait_state(ShardState.STOPPED)
    assert stopping.pid == ready.pid
    assert "killed by signal SIGKILL" in stopped.message  # SIGTERM was ignored
    assert dead(ready.pid)
    await wait_until(lambda: dead(grandchild))
    assert not (state_dir / "shards" / "s1").exists()
    with pytest.raises(KeyError):
        sup.status("s1")
    with pytest.raises(KeyError):
        await sup.stop_shard("s1")
    assert sup.shards() == []


async def test_agent_exit_leaves_engine_running_and_next_agent_adopts_it(state_dir: Path) -> None:
    ready = await ready_then_agent_exits(state_dir, "--lines", "2")
    port = int(ready.endpoint.rsplit(":", 1)[1])
    assert identity_of(ready.pid) is not None  # the engine keeps running ...
    async with httpx.AsyncClient(timeout=5) as client:  # ... and serving
        assert (await client.get(ready.endpoint + "/health")).status_code == 200

    async with trio.open_nursery() as agent2:
        sup2 = make_supervisor(state_dir)
        await agent2.start(sup2.run)
        rec2 = Recorder()
        sup2.bind_reporter("s1", rec2)
        adopted = await rec2.wait_state(ShardState.READY)
        assert adopted.pid == ready.pid and adopted.endpoint == ready.endpoint and adopted.restarts == 0
        assert [p.pid for p in fake_engine_processes(port)] == [ready.pid]  # no second engine
        # The output buffer was rebuilt from the engine's log file.
        assert any(line.endswith("line 1") for line in sup2.logs("s1", 50))
        # An adopted engine is stopped like a spawned one.
        await sup2.stop_shard("s1", grace=5)
        stopped = await rec2.wait_state(ShardState.STOPPED)
        assert "stopped on request" in stopped.message
        await wait_until(lambda: dead(ready.pid))
        agent2.cancel_scope.cancel()


async def test_engine_survives_agent_killed_with_sigkill(state_dir: Path) -> None:
    """A real agent process is SIGKILLed: no pipe, no session tie, so its engine keeps serving."""
    script = textwrap.dedent(
        f"""
        import sys, trio
        sys.path[:0] = [{str(REPO_ROOT)!r}, {str(Path(__file__).parent)!r}]
        from test_supervisor import make_supervisor, spec
        from pathlib import Path
        async def main():
            sup = make_supervisor(Path({str(state_dir)!r}))
            async with trio.open_nursery() as n:
                await n.start(sup.run)
                await sup.start_shard(spec("s1", "--lines", "1"), None)
                print("started", flush=True)
                await trio.sleep_forever()
        trio.run(main)
        """
    )
    agent = await trio.lowlevel.open_process([sys.executable, "-c", script], stdout=-1)
    try:
        with trio.fail_after(WAIT):
            assert (await agent.stdout.receive_some()).startswith(b"started")
        record_path = state_dir / "shards" / "s1" / "state.json"
        await wait_until(lambda: record_path.exists() and json.loads(record_path.read_text())["identity"] is not None)
    finally:
        agent.kill()
        await agent.wait()
    pid = json.loads(record_path.read_text())["identity"]["pid"]
    assert identity_of(pid) is not None
    sup = make_supervisor(state_dir)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        rec = Recorder()
        sup.bind_reporter("s1", rec)
        ready = await rec.wait_state(ShardState.READY)
        assert ready.pid == pid
        await wait_until(lambda: any("listening on" in line for line in sup.logs("s1", 10)))
        await sup.stop_shard("s1", grace=5)
        await wait_until(lambda: dead(pid))
        nursery.cancel_scope.cancel()


async def test_persisted_shard_whose_engine_died_is_restarted_on_its_port(state_dir: Path) -> None:
    ready = await ready_then_agent_exits(state_dir)
    kill_group(ready.pid)
    await wait_until(lambda: dead(ready.pid))

    async with trio.open_nursery() as agent2:
        sup2 = make_supervisor(state_dir)
        await agent2.start(sup2.run)
        assert f"pid {ready.pid}) is gone" in sup2.status("s1").message
        rec2 = Recorder()
        sup2.bind_reporter("s1", rec2)
        again = await rec2.wait_state(ShardState.READY)
        assert again.pid != ready.pid and again.endpoint == ready.endpoint
        await sup2.stop_shard("s1", grace=5)
        agent2.cancel_scope.cancel()


@pytest.mark.parametrize("mismatch", ["create_time", "cmdline"])
async def test_reused_pid_is_not_adopted(state_dir: Path, mismatch: str) -> None:
    """The recorded pid now belongs to another process: it is left alone and the engine started anew."""
    other = await trio.lowlevel.open_process(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    try:
        await wait_until(lambda: identity_of(other.pid) is not None and "time.sleep" in " ".join(identity_of(other.pid).cmdline))
        real = identity_of(other.pid)
        assert real is not None
        if mismatch == "create_time":
            forged = ProcessIdentity(other.pid, real.create_time - 1000, real.cmdline)
        else:
            forged = ProcessIdentity(other.pid, real.create_time, (sys.executable, str(FAKE_ENGINE), "--port", "1"))
        record = shard_state.ShardRecord(spec=spec(), port=0, identity=forged)
        sup = make_supervisor(state_dir)
        record.port = free_port("127.0.0.1")
        shard_state.save(state_dir, record)
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            assert "is gone" in sup.status("s1").message
            rec = Recorder()
            sup.bind_reporter("s1", rec)
            ready = await rec.wait_state(ShardState.READY)
            assert ready.pid != other.pid
            assert identity_of(other.pid) == real  # untouched
            await sup.stop_shard("s1", grace=5)
            assert identity_of(other.pid) == real  # the stop did not signal it either
            nursery.cancel_scope.cancel()
    finally:
        other.kill()
        await other.wait()


class BrokenReporter:
    def __init__(self) -> None:
        self.calls = 0

    async def status(self, status: ShardStatus) -> None:
        self.calls += 1
        raise ConnectionResetError("session gone")


class HangingReporter:
    def __init__(self) -> None:
        self.calls = 0

    async def status(self, status: ShardStatus) -> None:
        self.calls += 1
        await trio.sleep_forever()


@pytest.mark.parametrize("bad", [BrokenReporter, HangingReporter])
async def test_failing_reporter_does_not_hurt_the_shard_and_rebinding_sends_status(
    state_dir: Path, nursery: trio.Nursery, bad: type
) -> None:
    sup = make_supervisor(state_dir)
    await nursery.start(sup.run)
    reporter = bad()
    await sup.start_shard(spec(), reporter)
    await wait_until(lambda: sup.status("s1").state == ShardState.READY)
    assert reporter.calls >= 1
    async with httpx.AsyncClient(timeout=5) as client:
        assert (await client.get(sup.status("s1").endpoint + "/health")).status_code == 200
    good = Recorder()
    sup.bind_reporter("s1", good)
    current = await good.wait_for(lambda s: True)
    assert current.state == ShardState.READY and current == sup.status("s1")
    same_again = Recorder()
    sup.bind_reporter("s1", same_again)
    assert await same_again.wait_for(lambda s: True) == current
    with pytest.raises(KeyError):
        sup.bind_reporter("nope", good)
    await sup.stop_shard("s1", grace=5)
    assert (await same_again.wait_state(ShardState.STOPPED)).pid == 0
    assert ShardState.STOPPED not in [s.state for s in good.statuses]  # no longer bound


async def test_concurrent_starts_of_one_shard_run_one_engine(state_dir: Path, nursery: trio.Nursery) -> None:
    sup = make_supervisor(state_dir)
    await nursery.start(sup.run)
    recs = [Recorder(), Recorder()]
    async with trio.open_nursery() as starters:
        for rec in recs:
            starters.start_soon(sup.start_shard, spec(), rec)
    final = Recorder()  # which start bound its reporter last is up to the scheduler
    sup.bind_reporter("s1", final)
    ready = await final.wait_state(ShardState.READY)
    port = int(ready.endpoint.rsplit(":", 1)[1])
    assert [p.pid for p in fake_engine_processes(port)] == [ready.pid]
    (record,) = shard_state.load_all(state_dir)
    assert record.port == port
    await sup.stop_shard("s1", grace=5)


async def test_stop_while_starting(state_dir: Path, nursery: trio.Nursery) -> None:
    sup = make_supervisor(state_dir)
    await nursery.start(sup.run)
    rec = Recorder()
    await sup.start_shard(spec("s1", "--health-status", "503"), rec)
    starting = await rec.wait_for(lambda s: s.state == ShardState.STARTING and s.pid > 0)
    await sup.stop_shard("s1", grace=5)
    stopped = await rec.wait_state(ShardState.STOPPED)
    assert stopped.message.startswith("stopped on request (engine ")
    assert dead(starting.pid)
    assert ShardState.READY not in [s.state for s in rec.statuses]


async def test_adopted_engine_that_crashes_is_restarted(state_dir: Path) -> None:
    rec = Recorder()
    async with trio.open_nursery() as agent1:
        sup1 = make_supervisor(state_dir)
        await agent1.start(sup1.run)
        await sup1.start_shard(spec("s1", "--lines", "1"), rec)
        first = await rec.wait_state(ShardState.READY)
        agent1.cancel_scope.cancel()
    async with trio.open_nursery() as agent2:
        sup2 = make_supervisor(state_dir)
        await agent2.start(sup2.run)
        rec2 = Recorder()
        sup2.bind_reporter("s1", rec2)
        assert (await rec2.wait_state(ShardState.READY)).pid == first.pid
        async with httpx.AsyncClient(timeout=5) as client:
            with pytest.raises(httpx.HTTPError):
                await client.post(first.endpoint + "/crash?code=4")
        crash = await rec2.wait_state(ShardState.RESTARTING)
        assert f"pid {first.pid}" in crash.message
        assert crash.last_output[-1].endswith("last words: crashing with code 4")
        again = await rec2.wait_state(ShardState.READY)
        assert again.pid != first.pid and again.restarts == 1
        await sup2.stop_shard("s1", grace=5)
        agent2.cancel_scope.cancel()
