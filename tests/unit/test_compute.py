"""Engine-independent compute reading: fallbacks, persistence, wire format, and the supervisor hook."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import attrs
import pytest
import trio

from llmgw.node import shard_state
from llmgw.node.engines import compute as cm
from llmgw.node.engines.llamacpp import gpu_failure, parse_output
from llmgw.node.gpus.inventory import GpuInventory
from llmgw.node.gpus.nvsmi import read_nvidia_smi
from llmgw.node.shard_state import ShardRecord
from llmgw.node.shard import RestartPolicy
from llmgw.node.supervisor import Supervisor
from llmgw.rpc import convert, schema
from llmgw.spec import Compute, ComputeDevice, EngineInfo, ShardSpec, ShardState, ShardStatus

FAKE_ENGINE = Path(__file__).resolve().parents[1] / "component" / "fake_engine.py"
GPU = Compute(
    backend="CUDA", devices=(ComputeDevice("CUDA0", "NVIDIA H200", 143167, 142410), ComputeDevice("CPU", "Xeon")),
    model_buffer_mb=16319.02, kv_buffer_mb=512.0, layers_offloaded=33, layers_total=33, threads=8, source="engine",
    notes=("loaded 16 tensors from lora file",),
)


def spec(**kw: object) -> ShardSpec:
    base: dict[str, object] = {"id": "s-0", "model": "m", "engine": "fake", "source": "/m.gguf"}
    base.update(kw)
    return ShardSpec(**base)  # type: ignore[arg-type]


def test_nvidia_smi_names_the_gpus_the_process_tree_holds_memory_on() -> None:
    answers = {
        "--query-compute-apps=pid,gpu_uuid,used_memory": "4242, GPU-b, 20480\n9999, GPU-a, 100\n4243, GPU-b, 1024\n",
        "--query-gpu=index,uuid,name,memory.total,memory.free": (
            "0, GPU-a, NVIDIA H200, 143771, 100000\n1, GPU-b, NVIDIA H200, 143771, 120000\n"
        ),
    }
    found = cm.nvidia_smi_compute({4242, 4243}, run=lambda args: answers[args[0]])
    assert found is not None and found.source == "nvidia-smi"
    assert found.devices == (ComputeDevice("GPU1", "NVIDIA H200", 143771, 120000),)
    assert found.notes == ("GPU-b holds 21504 MiB",)
    assert cm.nvidia_smi_compute({1}, run=lambda args: answers[args[0]]) is None


def test_nvidia_smi_failure_is_not_known() -> None:
    def broken(args: object) -> str:
        raise FileNotFoundError("nvidia-smi is not on PATH")

    assert cm.nvidia_smi_compute({1}, run=broken) is None


def test_resolve_prefers_the_engine_then_nvidia_smi_then_cpu() -> None:
    smi = Compute(backend="CUDA", devices=(ComputeDevice("GPU0"),), source="nvidia-smi")
    assert cm.resolve_compute(GPU, spec(gpus=(0,)), os.getpid(), nvidia_smi=lambda p: smi) is GPU
    asked: list[set[int]] = []
    got = cm.resolve_compute(None, spec(gpus=(0,)), os.getpid(), nvidia_smi=lambda p: asked.append(p) or smi)
    assert got is smi and os.getpid() in asked[0]
    assert cm.resolve_compute(None, spec(gpus=(0,)), os.getpid(), nvidia_smi=lambda p: None) == cm.cpu_compute()
    assert cm.resolve_compute(None, spec(), os.getpid(), nvidia_smi=lambda p: pytest.fail("CPU shard")) == cm.cpu_compute()
    assert cm.cpu_compute().summary() == "CPU"


def test_collector_keeps_the_first_lines_until_closed() -> None:
    c = cm.OutputCollector(max_lines=2)
    for line in "abc":
        c.add(line)
    assert c.close() == ["a", "b"]
    c.add("d")
    assert c.lines == ["a", "b"]
    c.reset()
    c.add("e")
    assert c.lines == ["e"]


def test_compute_survives_the_state_file(tmp_path: Path) -> None:
    record = ShardRecord(spec=spec(), port=1234, compute=GPU)
    shard_state.save(tmp_path, record)
    (loaded,) = shard_state.load_all(tmp_path)
    assert loaded.compute == GPU
    shard_state.save(tmp_path, ShardRecord(spec=spec(), port=1))
    assert shard_state.load_all(tmp_path)[0].compute is None


def test_compute_on_the_wire() -> None:
    for compute in (GPU, None, cm.cpu_compute()):
        status = ShardStatus(id="s", state=ShardState.READY, compute=compute)
        msg = schema.load().ShardStatus.new_message(**convert.shard_status_dict(status))
        back = convert.shard_status_from(msg.as_reader())
        assert back == status


def test_summaries() -> None:
    assert GPU.summary() == "CUDA0 H200, 33/33 layers, 16319 MiB model, 512 MiB KV"
    cpu = Compute(backend="CPU", devices=(ComputeDevice("CPU"),), model_buffer_mb=0.4, kv_buffer_mb=0.5)
    assert cpu.summary() == "CPU, 0.4 MiB model, 0.5 MiB KV"


# -- the supervisor hook, with a real process ---------------------------------------------

FAST = RestartPolicy(backoff_initial=0.05, backoff_max=0.2, max_failures=3, health_interval=0.05,
                     health_timeout=2.0, report_timeout=0.5, kill_grace=2.0)
WAIT = 30.0


@attrs.define
class PrintingEngine:
    """fake_engine.py started through sh, which first prints ``preamble`` (llama.cpp's lines)."""

    preamble: tuple[str, ...]
    name: str = "fake"
    health_path: str = "/health"
    startup_timeout: float = 20.0

    def probe(self) -> EngineInfo:
        return EngineInfo(self.name, True, "test")

    def argv(self, s: ShardSpec, host: str, port: int) -> list[str]:
        prints = "; ".join(f"echo {shlex.quote(line)} >&2" for line in self.preamble)
        engine = shlex.join([sys.executable, str(FAKE_ENGINE), "--host", host, "--port", str(port)])
        return ["sh", "-c", f"{prints}; exec {engine}"]

    def env(self, s: ShardSpec) -> dict[str, str]:
        return {}

    def check_args(self, s: ShardSpec) -> None:
        pass

    def parse_output(self, lines: list[str]) -> Compute | None:
        return parse_output(lines)

    def gpu_failure(self, compute: Compute | None, s: ShardSpec) -> str | None:
        return gpu_failure(compute, s)


async def _wait_state(sup: Supervisor, shard_id: str, states: set[ShardState]) -> ShardStatus:
    with trio.fail_after(WAIT):
        while sup.status(shard_id).state not in states:
            await trio.sleep(0.02)
    return sup.status(shard_id)


CPU_LINES = (
    "0.00.001.004 T device_info:",
    "0.00.001.009 T   - CPU     : AMD EPYC 7B13 (24105 MiB, 24105 MiB free)",
    "0.00.012.340 I load_tensors:   CPU_Mapped model buffer size =     0.40 MiB",
    "0.00.020.101 I llama_kv_cache:        CPU KV buffer size =     0.50 MiB",
)


async def test_ready_carries_the_engines_compute_and_persists_it(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, engines={"fake": PrintingEngine(CPU_LINES)}, policy=FAST)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await sup.start_shard(spec(), None)
        status = await _wait_state(sup, "s-0", {ShardState.READY, ShardState.FAILED})
        assert status.state is ShardState.READY
        assert status.compute is not None and status.compute.summary() == "CPU, 0.4 MiB model, 0.5 MiB KV"
        (record,) = shard_state.load_all(tmp_path)
        assert record.compute == status.compute
        await sup.stop_shard("s-0", grace=5)
        nursery.cancel_scope.cancel()


async def test_gpu_shard_whose_engine_found_no_gpu_is_failed_in_its_words(tmp_path: Path) -> None:
    lines = ("warning: no usable GPU found, --gpu-layers option will be ignored", *CPU_LINES)
    sup = Supervisor(tmp_path, engines={"fake": PrintingEngine(lines)}, policy=FAST)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await sup.start_shard(spec(gpus=(0,)), None)
        status = await _wait_state(sup, "s-0", {ShardState.FAILED})
        assert status.message == (
            "GPU 0 given, but llama.cpp says: warning: no usable GPU found, --gpu-layers option will be ignored"
        )
        assert status.pid == 0 and status.restarts == 0  # stopped, never restarted
        assert status.compute is not None and status.compute.backend == "CPU"
        (record,) = shard_state.load_all(tmp_path)
        assert record.failed and record.identity is None
        await sup.stop_shard("s-0", grace=5)
        nursery.cancel_scope.cancel()


# -- a shard given GPUs holds memory on each before it is READY (issue 16) ------------------

T4_QUERY = Path(__file__).resolve().parents[1] / "fixtures" / "gpu-telemetry" / "telegraf-tesla-t4.xml"


def t4_inventory() -> GpuInventory:
    """The recorded T4 (card 0) with its two processes, pids 675 and 5762."""
    text = T4_QUERY.read_text()
    return read_nvidia_smi(lambda argv, timeout: text if "-x" in argv else "")


class GpuEngine:
    name = "gpu-engine"


class NoGpuEngine:
    name = "sim"
    holds_gpu_memory = False


def test_a_shard_holding_memory_on_its_gpu_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The recorded pids are the recording machine's: here 5762 is taken to be in our engine's group.
    monkeypatch.setattr(cm.os, "getpgid", lambda pid: 4242 if pid == 5762 else pid)
    spec = ShardSpec("m-1", "m", "vllm", "/w", (), {}, 0, 0.0, (0,))
    assert cm.unused_gpus(GpuEngine(), spec, 4242, t4_inventory) is None


def test_a_shard_holding_no_memory_on_a_given_gpu_fails_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cm.os, "getpgid", lambda pid: pid)  # every listed process is someone else's
    spec = ShardSpec("m-1", "m", "vllm", "/w", (), {}, 0, 0.0, (0,))
    reason = cm.unused_gpus(GpuEngine(), spec, 4242, t4_inventory)
    assert reason is not None and "holds no memory on GPU 0" in reason and "nvidia-smi" in reason


def test_unknowable_cases_never_fail_a_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ShardSpec("m-1", "m", "vllm", "/w", (), {}, 0, 0.0, (0,))
    assert cm.unused_gpus(NoGpuEngine(), spec, 4242, t4_inventory) is None  # the simulator
    assert cm.unused_gpus(GpuEngine(), spec, 4242, lambda: GpuInventory(note="no NVIDIA GPUs")) is None

    def foreign_namespace(pid: int) -> int:
        raise ProcessLookupError(pid)

    monkeypatch.setattr(cm.os, "getpgid", foreign_namespace)  # a container: no listed pid is here
    assert cm.unused_gpus(GpuEngine(), spec, 4242, t4_inventory) is None
    cpu = ShardSpec("m-1", "m", "vllm", "/w", (), {}, 0, 0.0, ())
    assert cm.unused_gpus(GpuEngine(), cpu, 4242, t4_inventory) is None
