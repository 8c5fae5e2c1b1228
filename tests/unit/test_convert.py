"""Round trips between llmgw.spec values and the Cap'n Proto schema."""

from llmgw.rpc import convert, schema
from llmgw.spec import Adapter, EngineInfo, GpuInfo, Hardware, ModelSpec, Profile, ShardSpec, ShardState, ShardStatus

s = schema.load()


def roundtrip(struct, data, reader):
    msg = struct.new_message(**data)
    with struct.from_bytes(msg.to_bytes()) as r:
        return reader(r)


def test_hardware_roundtrip():
    hw = Hardware(8, 32000, 16000, (GpuInfo(0, "GPU-1", "NVIDIA H200", 143771, 140000),), "")
    assert roundtrip(s.Hardware, convert.hardware_dict(hw), convert.hardware_from) == hw


def test_shard_spec_and_status_roundtrip():
    spec = ShardSpec("m-1", "m", "sim", "/w", ("--a", "1"), {"X": "1"}, 512, 1.5, (0, 1), api_key="k3y")
    assert roundtrip(s.ShardSpec, convert.shard_spec_dict(spec), convert.shard_spec_from) == spec
    for state in ShardState:
        st = ShardStatus("m-1", state, "http://127.0.0.1:1", 42, 3, "msg", ("a", "b"))
        assert roundtrip(s.ShardStatus, convert.shard_status_dict(st), convert.shard_status_from) == st


def test_model_and_engine_roundtrip():
    m = ModelSpec("m", "sim", "", Profile(2, 100, 0.5, 1, ("--x",), {"A": "b"}))
    assert roundtrip(s.Model, convert.model_dict(m), convert.model_from) == m
    labelled = ModelSpec("m", "sim", "", Profile(node_labels={"rack": "r1", "gpu": "a100"}))
    assert roundtrip(s.Model, convert.model_dict(labelled), convert.model_from) == labelled
    e = EngineInfo("sim", True, "0.1.0", False, "built in")
    assert roundtrip(s.EngineInfo, convert.engine_dict(e), convert.engine_from) == e


def test_model_with_adapters_keeps_variable_names_as_written():
    env = {"OMP_NUM_THREADS": "4", "VLLM_CPU_KVCACHE_SPACE": "8"}
    m = ModelSpec("m", "vllm", "hf://org/repo", Profile(1, 0, 0.0, 0, (), env), (Adapter("m-a", "/a"),), 1)
    data = convert.model_dict(m)
    assert data["profile"]["engineEnv"] == [{"key": k, "value": v} for k, v in sorted(env.items())]
    assert data["maxLoadedAdapters"] == 1
    assert roundtrip(s.Model, data, convert.model_from) == m
