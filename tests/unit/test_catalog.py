"""Catalog validation: valid inputs, each error message, and the round trip through model_to_dict."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.catalog import CatalogError, check_engine_args, model_to_dict, namespace_conflict, validate_model
from llmgw.spec import Adapter, ModelSpec, Profile


def base(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"name": "qwen-0.5b", "engine": "llama.cpp", "source": "/models/qwen.gguf"}
    data.update(overrides)
    return data


def error_of(data: Any) -> str:
    with pytest.raises(CatalogError) as info:
        validate_model(data)
    return str(info.value)


# -- valid input ---------------------------------------------------------------------------


def test_minimal_model_takes_profile_defaults() -> None:
    assert validate_model(base()) == ModelSpec("qwen-0.5b", "llama.cpp", "/models/qwen.gguf", Profile())


def test_full_model() -> None:
    spec = validate_model(
        base(
            engine="vllm",
            profile={
                "replicas": 0,
                "memory_mb": 8192,
                "cpu_cores": 2,
                "gpus": 1,
                "engine_args": ["--max-model-len", "4096"],
                "engine_env": {"VLLM_USE_V1": "1"},
            },
        )
    )
    assert spec.profile == Profile(
        replicas=0,
        memory_mb=8192,
        cpu_cores=2.0,
        gpus=1,
        engine_args=("--max-model-len", "4096"),
        engine_env={"VLLM_USE_V1": "1"},
    )
    assert isinstance(spec.profile.cpu_cores, float)


@pytest.mark.parametrize("source", [None, "", "anything at all", "relative/path"])
def test_sim_source_is_free_form(source: str | None) -> None:
    data = {"name": "sim-1", "engine": "sim"}
    if source is not None:
        data["source"] = source
    assert validate_model(data).source == (source or "")


@pytest.mark.parametrize("name", ["a", "0", "qwen2.5-7b_instruct", "a" * 63])
def test_valid_names(name: str) -> None:
    assert validate_model(base(name=name)).name == name


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "model: must be a mapping, got []"),
        ({"engine": "sim"}, "name: required"),
        (base(name="Qwen"), "name: must match [a-z0-9][a-z0-9._-]{0,62}, got 'Qwen'"),
        (base(name="-x"), "name: must match [a-z0-9][a-z0-9._-]{0,62}, got '-x'"),
        (base(name="a" * 64), "name: must match [a-z0-9][a-z0-9._-]{0,62}"),
        (base(name=7), "name: must be a string, got 7"),
        ({"name": "x"}, "engine: required: one of llama.cpp, sglang, sim, vllm"),
        (base(engine="vlm"), "engine: unknown engine 'vlm' (known: llama.cpp, sglang, sim, vllm)"),
        ({"name": "x", "engine": "vllm"}, "source: required"),
        (base(source="models/q.gguf"), "source: must be an absolute local path, an http(s) URL or hf://org/repo[@rev] for engine 'llama.cpp', got 'models/q.gguf'"),
        (base(source=""), "source: must be an absolute local path, an http(s) URL or hf://org/repo[@rev] for engine 'llama.cpp', got ''"),
        (base(sorce="/x"), "sorce: unknown key (did you mean 'source'?)"),
        (base(colour="red"), "colour: unknown key (known: adapters, engine, max_loaded_adapters, name, profile, source)"),
        (base(profile=[1]), "profile: must be a mapping, got [1]"),
        (base(profile={"replica": 2}), "profile.replica: unknown key (did you mean 'replicas'?)"),
        (base(profile={"replicas": -1}), "profile.replicas: must be an integer >= 0, got -1"),
        (base(profile={"replicas": "2"}), "profile.replicas: must be an integer >= 0, got '2'"),
        (base(profile={"replicas": True}), "profile.replicas: must be an integer >= 0, got True"),
        (base(profile={"replicas": 1.5}), "profile.replicas: must be an integer >= 0, got 1.5"),
        (base(profile={"memory_mb": -5}), "profile.memory_mb: must be an integer >= 0, got -5"),
        (base(profile={"gpus": None}), "profile.gpus: must be an integer >= 0, got None"),
        (base(profile={"cpu_cores": -0.5}), "profile.cpu_cores: must be a number >= 0, got -0.5"),
        (base(profile={"cpu_cores": float("nan")}), "profile.cpu_cores: must be a number >= 0, got nan"),
        (base(profile={"engine_args": "--ctx 4096"}), "profile.engine_args: must be a list of strings, got '--ctx 4096'"),
        (base(profile={"engine_args": ["-c", 4096]}), "profile.engine_args[1]: must be a string, got 4096"),
        (base(profile={"engine_env": ["A=1"]}), "profile.engine_env: must be a mapping of variable names to strings, got ['A=1']"),
        (base(profile={"engine_env": {"A-B": "1"}}), "profile.engine_env.A-B: not a valid environment variable name"),
        (base(profile={"engine_env": {"A": 1}}), "profile.engine_env.A: must be a string, got 1"),
    ],
)
def test_error_messages(data: Any, message: str) -> None:
    assert error_of(data).startswith(message)


def test_catalog_error_carries_path_and_reason() -> None:
    with pytest.raises(CatalogError) as info:
        validate_model(base(profile={"gpus": -2}))
    assert (info.value.path, info.value.reason) == ("profile.gpus", "must be an integer >= 0, got -2")
    assert isinstance(info.value, ValueError)


# -- dangerous engine arguments and environment ----------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trust-remote-code"], "profile.engine_args[0]: --trust-remote-code is not allowed"),
        (["-c", "4096", "--trust-remote-code=true"], "profile.engine_args[2]: --trust-remote-code is not allowed"),
        (["--trust_remote_code"], "profile.engine_args[0]: --trust-remote-code is not allowed"),
        # llama-server matches names exactly: what its table does not know is refused as unclassified.
        (["--trust-remote"], "profile.engine_args[0]: --trust-remote is not allowed: it is not classified for llama.cpp"),
        (["--log-file", "/etc/passwd"], "profile.engine_args[0]: --log-file is not allowed"),
        (["--tr"], "profile.engine_args[0]: --tr is not allowed: it is not classified for llama.cpp"),
        (["--log-f=x"], "profile.engine_args[0]: --log-f is not allowed: it is not classified for llama.cpp"),
        (["--slot-save-path=/tmp"], "profile.engine_args[0]: --slot-save-path is not allowed"),
    ],
)
def test_dangerous_args_are_refused(args: list[str], message: str) -> None:
    assert error_of(base(profile={"engine_args": args})).startswith(message)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("LD_PRELOAD", "profile.engine_env.LD_PRELOAD: not allowed"),
        ("LD_LIBRARY_PATH", "profile.engine_env.LD_LIBRARY_PATH: not allowed"),
        ("CUDA_INJECTION64_PATH", "profile.engine_env.CUDA_INJECTION64_PATH: not allowed"),
        ("VLLM_PLUGIN", "profile.engine_env.VLLM_PLUGIN: not allowed"),
        ("GGML_BACKEND_PLUGIN", "profile.engine_env.GGML_BACKEND_PLUGIN: not allowed"),
    ],
)
def test_dangerous_env_is_refused(name: str, message: str) -> None:
    assert error_of(base(profile={"engine_env": {name: "/x.so"}})).startswith(message)


def test_harmless_args_pass() -> None:
    check_engine_args(
        "vllm",
        ["--log-level", "DEBUG", "--max-model-len", "4096", "--max-num-seqs", "4", "--enable-lora"],
        {"OMP_NUM_THREADS": "4", "VLLM_CPU_KVCACHE_SPACE": "2", "NCCL_DEBUG": "INFO"},
    )


def test_path_and_code_loading_settings_are_refused_since_the_allowlist() -> None:
    # Deliberate change (issue 4): engine env is an allowlist of tuning families, and
    # options that load code or that the agent sets are refused.
    assert error_of(base(profile={"engine_env": {"HF_HOME": "/h"}})).startswith("profile.engine_env.HF_HOME: not allowed")
    assert error_of(base(profile={"engine_args": ["--logits-processors", "x"]})).startswith(
        "profile.engine_args[0]: --logits-processors is not allowed"
    )


def test_check_engine_args_path_prefix() -> None:
    with pytest.raises(CatalogError, match=r"^shard\.engine_args\[0\]: --log-file"):
        check_engine_args("llama.cpp", ["--log-file=x"], {}, path="shard")


def test_every_refused_setting_is_named_at_once() -> None:
    message = error_of(base(engine="vllm", source="/w", profile={
        "engine_args": ["--max-model-len", "64", "--log-file", "x"],
        "engine_env": {"OMP_NUM_THREADS": "1", "LD_PRELOAD": "/x", "HF_TOKEN": "t", "VLLM_PLUGINS": "p"},
    }))
    assert message.startswith("profile.engine_args[2]: --log-file is not allowed")
    for where in ("engine_env.LD_PRELOAD", "engine_env.HF_TOKEN", "engine_env.VLLM_PLUGINS"):
        assert f"profile.{where}: not allowed" in message
    assert "OMP_NUM_THREADS" not in message and "\n" not in message


#: (engine, profile.gpus, engine_args, refusal or None): what an engine refuses on every
#: device, or on the only device kind the profile can run on, is refused by the catalog.
DEVICE_CASES = [
    ("vllm", 0, ["--block-size", "16"], "profile.engine_args[0]: --block-size 16 does not work on a CPU"),
    ("vllm", 0, ["--block_size=48"], "profile.engine_args[0]: --block-size 48 does not work on a CPU"),
    ("vllm", 0, ["--block-size", "64"], None),
    ("vllm", 1, ["--block-size", "16"], None),
    ("vllm", 1, ["--block-size", "x"], "profile.engine_args[0]: --block-size x is not a positive integer"),
    ("vllm", 1, ["--block-size=0"], "profile.engine_args[0]: --block-size 0 is not a positive integer"),
    ("sim", 0, ["--block-size", "-4"], "profile.engine_args[0]: --block-size -4 is not a positive integer"),
    ("sim", 0, ["--block-size", "16"], None),
    ("llama.cpp", 0, ["--batch-size", "16"], None),
]


@pytest.mark.parametrize(("engine", "gpus", "args", "refusal"), DEVICE_CASES)
def test_values_an_engine_refuses_on_the_profiles_device_are_refused(
    engine: str, gpus: int, args: list[str], refusal: str | None
) -> None:
    data = base(engine=engine, source="/w", profile={"gpus": gpus, "engine_args": args})
    if refusal is None:
        validate_model(data)
    else:
        assert error_of(data).startswith(refusal)


# -- round trip ----------------------------------------------------------------------------


def test_model_to_dict_is_plain_data() -> None:
    spec = validate_model(base(profile={"engine_args": ["-c", "2048"], "engine_env": {"OMP_NUM_THREADS": "1"}}))
    assert model_to_dict(spec) == {
        "name": "qwen-0.5b",
        "engine": "llama.cpp",
        "source": "/models/qwen.gguf",
        "profile": {
            "replicas": 1,
            "memory_mb": 0,
            "cpu_cores": 0.0,
            "gpus": 0,
            "engine_args": ["-c", "2048"],
            "engine_env": {"OMP_NUM_THREADS": "1"},
        },
        "adapters": [],
        "max_loaded_adapters": 0,
    }


#: A safe option of each engine that takes any one value (the round trip gives it random text).
_VALUE_OPTION = {"sim": "--kv-topic", "llama.cpp": "--tags", "vllm": "--response-role", "sglang": "--tool-call-parser"}
_names = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,62}", fullmatch=True)
_counts = st.integers(min_value=0, max_value=10**6)
_safe_text = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-=./ ", max_size=20)


@given(
    name=_names,
    engine=st.sampled_from(["sim", "llama.cpp", "vllm", "sglang"]),
    path=_safe_text,
    replicas=_counts,
    memory_mb=_counts,
    cpu_cores=st.floats(min_value=0, max_value=512, allow_nan=False),
    gpus=st.integers(min_value=0, max_value=8),
    values=st.lists(_safe_text.filter(lambda a: not a.startswith("-")), max_size=4),
    env=st.dictionaries(st.sampled_from(["OMP_NUM_THREADS", "CUDA_LAUNCH_BLOCKING", "NCCL_DEBUG", "MKL_NUM_THREADS"]),
                        _safe_text, max_size=3),
)
def test_round_trip(
    name: str,
    engine: str,
    path: str,
    replicas: int,
    memory_mb: int,
    cpu_cores: float,
    gpus: int,
    values: list[str],
    env: dict[str, str],
) -> None:
    source = path if engine == "sim" else "/" + path
    args = [a for v in values for a in (_VALUE_OPTION[engine], v)]
    spec = ModelSpec(name, engine, source, Profile(replicas, memory_mb, cpu_cores, gpus, tuple(args), env))
    data = model_to_dict(spec)
    assert validate_model(data) == spec
    assert model_to_dict(validate_model(data)) == data


def test_remote_weights_sources_are_accepted_and_checked() -> None:
    for source in ("hf://Qwen/Qwen2.5-0.5B-Instruct", "hf://org/repo@v1.0", "https://example.org/m.gguf",
                   "https://huggingface.co/org/repo"):
        assert validate_model({"name": "m", "engine": "vllm", "source": source}).source == source
    with pytest.raises(CatalogError, match="64 hex digits"):
        validate_model({"name": "m", "engine": "llama.cpp", "source": "https://example.org/m.gguf#sha256=zz"})


# -- LoRA adapters -------------------------------------------------------------------------


def test_adapters_are_validated_and_round_trip() -> None:
    spec = validate_model(base(engine="vllm", adapters=[{"name": "sql", "source": "hf://org/sql-lora@v2"},
                                                         {"name": "chat", "source": "/adapters/chat"}],
                               max_loaded_adapters=1))
    assert spec.adapters == (Adapter("sql", "hf://org/sql-lora@v2"), Adapter("chat", "/adapters/chat"))
    assert spec.max_loaded_adapters == 1
    assert validate_model(model_to_dict(spec)) == spec


def test_llamacpp_adapters_load_at_start() -> None:
    spec = validate_model(base(adapters=[{"name": "sql", "source": "https://h/sql.gguf"}]))
    assert spec.adapters == (Adapter("sql", "https://h/sql.gguf"),) and spec.max_loaded_adapters == 0


def test_sim_adapter_source_is_a_label() -> None:
    spec = validate_model({"name": "s", "engine": "sim", "adapters": [{"name": "a", "source": "anything"}],
                           "max_loaded_adapters": 1})
    assert spec.adapters == (Adapter("a", "anything"),)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (base(adapters="sql"), "adapters: must be a list of {name, source} mappings"),
        (base(adapters=["sql"]), "adapters[0]: must be a mapping with name and source"),
        (base(adapters=[{"name": "sql"}]), "adapters[0].source: required"),
        (base(adapters=[{"source": "/a"}]), "adapters[0].name: required"),
        (base(adapters=[{"name": "SQL", "source": "/a"}]), "adapters[0].name: must match"),
        (base(adapters=[{"name": "sql", "source": "/a", "rank": 8}]), "adapters[0].rank: unknown key"),
        (base(adapters=[{"name": "qwen-0.5b", "source": "/a"}]),
         "adapters[0].name: 'qwen-0.5b' is the model's own name; adapter names share the model namespace"),
        (base(adapters=[{"name": "a", "source": "/a"}, {"name": "a", "source": "/b"}]),
         "adapters[1].name: adapter 'a' is listed twice"),
        (base(adapters=[{"name": "a", "source": "rel/a.gguf"}]),
         "adapters[0].source: must be an absolute local path, an http(s) URL or hf://org/repo[@rev] "
         "for an adapter of engine 'llama.cpp'"),
        (base(adapters=[{"name": "a", "source": "hf://bad repo"}]), "adapters[0].source: weights source"),
        (base(engine="sglang", adapters=[{"name": "a", "source": "/a"}]),
         "adapters: engine 'sglang' does not serve LoRA adapters through llmgw"),
        (base(adapters=[{"name": "a", "source": "/a"}], max_loaded_adapters=1),
         "max_loaded_adapters: engine 'llama.cpp' loads every adapter at start and cannot swap them"),
        (base(engine="vllm", max_loaded_adapters=2), "max_loaded_adapters: the model has no adapters"),
        (base(engine="vllm", adapters=[{"name": "a", "source": "/a"}], max_loaded_adapters=-1),
         "max_loaded_adapters: must be an integer >= 0, got -1"),
        ({"name": "s", "engine": "sim", "adapters": [{"name": "a", "source": ""}]},
         "adapters[0].source: must be a non-empty string"),
    ],
)
def test_adapter_errors(data: Any, message: str) -> None:
    assert error_of(data).startswith(message)


def test_namespace_conflicts_with_other_entries() -> None:
    others = [ModelSpec("base", "vllm", "/m", adapters=(Adapter("sql", "/a"),)), ModelSpec("plain", "sim", "")]
    assert namespace_conflict(ModelSpec("sql", "sim", ""), others) == (
        "model name 'sql' is already taken by an adapter of model 'base' "
        "(model and adapter names share one namespace): choose another name"
    )
    with_plain = ModelSpec("new", "vllm", "/m", adapters=(Adapter("ok", "/a"), Adapter("plain", "/b")))
    assert "adapter name 'plain' is already taken by model 'plain'" in (namespace_conflict(with_plain, others) or "")
    # The entry being replaced does not clash with itself.
    assert namespace_conflict(ModelSpec("base", "vllm", "/m", adapters=(Adapter("sql", "/b"),)), others) is None


def test_node_labels_are_checked_and_round_trip_only_when_set() -> None:
    spec = validate_model({"name": "m", "engine": "sim", "profile": {"node_labels": {"rack": "r1", "tier": 2}}})
    assert dict(spec.profile.node_labels) == {"rack": "r1", "tier": "2"}
    assert model_to_dict(spec)["profile"]["node_labels"] == {"rack": "r1", "tier": "2"}
    assert validate_model(model_to_dict(spec)) == spec
    assert "node_labels" not in model_to_dict(validate_model({"name": "m", "engine": "sim"}))["profile"]
    with pytest.raises(CatalogError, match=r"^profile\.node_labels: 'a b' cannot be a label key"):
        validate_model({"name": "m", "engine": "sim", "profile": {"node_labels": {"a b": "x"}}})


def test_a_gpu_class_is_checked_and_a_mig_class_takes_exactly_one_instance() -> None:
    spec = validate_model({"name": "m", "engine": "vllm", "source": "/w/m",
                           "profile": {"gpus": 1, "gpu_class": "a100-80g-mig-3g.40gb"}})
    assert spec.profile.gpu_class == "a100-80g-mig-3g.40gb" and validate_model(model_to_dict(spec)) == spec
    with pytest.raises(CatalogError, match=r"^profile\.gpus: a replica on a MIG class .* gpus must be 1, got 2"):
        validate_model({"name": "m", "engine": "vllm", "source": "/w/m",
                        "profile": {"gpus": 2, "gpu_class": "a100-80g-mig-3g.40gb"}})
    with pytest.raises(CatalogError, match=r"^profile\.engine_args\[0\]: --tensor-parallel-size is not allowed"):
        validate_model({"name": "m", "engine": "vllm", "source": "/w/m",
                        "profile": {"gpus": 1, "gpu_class": "a100-80g-mig-3g.40gb",
                                    "engine_args": ["--tensor-parallel-size=2"]}})
    with pytest.raises(CatalogError, match=r"^profile\.gpu_class: expected a GPU class"):
        validate_model({"name": "m", "engine": "vllm", "source": "/w/m", "profile": {"gpus": 1, "gpu_class": "A100!"}})
    with pytest.raises(CatalogError, match=r"^profile\.gpu_class: a GPU class \(h100-80g\) needs gpus of 1 or more"):
        validate_model({"name": "m", "engine": "vllm", "source": "/w/m", "profile": {"gpu_class": "h100-80g"}})
