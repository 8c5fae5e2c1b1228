"""The vLLM adapter: argv/env from a shard's profile, multi-node flags, output parsing, install lookup."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from llmgw.node.engines import ENGINES, EngineRefused, get_engine
from llmgw.node.engines.vllm import (
    CPU_BLOCK_SIZE,
    MultiNode,
    VLLM_HASH_SEED,
    VllmEngine,
    parse_vllm_output,
    vllm_argv,
    vllm_env,
)
from llmgw.node.install import python_env
from llmgw.spec import ShardSpec


def spec(*args: str, gpus: tuple[int, ...] = (), cpu_cores: float = 0.0, **env: str) -> ShardSpec:
    return ShardSpec(id="m-1", model="tiny", engine="vllm", source="/w/tiny", args=args, env=env, gpus=gpus,
                     cpu_cores=cpu_cores)


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_cpu_shard_argv() -> None:
    argv = vllm_argv("/env/bin/python", spec("--max-model-len", "512"), "127.0.0.1", 8123)
    assert argv[:3] == ["/env/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert value(argv, "--model") == "/w/tiny" and value(argv, "--served-model-name") == "tiny"
    assert value(argv, "--host") == "127.0.0.1" and value(argv, "--port") == "8123"
    assert value(argv, "--tensor-parallel-size") == "1" and value(argv, "--pipeline-parallel-size") == "1"
    assert value(argv, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert value(argv, "--block-size") == str(CPU_BLOCK_SIZE) and "--enforce-eager" in argv
    assert argv[-2:] == ["--max-model-len", "512"], "the profile's args come last"
    assert "--kv-events-config" not in argv and "--nnodes" not in argv


def test_profile_block_size_and_eager_are_not_repeated() -> None:
    argv = vllm_argv("py", spec("--block-size=64", "--no-enforce-eager"), "h", 1)
    assert "--block-size" not in argv and "--enforce-eager" not in argv and "--block-size=64" in argv


def test_gpu_shard_uses_its_gpus_for_tensor_parallelism() -> None:
    s = spec(gpus=(2, 3))
    argv = vllm_argv("py", s, "h", 1)
    assert value(argv, "--tensor-parallel-size") == "2"
    assert "--block-size" not in argv and "--enforce-eager" not in argv
    env = vllm_env(s)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_cpu_env() -> None:
    env = vllm_env(spec(cpu_cores=2.5))
    assert env["PYTHONHASHSEED"] == VLLM_HASH_SEED
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "2"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    # Without cpu_cores, half the node's CPUs: two engines on every core each run far slower.
    assert vllm_env(spec())["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 2) // 2))
    assert vllm_env(spec(VLLM_CPU_KVCACHE_SPACE="4"))["VLLM_CPU_KVCACHE_SPACE"] == "4", "the profile tunes it"


def test_lora_profile_enables_runtime_loading() -> None:
    s = spec("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
    assert vllm_env(s)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert vllm_argv("py", s, "h", 1)[-5:] == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]


def test_kv_events_by_default_with_the_launch_block_size() -> None:
    engine = VllmEngine(roots=[])
    s = spec()
    config = engine.kv_events_for(s)
    assert config is not None and config.endpoint.startswith("tcp://127.0.0.1:")
    assert config.replay_endpoint.startswith("tcp://127.0.0.1:") and config.replay_endpoint != config.endpoint
    assert config.block_size == 128, "CPU default, which the agent passes"
    assert engine.kv_events_for(spec("--block-size", "64")).block_size == 64
    assert engine.kv_events_for(spec(gpus=(0,))).block_size == 16, "vLLM's GPU default"
    argv = vllm_argv("py", spec("--llmgw-kv-events"), "h", 1, kv_events=config)
    assert "--llmgw-kv-events" not in argv, "llmgw's own option is not passed to vLLM"
    assert json.loads(value(argv, "--kv-events-config")) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": config.endpoint,
        "replay_endpoint": config.replay_endpoint, "topic": "kv",
    }
    assert value(argv, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert vllm_env(s)["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] == "1"
    assert vllm_env(s)["PYTHONHASHSEED"] == "0"


def test_kv_events_opt_out() -> None:
    s = spec("--llmgw-no-kv-events")
    assert VllmEngine(roots=[]).kv_events_for(s) is None
    assert "--llmgw-no-kv-events" not in vllm_argv("py", s, "h", 1)
    assert "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES" not in vllm_env(s)


def test_multi_node_flags() -> None:
    s = spec(gpus=(0, 1, 2, 3))
    head = vllm_argv("py", s, "h", 1, multinode=MultiNode(2, 0, "10.0.0.1", 29500))
    worker = vllm_argv("py", s, "h", 1, multinode=MultiNode(2, 1, "10.0.0.1", 29500))
    for argv in (head, worker):
        assert value(argv, "--nnodes") == "2" and value(argv, "--master-addr") == "10.0.0.1"
        assert value(argv, "--master-port") == "29500"
        assert value(argv, "--tensor-parallel-size") == "4" and value(argv, "--pipeline-parallel-size") == "2"
    assert value(head, "--node-rank") == "0" and "--headless" not in head
    assert value(worker, "--node-rank") == "1" and "--headless" in worker
    with pytest.raises(ValueError):
        MultiNode(1, 0, "a", 1)
    with pytest.raises(ValueError):
        MultiNode(2, 2, "a", 1)


def test_cpu_block_size_must_be_a_multiple_of_32() -> None:
    engine = VllmEngine(roots=[])
    with pytest.raises(EngineRefused, match=r"--block-size 16 does not work on a CPU"):
        engine.check_args(spec("--block-size", "16"))
    engine.check_args(spec("--block-size", "64"))
    engine.check_args(spec("--block-size", "16", gpus=(0,)))
    with pytest.raises(EngineRefused, match="--trust-remote-code"):
        engine.check_args(spec("--trust-remote-code"))


def test_registered_and_not_installed_in_an_empty_root(tmp_path: Path) -> None:
    assert isinstance(get_engine("vllm"), VllmEngine) and "sglang" in ENGINES
    engine = VllmEngine(roots=[tmp_path])
    info = engine.probe()
    assert not info.installed and info.installable
    with pytest.raises(FileNotFoundError, match="vLLM is not installed on this node"):
        engine.argv(spec(), "127.0.0.1", 1)


def fake_env(root: Path, version: str = "0.32.0") -> Path:
    directory = root / "vllm" / f"cpu-{version}"
    (directory / "bin").mkdir(parents=True)
    (directory / "bin" / "python").symlink_to(sys.executable)
    lock = root / "lock.txt"
    lock.write_text("x==1 --hash=sha256:00\n")
    python_env.write_marker(directory, python_env.VLLM, version, False, lock, module_version=version)
    return directory


def test_installed_environment_is_found_by_its_marker(tmp_path: Path) -> None:
    directory = fake_env(tmp_path)
    (tmp_path / "vllm" / ".cpu-0.33.0.partial-1" / "bin").mkdir(parents=True)  # scratch: ignored
    engine = VllmEngine(roots=[tmp_path])
    info = engine.probe()
    assert info.installed and info.version == "0.32.0" and str(directory) in info.detail
    assert engine.argv(spec(), "127.0.0.1", 1)[0] == str(directory / "bin" / "python")
    (directory / python_env.MARKER).unlink()
    assert not engine.probe().installed, "no marker, not installed"


# Recorded from vllm-cpu 0.32.0 serving the tiny test model on this machine (2 cores, no GPU).
RECORDED_CPU = Path(__file__).with_name("vllm_cpu_output.txt")


def test_parse_recorded_cpu_output() -> None:
    compute = parse_vllm_output(RECORDED_CPU.read_text().splitlines())
    assert compute is not None and compute.backend == "CPU" and compute.source == "engine"
    assert [d.name for d in compute.devices] == ["CPU"]
    assert compute.kv_buffer_mb == 1024.0, "VLLM_CPU_KVCACHE_SPACE=1 GiB, as the engine said"
    assert "KV cache: 4,194,304 tokens" in compute.notes
    assert "max concurrency 16384.00x at 256 tokens per request" in compute.notes
    engine = VllmEngine(roots=[])
    assert engine.gpu_failure(compute, spec()) is None
    failure = engine.gpu_failure(compute, spec(gpus=(0,)))
    assert failure is not None and "found no usable GPU" in failure


def test_parse_gpu_output_and_silence() -> None:
    lines = [
        "INFO 01-01 00:00:00 [__init__.py:216] Automatically detected platform cuda.",
        "INFO 01-01 00:00:10 [gpu_model_runner.py:2000] Model loading took 14.9 GiB and 12.3 seconds",
        "INFO 01-01 00:00:20 [gpu_worker.py:300] Available KV cache memory: 98.41 GiB",
        "INFO 01-01 00:00:20 [kv_cache_utils.py:1000] GPU KV cache size: 806,128 tokens",
    ]
    compute = parse_vllm_output(lines)
    assert compute is not None and compute.backend == "CUDA"
    assert compute.model_buffer_mb == pytest.approx(14.9 * 1024) and compute.kv_buffer_mb == pytest.approx(98.41 * 1024)
    assert "KV cache: 806,128 tokens" in compute.notes
    assert VllmEngine(roots=[]).gpu_failure(compute, spec(gpus=(0,))) is None
    assert parse_vllm_output(["nothing useful", ""]) is None
    assert VllmEngine(roots=[]).gpu_failure(None, spec(gpus=(0,))) is None
