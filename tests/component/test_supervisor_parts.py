"""The supervisor's parts: engine adapters, process helpers, output tail, persisted state,
and the real simulated engine (``python -m llmgw.sim``) under the supervisor."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

import httpx
import psutil
import pytest
import trio

from llmgw.node import process as process_module
from llmgw.node import shard_state
from llmgw.node.engines import ENGINES, EngineRefused, UnknownEngine, check_refused, get_engine
from llmgw.node.process import (
    OUTPUT_LINES,
    OutputTail,
    ProcessIdentity,
    adopt,
    describe_exit,
    identity_of,
    matches,
    spawn,
    terminate,
)
from llmgw.node.shard import RestartPolicy, endpoint_url
from llmgw.node.ports import free_port, port_is_free
from llmgw.node.supervisor import Supervisor
from llmgw.spec import ShardSpec, ShardState

WAIT = 30.0


def sim_spec(shard_id: str = "sim1", *args: str, **env: str) -> ShardSpec:
    return ShardSpec(id=shard_id, model="tiny-sim", engine="sim", source="/models/tiny", args=args, env=env)


# -- engine adapters -------------------------------------------------------------------


def test_sim_engine_adapter() -> None:
    sim = get_engine("sim")
    assert sim is ENGINES["sim"] and sim.health_path == "/health"
    info = sim.probe()
    assert info.name == "sim" and info.installed and info.version
    spec = sim_spec("x", "--block-size", "32", FOO="bar")
    assert sim.argv(spec, "127.0.0.1", 8123) == [
        sys.executable, "-m", "llmgw.sim", "--host", "127.0.0.1", "--port", "8123", "--model", "tiny-sim",
        "--block-size", "32",
    ]  # fmt: skip
    env = sim.env(spec)
    assert env["FOO"] == "bar" and env["PYTHONUNBUFFERED"] == "1"
    assert str(Path(__file__).resolve().parents[2]) in env["PYTHONPATH"].split(os.pathsep)


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (("--trust-remote-code",), {}, "--trust-remote-code"),
        (("--log-file=/etc/passwd",), {}, "--log-file"),
        (("--port", "1", "--slot-save-path", "/x"), {}, "--slot-save-path"),
        ((), {"LD_PRELOAD": "/x.so"}, "LD_PRELOAD"),
        ((), {"LD_LIBRARY_PATH": "/x"}, "LD_LIBRARY_PATH"),
        ((), {"CUDA_INJECTION64_PATH": "/x"}, "CUDA_INJECTION64_PATH"),
        ((), {"VLLM_PLUGIN": "x"}, "VLLM_PLUGIN"),
    ],
)
def test_refused_args_and_env_are_named(args: tuple[str, ...], env: dict[str, str], named: str) -> None:
    with pytest.raises(EngineRefused, match=named) as err:
        get_engine("sim").check_args(sim_spec("bad", *args, **env))
    assert "shard bad" in str(err.value)


def test_allowed_args_and_env_pass() -> None:
    check_refused(sim_spec("ok", "--max-model-len", "4096", "--num-blocks", "64", CUDA_VISIBLE_DEVICES="0", PLUGINS="x"))


def test_unknown_engine_lists_known_ones() -> None:
    with pytest.raises(UnknownEngine, match=r"'nope' is not known to this node \(known: [^)]*\bsim\b"):
        get_engine("nope")
    with pytest.raises(KeyError):
        get_engine("vllm", {})


def test_restart_policy_backoff_doubles_up_to_the_ceiling() -> None:
    policy = RestartPolicy(backoff_initial=1.0, backoff_max=10.0)
    assert [policy.backoff(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_free_port_and_endpoint() -> None:
    port = free_port("127.0.0.1")
    assert 0 < port < 65536
    assert free_port("127.0.0.1", avoid={port}) != port
    assert endpoint_url("127.0.0.1", 80) == "http://127.0.0.1:80"
    assert endpoint_url("::1", 80) == "http://[::1]:80"


def test_port_is_free_sees_a_listener_on_the_address_or_the_wildcard() -> None:
    for bind_to in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as listener:
            listener.bind((bind_to, 0))
            port = listener.getsockname()[1]
            listener.listen()
            assert not port_is_free("127.0.0.1", port)
        assert port_is_free("127.0.0.1", port)


# -- process helpers -----------------------------------------------------------------


def test_describe_exit() -> None:
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9) == "killed by signal SIGKILL"
    assert "unknown" in describe_exit(None)


def test_identity_matching() -> None:
    me = identity_of(os.getpid())
    assert me is not None and matches(me)
    assert not matches(ProcessIdentity(me.pid, me.create_time + 5, me.cmdline))
    assert not matches(ProcessIdentity(me.pid, me.create_time, ("something", "else")))
    assert ProcessIdentity.from_json(json.loads(json.dumps(me.to_json()))) == me


async def test_spawned_process_is_detached_and_terminated_with_its_group(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    script = "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(600)\n"
    proc = await spawn([sys.executable, "-c", script], env=dict(os.environ), log_path=log, cwd=tmp_path)
    try:
        pid = proc.identity.pid
        assert os.getsid(pid) == pid and matches(proc.identity)
        # The agent kept no handle on the log file: only the engine has it open.
        assert not any(f.path == str(log) for f in psutil.Process().open_files())
        tail = OutputTail(log)
        with trio.fail_after(WAIT):
            while tail.read_new() == 0:
                await trio.sleep(0.02)
        assert tail.last(5) == ["up"]
        assert adopt(proc.identity) is not None  # also adoptable by a later agent
        code = await terminate(proc, grace=0.2)
        assert code == -signal.SIGKILL
        assert adopt(proc.identity) is None
    finally:
        try:
            os.killpg(proc.identity.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()


async def test_spawn_reads_the_identity_after_exec_has_set_up_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Between exec closing the child's close-on-exec descriptors (when the spawn returns)
    # and the kernel filling in the new image's arguments, /proc/PID/cmdline reads empty.
    # The first two reads here see that window; the identity must still name the command.
    real_identity_of = process_module.identity_of
    reads = 0

    def mid_exec_identity_of(pid: int) -> ProcessIdentity | None:
        nonlocal reads
        reads += 1
        identity = real_identity_of(pid)
        if identity is not None and reads <= 2:
            return ProcessIdentity(identity.pid, identity.create_time, ())
        return identity

    monkeypatch.setattr(process_module, "identity_of", mid_exec_identity_of)
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    proc = await spawn(argv, env=dict(os.environ), log_path=tmp_path / "engine.log", cwd=tmp_path)
    try:
        assert reads >= 3  # two empty reads, then (at least) the real one
        assert proc.identity.cmdline == tuple(argv)
        assert adopt(proc.identity) is not None
    finally:
        await terminate(proc, grace=0.2)


def test_output_tail_lines_partial_lines_and_truncation(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    seen: list[str] = []
    tail = OutputTail(path, on_line=seen.append)
    assert tail.read_new() == 0  # no file yet
    path.write_bytes(b"one\ntw")
    assert tail.read_new() == 1 and tail.last(10) == ["one"]
    with open(path, "ab") as f:
        f.write(b"o\r\nthr\xffee")
    assert tail.read_new() == 1 and tail.last(10) == ["one", "two"]
    assert tail.read_new(final=True) == 1 and tail.last(1) == ["thr\ufffdee"]
    assert seen == ["one", "two", "thr\ufffdee"]
    path.write_bytes(b"fresh\n")  # rotated/truncated: starts over
    assert tail.read_new() == 1 and tail.last(1) == ["fresh"]
    tail.mark_run_start()
    assert tail.run_output(5) == ()
    with open(path, "ab") as f:
        f.write(b"a\nb\n")
    tail.read_new()
    assert tail.run_output(5) == ("a", "b")


def test_output_tail_rebuilds_from_file_and_keeps_a_bounded_buffer(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    path.write_text("".join(f"line {i}\n" for i in range(OUTPUT_LINES + 50)) + "partial")
    tail = OutputTail(path)
    tail.load_existing()
    assert len(tail.lines) == OUTPUT_LINES
    assert tail.last(2) == [f"line {OUTPUT_LINES + 48}", f"line {OUTPUT_LINES + 49}"]
    assert tail.run_output(1) == (f"line {OUTPUT_LINES + 49}",)
    with open(path, "a") as f:
        f.write(" done\nnext\n")
    assert tail.read_new() == 2 and tail.last(2) == ["partial done", "next"]


# -- persisted state -----------------------------------------------------------------


def test_state_roundtrip_and_bad_files(tmp_path: Path) -> None:
    spec = ShardSpec(
        id="a", model="m", engine="sim", source="/w", args=("--x", "1"), env={"K": "v"}, memory_mb=512, cpu_cores=1.5, gpus=(0, 1)
    )
    record = shard_state.ShardRecord(
        spec=spec, port=4321, identity=ProcessIdentity(10, 123.25, ("a", "b")), restarts=2, last_output=("x",)
    )
    shard_state.save(tmp_path, record)
    shard_state.save(tmp_path, shard_state.ShardRecord(spec=sim_spec("b"), port=1))
    (tmp_path / "shards" / "b" / "state.json").write_text("{not json")
    (tmp_path / "shards" / "c").mkdir()  # interrupted start: no state file
    loaded = shard_state.load_all(tmp_path)
    assert loaded == [record]
    assert (tmp_path / "shards" / "b" / "state.json.bad").exists()
    assert not list((tmp_path / "shards" / "a").glob(".state-*"))  # no temporary files left
    shard_state.remove(tmp_path, "a")
    assert shard_state.load_all(tmp_path) == []
    assert shard_state.load_all(tmp_path / "nothing-here") == []
    for bad in ("", "../x", ".hidden", "a/b"):
        with pytest.raises(ValueError):
            shard_state.shard_dir(tmp_path, bad)


def test_state_keeps_the_engine_secret_private(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o755)
    (state_dir / "shards").mkdir(mode=0o755)  # left by an older agent: narrowed on the next save
    spec = ShardSpec(id="a", model="m", engine="sim", source="/w", api_key="engine-s3cret")
    shard_state.save(state_dir, shard_state.ShardRecord(spec=spec, port=1))
    [loaded] = shard_state.load_all(state_dir)
    assert loaded.spec.api_key == "engine-s3cret"
    assert "engine-s3cret" not in repr(loaded)
    state = state_dir / "shards" / "a" / "state.json"
    assert state.stat().st_mode & 0o777 == 0o600
    assert (state_dir / "shards").stat().st_mode & 0o777 == 0o700
    assert (state_dir / "shards" / "a").stat().st_mode & 0o777 == 0o700
    old = json.loads(state.read_text())
    del old["spec"]["api_key"]  # written before engines had secrets
    state.write_text(json.dumps(old))
    assert shard_state.load_all(state_dir)[0].spec.api_key == ""


# -- the real simulated engine -------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.states: list[ShardState] = []
        self.changed = trio.Event()

    async def status(self, status) -> None:  # type: ignore[no-untyped-def]
        self.states.append(status.state)
        self.changed.set()
        self.changed = trio.Event()

    async def wait_state(self, state: ShardState) -> None:
        with trio.fail_after(WAIT):
            while state not in self.states:
                await self.changed.wait()


async def test_sim_engine_runs_under_the_supervisor(tmp_path: Path, nursery: trio.Nursery) -> None:
    sup = Supervisor(tmp_path / "state", policy=RestartPolicy(health_interval=0.1, max_failures=1))
    await nursery.start(sup.run)
    rec = Recorder()
    await sup.start_shard(sim_spec(), rec)
    await rec.wait_state(ShardState.READY)
    status = sup.status("sim1")
    assert status.state == ShardState.READY and status.pid > 0
    proc = psutil.Process(status.pid)
    assert proc.cmdline()[1:3] == ["-m", "llmgw.sim"]
    await sup.stop_shard("sim1", grace=10)
    await rec.wait_state(ShardState.STOPPED)
    assert identity_of(status.pid) is None


async def test_the_engine_gets_its_secret_in_its_environment_not_its_command_line(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    secret = "shard-secret-not-in-argv"
    sup = Supervisor(tmp_path / "state", policy=RestartPolicy(health_interval=0.1, max_failures=1))
    await nursery.start(sup.run)
    rec = Recorder()
    spec = ShardSpec(id="keyed", model="tiny-sim", engine="sim", source="/models/tiny", api_key=secret)
    await sup.start_shard(spec, rec)
    await rec.wait_state(ShardState.READY)  # the health check passes (with the secret sent)
    status = sup.status("keyed")
    proc = psutil.Process(status.pid)
    assert not any(secret in part for part in proc.cmdline())
    assert proc.environ()["LLMGW_SIM_API_KEY"] == secret
    async with httpx.AsyncClient(base_url=status.endpoint, timeout=WAIT) as http:
        assert (await http.get("/v1/models")).status_code == 401
        assert (await http.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})).status_code == 200
    shards = tmp_path / "state" / "shards"
    assert (shards / "keyed" / "state.json").stat().st_mode & 0o777 == 0o600
    assert shards.stat().st_mode & 0o777 == 0o700 and (shards / "keyed").stat().st_mode & 0o777 == 0o700
    await sup.stop_shard("keyed", grace=10)
    await rec.wait_state(ShardState.STOPPED)
