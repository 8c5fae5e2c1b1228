"""Discovery: node id, route address, hardware (NVML faked; the no-NVML path for real)."""

from __future__ import annotations

import socket
import sys
import types

import psutil
import pytest

from llmgw.node import discovery
from llmgw.spec import Hardware

GIB = 1024**3


class FakeNVMLError(Exception):
    pass


class FakeMemory:
    def __init__(self, total: int, free: int) -> None:
        self.total, self.free, self.used = total, free, total - free


def fake_pynvml(gpus: list[tuple[str, str, int, int]], *, fail_init: str | None = None, fail_at: int | None = None):
    """Returns a module shaped like nvidia-ml-py's pynvml, serving ``gpus`` (uuid, name, total, free bytes)."""
    mod = types.ModuleType("pynvml")
    mod.calls = []  # type: ignore[attr-defined]

    def nvmlInit() -> None:
        mod.calls.append("init")
        if fail_init:
            raise FakeNVMLError(fail_init)

    def nvmlShutdown() -> None:
        mod.calls.append("shutdown")

    def nvmlDeviceGetCount() -> int:
        return len(gpus)

    def nvmlDeviceGetHandleByIndex(index: int) -> int:
        if index == fail_at:
            raise FakeNVMLError("GPU is lost")
        return index

    mod.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    mod.nvmlInit = nvmlInit  # type: ignore[attr-defined]
    mod.nvmlShutdown = nvmlShutdown  # type: ignore[attr-defined]
    mod.nvmlDeviceGetCount = nvmlDeviceGetCount  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByIndex = nvmlDeviceGetHandleByIndex  # type: ignore[attr-defined]
    mod.nvmlDeviceGetUUID = lambda h: gpus[h][0]  # type: ignore[attr-defined]
    mod.nvmlDeviceGetName = lambda h: gpus[h][1]  # type: ignore[attr-defined]
    mod.nvmlDeviceGetMemoryInfo = lambda h: FakeMemory(gpus[h][2], gpus[h][3])  # type: ignore[attr-defined]
    return mod


H100 = ("GPU-5f8c1a3e-7b2d-4c9e-a1f0-3d6b8e2c4a91", "NVIDIA H100 80GB HBM3", 81559 * 1024 * 1024, 80910 * 1024 * 1024)
H200 = (
    "GPU-0b7e9d21-44c3-4f8a-9e6d-1c2b3a4d5e6f",
    b"NVIDIA H200",  # older bindings return bytes
    143771 * 1024 * 1024,
    1200 * 1024 * 1024,
)


def test_nvml_lists_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = fake_pynvml([H100, H200])
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    hw = discovery.read_hardware()
    assert hw.gpu_note == ""
    assert [(g.index, g.uuid, g.name, g.memory_total_mb, g.memory_free_mb) for g in hw.gpus] == [
        (0, H100[0], "NVIDIA H100 80GB HBM3", 81559, 80910),
        (1, H200[0], "NVIDIA H200", 143771, 1200),
    ]
    assert mod.calls == ["init", "shutdown"]


def test_nvml_init_failure_means_no_gpus_with_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([H100], fail_init="Driver Not Loaded"))
    hw = discovery.read_hardware()
    assert hw.gpus == ()
    assert hw.gpu_note.startswith("no GPUs: ") and "Driver Not Loaded" in hw.gpu_note


def test_nvml_failure_midway_means_no_gpus_and_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = fake_pynvml([H100, H200], fail_at=1)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    hw = discovery.read_hardware()
    assert hw.gpus == () and "GPU is lost" in hw.gpu_note
    assert mod.calls == ["init", "shutdown"]


def test_nvml_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([]))
    hw = discovery.read_hardware()
    assert hw.gpus == () and hw.gpu_note == "no GPUs: the NVIDIA driver reports none"


def test_bindings_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    hw = discovery.read_hardware()
    assert hw.gpus == () and "nvidia-ml-py" in hw.gpu_note


def test_real_machine_hardware() -> None:
    """The real path: CPUs and memory from psutil; GPUs from NVML if this machine has any."""
    hw = discovery.read_hardware()
    assert isinstance(hw, Hardware)
    assert hw.cpu_count == psutil.cpu_count()
    assert hw.memory_total_mb == psutil.virtual_memory().total // (1024 * 1024)
    assert 0 < hw.memory_available_mb <= hw.memory_total_mb
    if hw.gpus:
        assert hw.gpu_note == ""
    else:  # this CI machine: no GPU, so NVML is missing or reports none
        assert hw.gpu_note.startswith("no GPUs: ")


def test_node_id_is_the_host_name() -> None:
    assert discovery.node_id() == socket.gethostname().split(".")[0]


def test_route_address_to_loopback() -> None:
    assert discovery.route_address("127.0.0.1") == "127.0.0.1"
    assert discovery.route_address("localhost") in ("127.0.0.1", "::1")


def test_route_address_unresolvable_host_says_so() -> None:
    with pytest.raises(OSError, match="cannot resolve the control plane host"):
        discovery.route_address("no-such-host.invalid")

