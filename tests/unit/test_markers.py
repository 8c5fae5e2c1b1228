"""Which marked engines an agent adopts and which it stops (llmgw.node.markers.match_marked)."""

from __future__ import annotations

from llmgw.node.markers import MarkedEngine, marker_env, match_marked
from llmgw.node.process import ProcessIdentity
from llmgw.node.shard_state import ShardRecord
from llmgw.spec import ShardSpec


def record(shard_id: str, identity: ProcessIdentity | None = None, failed: bool = False) -> ShardRecord:
    spec = ShardSpec(id=shard_id, model="m", engine="fake", source="/w/m")
    return ShardRecord(spec=spec, port=8000, identity=identity, failed=failed)


def marked(shard_id: str, pid: int, started: float, *cmd: str) -> MarkedEngine:
    return MarkedEngine(shard_id, ProcessIdentity(pid, started, cmd or ("engine", shard_id)))


def test_marker_env_names_the_shard_and_the_absolute_state_dir() -> None:
    env = marker_env("state", "s1")  # type: ignore[arg-type]
    assert env["LLMGW_SHARD_ID"] == "s1" and env["LLMGW_STATE_DIR"].endswith("/state")
    assert env["LLMGW_STATE_DIR"].startswith("/")


def test_record_without_pid_adopts_the_oldest_and_the_rest_are_stopped() -> None:
    records = [record("s1")]
    old, young = marked("s1", 10, 100.0), marked("s1", 20, 200.0)
    assert match_marked(records, [old, young]) == [young]
    assert records[0].identity == old.identity


def test_the_engine_the_record_names_is_kept_and_its_current_cmdline_taken() -> None:
    named = ProcessIdentity(20, 200.0, ("engine", "before-retitle"))
    records = [record("s1", named)]
    old, young = marked("s1", 10, 100.0), marked("s1", 20, 200.0, "engine", "retitled")
    assert match_marked(records, [old, young]) == [old]
    assert records[0].identity == young.identity


def test_engines_of_no_record_or_of_a_failed_shard_are_stopped() -> None:
    records = [record("failed", failed=True), record("ok", ProcessIdentity(30, 300.0, ("x",)))]
    orphan, stray = marked("gone", 10, 100.0), marked("failed", 20, 200.0)
    assert match_marked(records, [orphan, stray]) == [orphan, stray]
    assert records[1].identity == ProcessIdentity(30, 300.0, ("x",))  # unmarked (older agent): left as is
