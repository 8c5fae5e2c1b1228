"""The engine argument/environment policy (llmgw/catalog/engine_options.py), family by family."""

from __future__ import annotations

import pytest

from llmgw.catalog import CatalogError, check_engine_args
from llmgw.node.engines import EngineRefused, check_refused
from llmgw.catalog.engine_options import UnsafeSetting, check, llmgw_options, option_name, violations
from llmgw.catalog.engine_options import AGENT_ENV, API_KEY_ENV
from llmgw.sim.config import API_KEY_ENV as SIM_API_KEY_ENV
from llmgw.spec import ShardSpec


def refused(engine: str, args: list[str] = [], env: dict[str, str] = {}) -> list[str]:  # noqa: B006
    return [v.subject for v in violations(engine, args, env)]


@pytest.mark.parametrize(
    "name",
    ["OMP_NUM_THREADS", "KMP_AFFINITY", "MKL_NUM_THREADS", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING",
     "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ATTENTION_BACKEND",
     "TOKENIZERS_PARALLELISM", "PYTORCH_CUDA_ALLOC_CONF"],
)
def test_tuning_families_are_allowed_for_vllm(name: str) -> None:
    assert refused("vllm", env={name: "1"}) == []


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("LD_PRELOAD", "shared libraries"),
        ("LD_LIBRARY_PATH", "shared libraries"),
        ("CUDA_INJECTION64_PATH", "CUDA runtime"),
        ("NCCL_NET_PLUGIN", "plugin"),
        ("NCCL_TUNER_PLUGIN", "plugin"),
        ("VLLM_PLUGINS", "plugin"),
        ("NCCL_TOPO_FILE", "file"),
        ("NCCL_DEBUG_FILE", "file"),
        ("VLLM_CONFIG_ROOT", "directory"),
        ("VLLM_TORCH_PROFILER_DIR", "directory"),
        ("VLLM_LOGGING_CONFIG_PATH", "path"),
        ("VLLM_API_KEY", "credential"),
        ("HF_TOKEN", "credential"),
        ("VLLM_HOST_IP", "address"),
        ("VLLM_PORT", "port"),
        ("PYTHONPATH", "Python code"),
        ("VLLM_ALLOW_INSECURE_SERIALIZATION", "unpickle"),
        ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "agent sets it"),
        ("CUDA_VISIBLE_DEVICES", "agent sets it"),
        ("HF_HOME", "directory"),
        ("HF_HUB_CACHE", "cache directory"),
        ("AWS_SECRET_ACCESS_KEY", "credential"),
        ("HTTPS_PROXY", "address"),
        ("SOMETHING_ELSE", "only tuning variables"),
    ],
)
def test_refused_env_names_say_why(name: str, why: str) -> None:
    (violation,) = violations("vllm", [], {name: "x"})
    assert violation.where == f"engine_env.{name}" and why in violation.reason


def test_llama_arg_variables_are_checked_as_the_flag_they_set() -> None:
    assert refused("llama.cpp", env={"LLAMA_ARG_CTX_SIZE": "4096", "LLAMA_ARG_N_PARALLEL": "2"}) == []
    for name, flag in [("LLAMA_ARG_HOST", "--host"), ("LLAMA_ARG_MODEL", "--model"), ("LLAMA_ARG_RPC", "--rpc")]:
        (v,) = violations("llama.cpp", [], {name: "x"})
        assert f"reads it as {flag} is not allowed" in v.reason
    # The table says which option a variable sets (not always its name), and knows no LLAMA_ARG_LORA.
    assert refused("llama.cpp", env={"LLAMA_ARG_BATCH": "512"}) == []
    (v,) = violations("llama.cpp", [], {"LLAMA_ARG_LORA": "/a.gguf"})
    assert "not an option variable classified for llama.cpp" in v.reason
    assert "LLAMA_ARG_CTX_SIZE" in refused("vllm", env={"LLAMA_ARG_CTX_SIZE": "1"}), "a llama.cpp family only"


def test_engine_families_are_per_engine() -> None:
    assert refused("sglang", env={"SGLANG_ENABLE_TORCH_COMPILE": "1"}) == []
    assert refused("vllm", env={"SGLANG_ENABLE_TORCH_COMPILE": "1"}) == ["SGLANG_ENABLE_TORCH_COMPILE"]
    assert refused("llama.cpp", env={"GGML_CUDA_FORCE_MMQ": "1"}) == []


def test_the_simulator_gets_name_refusals_but_no_family_allowlist() -> None:
    assert refused("sim", env={"ANYTHING": "1", "PLUGINS": "x", "CUDA_VISIBLE_DEVICES": "0"}) == []
    assert refused("sim", env={"LD_PRELOAD": "/x.so", "SIM_PLUGIN": "x"}) == ["LD_PRELOAD", "SIM_PLUGIN"]


@pytest.mark.parametrize(("engine", "name"), sorted(API_KEY_ENV.items()) + [("llama.cpp", "LLAMA_ARG_API_KEY")])
def test_a_profile_cannot_set_the_engine_secret_the_agent_sets(engine: str, name: str) -> None:
    (v,) = violations(engine, [], {name: "guess"})
    assert v.subject == name and v.reason.startswith("not allowed")
    assert name in AGENT_ENV[engine]


def test_the_simulator_reads_the_secret_variable_the_agent_sets() -> None:
    assert API_KEY_ENV["sim"] == SIM_API_KEY_ENV


@pytest.mark.parametrize(
    "arg",
    ["--trust-remote-code", "--log-file=/x", "--slot-save-path", "--tool-parser-plugin", "--middleware",
     "--allowed-local-media-path", "--chat-template", "--lora-modules", "--worker-extension-cls",
     "--ssl-keyfile", "--api-key", "--download-dir"],
)
def test_args_that_read_write_or_load_are_refused(arg: str) -> None:
    v, *_ = violations("vllm", ["--max-model-len", "64", arg, "x"], {})  # after a flag, "x" is refused too
    assert v.where == "engine_args[2]" and v.reason.startswith(arg.split("=")[0] + " is not allowed")


@pytest.mark.parametrize(
    "arg",
    ["--host", "--port", "--model", "--served-model-name", "--kv-events-config", "--prefix-caching-hash-algo",
     "--tensor-parallel-size", "--nnodes", "--headless", "-tp", "-m"],
)
def test_args_the_agent_sets_are_refused(arg: str) -> None:
    v, *_ = violations("vllm", [arg, "1"], {})
    assert v.where == "engine_args[0]" and arg in v.reason


def test_spellings_and_abbreviations_are_caught() -> None:
    assert refused("vllm", ["--trust_remote_code"]) == ["--trust-remote-code"]
    (v,) = violations("vllm", ["--served-model"], {})
    assert "an abbreviation of --served-model-name" in v.reason
    assert refused("vllm", ["--chat-template-content-format", "string", "--tokenizer-mode", "auto"]) == []
    assert refused("vllm", ["--seed", "-1"]) == [], "a negative number is a value, as argparse reads it"
    # Deliberate change (issue 12): a value with no option before it would be vLLM's model.
    assert refused("vllm", ["value"]) == ["value"]


def test_hash_seed_may_be_set_though_it_breaks_kv_routing() -> None:
    assert refused("vllm", env={"PYTHONHASHSEED": "1"}) == [] and refused("sim", env={"PYTHONHASHSEED": "1"}) == []
    assert refused("vllm", env={"PYTHONPATH": "/x"}) == ["PYTHONPATH"]


def test_llmgw_options_are_known_per_engine() -> None:
    assert refused("vllm", ["--llmgw-kv-events"]) == []
    (v,) = violations("vllm", ["--llmgw-typo"], {})
    assert "not an llmgw option for engine 'vllm' (known: --llmgw-kv-events, --llmgw-no-kv-events)" in v.reason
    assert refused("vllm", ["--llmgw-no-kv-events"]) == [] and refused("sim", ["--llmgw-no-kv-events"]) == []
    assert refused("llama.cpp", ["--llmgw-kv-events"]) == ["--llmgw-kv-events"]
    assert llmgw_options("vllm", ["--llmgw-kv-events", "--max-model-len", "64"]) == (
        {"--llmgw-kv-events"}, ["--max-model-len", "64"])


def test_option_name_normalises() -> None:
    assert option_name("--a_b=1") == "--a-b"
    assert option_name("-m") == "-m"
    assert option_name("value") is None


def test_check_lists_every_problem() -> None:
    with pytest.raises(UnsafeSetting) as err:
        check("vllm", ["--port", "1", "--log-file", "x"], {"LD_PRELOAD": "/x"})
    assert [v.subject for v in err.value.violations] == ["--port", "--log-file", "LD_PRELOAD"]


def test_catalog_and_node_apply_the_same_policy() -> None:
    with pytest.raises(CatalogError, match=r"^profile\.engine_args\[1\]: --tool-parser-plugin is not allowed"):
        check_engine_args("vllm", ["--enable-auto-tool-choice", "--tool-parser-plugin", "/p.py"], {})
    spec = ShardSpec(id="m-1", model="m", engine="vllm", source="/w", args=("--tool-parser-plugin", "/p.py"),
                     env={"NCCL_NET_PLUGIN": "x"})
    with pytest.raises(EngineRefused) as err:
        check_refused(spec)
    assert "shard m-1" in str(err.value)
    assert "--tool-parser-plugin" in str(err.value) and "NCCL_NET_PLUGIN" in str(err.value)


def test_the_node_refuses_a_cpu_block_size_with_the_rest_in_one_line() -> None:
    cpu = ShardSpec(id="m-1", model="m", engine="vllm", source="/w", args=("--block-size", "16", "--log-file", "x"),
                    env={"LD_PRELOAD": "/x"})
    with pytest.raises(EngineRefused) as err:
        check_refused(cpu)
    message = str(err.value)
    assert "\n" not in message and message.startswith("shard m-1: refused on this node: ")
    assert all(s in message for s in ("--block-size 16 does not work on a CPU", "--log-file", "LD_PRELOAD"))
    check_refused(ShardSpec(id="m-2", model="m", engine="vllm", source="/w", args=("--block-size", "16"),
                            gpus=(0,)))
