"""llama.cpp adapter: argv/env from the profile, argument refusals, output parsing, GPU failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.node.engines import EngineRefused, get_engine
from llmgw.node.engines.llamacpp import LlamaCppEngine, default_threads, gpu_failure, parse_output
from llmgw.spec import Compute, ComputeDevice, ShardSpec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
BINARY = Path("/opt/llama/bin/llama-server")


def spec(**kw: object) -> ShardSpec:
    base: dict[str, object] = {"id": "m-0", "model": "tiny", "engine": "llama.cpp", "source": "/models/tiny.gguf"}
    base.update(kw)
    return ShardSpec(**base)  # type: ignore[arg-type]


def lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


def test_registered_under_the_catalog_name() -> None:
    assert isinstance(get_engine("llama.cpp"), LlamaCppEngine)


def test_argv_cpu_shard_gets_half_the_cpus_and_the_agent_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    argv = LlamaCppEngine(BINARY).argv(spec(args=("-c", "2048", "-np", "2")), "127.0.0.1", 8080)
    assert argv == [str(BINARY), "-m", "/models/tiny.gguf", "--alias", "tiny", "--host", "127.0.0.1",
                    "--port", "8080", "--metrics", "-lv", "4", "-t", "8", "-c", "2048", "-np", "2"]


def test_threads_from_cpu_cores_node_override_and_profile() -> None:
    assert default_threads(spec(cpu_cores=3.0), node_threads=6, cpu_count=16) == 3
    assert default_threads(spec(), node_threads=6, cpu_count=16) == 6
    assert default_threads(spec(), cpu_count=1) == 1
    argv = LlamaCppEngine(BINARY, threads=6).argv(spec(args=("-t", "1")), "h", 1)
    assert argv.count("-t") == 1 and argv[argv.index("-t") + 1] == "1"
    argv = LlamaCppEngine(BINARY).argv(spec(cpu_cores=2.0), "h", 1)
    assert argv[argv.index("-t") + 1] == "2"


def test_gpu_shard_offloads_all_layers_and_sees_only_its_gpus() -> None:
    engine = LlamaCppEngine(BINARY)
    s = spec(gpus=(2, 5))
    argv = engine.argv(s, "h", 1)
    assert argv[argv.index("-ngl") + 1] == "999"
    assert engine.env(s) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,5"}
    assert engine.env(spec())["CUDA_VISIBLE_DEVICES"] == ""  # a CPU shard touches no GPU
    assert "-ngl" not in engine.argv(spec(), "h", 1)
    assert engine.argv(spec(gpus=(0,), args=("-ngl", "10")), "h", 1).count("-ngl") == 1


def test_the_retired_lora_hook_is_refused_with_what_replaced_it() -> None:
    from llmgw.catalog.engine_options import UnsafeSetting, check

    with pytest.raises(UnsafeSetting, match="--adapter NAME=SOURCE"):
        check("llama.cpp", ["--llmgw-lora=/a/x.gguf"], {})


@pytest.mark.parametrize(
    "args, env, needle",
    [
        (("--lora", "/a/x.gguf"), {}, "--lora"),
        (("--port", "1"), {}, "--port"),
        (("-lv", "1"), {}, "-lv"),
        (("--log-disable",), {}, "--log-disable"),
        (("-hf", "org/repo"), {}, "-hf"),
        (("--path", "/etc"), {}, "--path"),
        ((), {"LLAMA_ARG_MODEL": "/x"}, "LLAMA_ARG_MODEL"),
        ((), {"LD_PRELOAD": "/x.so"}, "LD_PRELOAD"),
    ],
)
def test_refused_arguments_are_named(args: tuple[str, ...], env: dict[str, str], needle: str) -> None:
    with pytest.raises(EngineRefused, match=needle.replace("-", r"\-")):
        LlamaCppEngine(BINARY).check_args(spec(args=args, env=env))


def test_not_installed_is_an_oserror_the_supervisor_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr("llmgw.node.install.INSTALL_DIRS", [])
    engine = LlamaCppEngine()
    assert not engine.probe().installed
    with pytest.raises(OSError, match="llama-server is not installed"):
        engine.argv(spec(), "h", 1)


# -- output ---------------------------------------------------------------------------


def test_parse_recorded_cpu_output() -> None:
    compute = parse_output(lines("cpu-b11312.log"))
    assert compute is not None
    assert compute.backend == "CPU" and compute.source == "engine"
    assert [d.name for d in compute.devices] == ["CPU"]
    assert compute.devices[0].memory_total_mb > 0
    assert 0 < compute.model_buffer_mb < 5 and 0 < compute.kv_buffer_mb < 5
    assert compute.layers_offloaded == -1  # a CPU build never prints an offload count
    assert compute.threads == 1
    assert any("from lora file" in n for n in compute.notes)
    assert compute.summary().startswith("CPU, ") and "MiB model" in compute.summary()
    assert gpu_failure(compute, spec()) is None


def test_parse_cuda_output_from_the_source_formats() -> None:
    compute = parse_output(lines("gpu-cuda-b11312.log"))
    assert compute is not None
    assert compute.backend == "CUDA"
    assert compute.devices[0] == ComputeDevice("CUDA0", "NVIDIA H200", 143167, 142410)
    assert [d.name for d in compute.devices] == ["CUDA0", "CPU"]
    assert (compute.layers_offloaded, compute.layers_total) == (33, 33)
    assert compute.model_buffer_mb == pytest.approx(15317.02 + 1002.0)
    assert compute.kv_buffer_mb == pytest.approx(512.0)
    assert compute.threads == 8
    assert compute.summary() == "CUDA0 H200, 33/33 layers, 16319 MiB model, 512 MiB KV"
    assert gpu_failure(compute, spec(gpus=(0,))) is None


def test_gpu_shard_on_a_cpu_only_build_fails_in_the_engines_words() -> None:
    compute = parse_output(lines("gpu-none-b11312.log"))
    assert compute is not None and compute.backend == "CPU"
    reason = gpu_failure(compute, spec(gpus=(0,)))
    assert reason == "GPU 0 given, but llama.cpp says: warning: no usable GPU found, --gpu-layers option will be ignored"
    assert gpu_failure(compute, spec()) is None  # a CPU shard is fine with that


def test_zero_layers_offloaded_fails_a_gpu_shard() -> None:
    text = [line.replace("offloaded 33/33", "offloaded 0/33") for line in lines("gpu-cuda-b11312.log")]
    compute = parse_output(text)
    assert compute is not None and compute.backend == "CPU"
    assert gpu_failure(compute, spec(gpus=(1,))) == "GPU 1 given, but llama.cpp says: offloaded 0/33 layers to GPU"


def test_device_list_without_gpu_fails_a_gpu_shard() -> None:
    text = [line for line in lines("gpu-none-b11312.log") if not line.startswith("warning")]
    reason = gpu_failure(parse_output(text), spec(gpus=(0,)))
    assert reason is not None and "lists no GPU device (devices: CPU (AMD EPYC 7B13))" in reason


def test_silent_output_gives_none_and_never_fails() -> None:
    assert parse_output(["0.00.000.001 I srv  llama_server: model loaded", "random text"]) is None
    assert gpu_failure(None, spec(gpus=(0,))) is None
    smi = Compute(backend="CUDA", devices=(ComputeDevice("GPU0"),), source="nvidia-smi")
    assert gpu_failure(smi, spec(gpus=(0,))) is None
