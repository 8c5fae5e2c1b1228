"""GPU inventory: nvidia-smi parsers on recorded output, NVML through a stand-in, MIG on both.

The recorded outputs and where they come from are in tests/fixtures/nvidia-smi/SOURCES.md.
The NVML stand-ins serve the figures of the same recorded machines, written out here from
the fixtures, so the two paths must give equal inventories.
"""

from __future__ import annotations

import subprocess
import types
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
import pytest

from llmgw.node.gpus import (
    GpuInventory,
    GpuProcess,
    display_name,
    gpu_class,
    mig_class,
    placement_index,
    read_gpu_inventory,
)
from llmgw.node.gpus.nvml_inventory import read_nvml
from llmgw.node.gpus.nvsmi import NVIDIA_SMI_TIMEOUT_S, combine, parse_list, parse_query_xml, read_nvidia_smi

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
MIB = 1024 * 1024

A100_XML = "telegraf-a100-sxm4-80gb-mig.xml"
A100_LIST = "telegraf-issue-5812-a100-sxm4-80gb-mig-L.txt"
A5000_XML = "telegraf-dual-rtx-a5000.xml"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def a100_list_card0() -> str:
    """The -L lines of GPU 0: the recorded -q -x of that machine kept GPU 0 only."""
    return "".join(fixture(A100_LIST).splitlines(keepends=True)[:5])


# --- the recorded machines, figures copied from the fixtures -------------------------------

A100_CARD0 = "GPU-513536b6-7d19-9063-b049-1e69664bb298"
A100_MIG_UUIDS = (
    "MIG-ce861fb0-a248-58ce-a9a8-f9adbc22a66a",
    "MIG-a45882f0-9215-5733-a0c1-49286ab31cb5",
    "MIG-f00d722c-f4e1-52c9-aa31-750441ae1bfe",
    "MIG-930574a9-d43a-5d2b-95da-3e68384c8d6b",
)
A5000_UUIDS = ("GPU-12345678-aaaa-bbbb-cccc-0123456789ab", "GPU-12345678-aaaa-bbbb-cccc-0123456789cd")
LLAMA_SERVER = "/root/src/llama.cpp/build/bin/llama-server"


@attrs.define
class FakeMig:
    uuid: str
    name: str
    gpu_instance_id: int
    compute_instance_id: int
    memory: tuple[int, int, int]  # total, used, free in MiB
    processes: list[tuple[int, int | None, str]] = attrs.Factory(list)  # pid, MiB, name


@attrs.define
class FakeCard:
    uuid: str
    name: str
    memory: tuple[int, int, int]
    bus_id: str
    mig_mode: tuple[int, int] | None  # None: not MIG-capable
    migs: dict[int, FakeMig] = attrs.Factory(dict)  # slot -> device; other slots are empty
    processes: list[tuple[int, int | None, str]] = attrs.Factory(list)


def a100_machine() -> list[FakeCard]:
    """GPU 0 of the recorded A100-SXM4-80GB machine (telegraf a100-sxm4-v12.xml + issue 5812 -L)."""
    migs = {
        n: FakeMig(uuid, "NVIDIA A100-SXM4-80GB MIG 1g.20gb", 3 + n, 0, (19968, 12, 19955))
        for n, uuid in enumerate(A100_MIG_UUIDS)
    }
    return [FakeCard(A100_CARD0, "NVIDIA A100-SXM4-80GB", (81920, 50, 80999), "00000000:01:00.0", (1, 1), migs)]


def a5000_machine() -> list[FakeCard]:
    """The recorded dual RTX A5000 machine (telegraf dual_a5000-v13.xml)."""
    return [
        FakeCard(A5000_UUIDS[0], "NVIDIA RTX A5000", (24564, 22437, 1678), "00000000:81:00.0", None,
                 processes=[(100477, 22430, LLAMA_SERVER)]),
        FakeCard(A5000_UUIDS[1], "NVIDIA RTX A5000", (24564, 17253, 6862), "00000000:C1:00.0", None,
                 processes=[(100477, 17246, LLAMA_SERVER)]),
    ]  # fmt: skip


class FakeNVMLError(Exception):
    pass


class NVMLError_NotFound(FakeNVMLError):  # noqa: N801 (pynvml's spelling)
    pass


class NVMLError_NotSupported(FakeNVMLError):  # noqa: N801
    pass


def fake_pynvml(
    cards: list[FakeCard],
    *,
    driver: str,
    cuda: int,
    fail_init: str | None = None,
    fail_mig_handle: bool = False,
) -> Any:
    """Returns a module shaped like nvidia-ml-py's pynvml (names and return shapes as in its source)."""
    mod = types.ModuleType("pynvml")
    mod.calls = []  # type: ignore[attr-defined]

    def card_of(handle: tuple) -> FakeCard:
        return cards[handle[1]]

    def dev(handle: tuple) -> FakeCard | FakeMig:
        return cards[handle[1]] if handle[0] == "card" else cards[handle[1]].migs[handle[2]]

    def memory(handle: tuple) -> Any:
        total, used, free = dev(handle).memory
        return types.SimpleNamespace(total=total * MIB, used=used * MIB, free=free * MIB)

    def nvmlInit() -> None:
        mod.calls.append("init")
        if fail_init:
            raise FakeNVMLError(fail_init)

    def nvmlShutdown() -> None:
        mod.calls.append("shutdown")

    def nvmlDeviceGetMigMode(handle: tuple) -> list[int]:
        mode = card_of(handle).mig_mode
        if mode is None:
            raise NVMLError_NotSupported("Not Supported")
        return list(mode)

    def nvmlDeviceGetMigDeviceHandleByIndex(handle: tuple, index: int) -> tuple:
        if fail_mig_handle:
            raise FakeNVMLError("GPU is lost")
        if index not in card_of(handle).migs:
            raise NVMLError_NotFound("Not Found")
        return ("mig", handle[1], index)

    def running(handle: tuple) -> list[Any]:
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=None if mib is None else mib * MIB,
                                      gpuInstanceId=0, computeInstanceId=0)
                for pid, mib, _ in dev(handle).processes]  # fmt: skip

    names = {pid: name for card in cards for holder in (card, *card.migs.values()) for pid, _, name in holder.processes}
    mod.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    mod.NVMLError_NotFound = NVMLError_NotFound  # type: ignore[attr-defined]
    mod.NVMLError_NotSupported = NVMLError_NotSupported  # type: ignore[attr-defined]
    mod.nvmlInit = nvmlInit  # type: ignore[attr-defined]
    mod.nvmlShutdown = nvmlShutdown  # type: ignore[attr-defined]
    mod.nvmlSystemGetDriverVersion = lambda: driver  # type: ignore[attr-defined]
    mod.nvmlSystemGetCudaDriverVersion = lambda: cuda  # type: ignore[attr-defined]
    mod.nvmlSystemGetProcessName = lambda pid: names[pid]  # type: ignore[attr-defined]
    mod.nvmlDeviceGetCount = lambda: len(cards)  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByIndex = lambda i: ("card", i)  # type: ignore[attr-defined]
    mod.nvmlDeviceGetUUID = lambda h: dev(h).uuid  # type: ignore[attr-defined]
    mod.nvmlDeviceGetName = lambda h: dev(h).name.encode()  # older bindings return bytes  # type: ignore[attr-defined]
    mod.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    mod.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=card_of(h).bus_id)  # type: ignore[attr-defined]
    mod.nvmlDeviceGetMigMode = nvmlDeviceGetMigMode  # type: ignore[attr-defined]
    mod.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7  # an A100 holds at most 7  # type: ignore[attr-defined]
    mod.nvmlDeviceGetMigDeviceHandleByIndex = nvmlDeviceGetMigDeviceHandleByIndex  # type: ignore[attr-defined]
    mod.nvmlDeviceGetGpuInstanceId = lambda h: dev(h).gpu_instance_id  # type: ignore[attr-defined]
    mod.nvmlDeviceGetComputeInstanceId = lambda h: dev(h).compute_instance_id  # type: ignore[attr-defined]
    mod.nvmlDeviceGetComputeRunningProcesses = running  # type: ignore[attr-defined]
    mod.nvmlDeviceGetGraphicsRunningProcesses = lambda h: []  # type: ignore[attr-defined]
    return mod


def smi_runner(answers: dict[str, str | Exception]) -> Callable[[Sequence[str], float], str]:
    """Returns a stand-in for running nvidia-smi: answers["-q -x"], answers["-L"] (text or an exception to raise)."""
    calls: list[tuple[tuple[str, ...], float]] = []

    def run(argv: Sequence[str], timeout: float) -> str:
        calls.append((tuple(argv), timeout))
        answer = answers[" ".join(argv[1:])]
        if isinstance(answer, Exception):
            raise answer
        return answer

    run.calls = calls  # type: ignore[attr-defined]
    return run


def not_found() -> FileNotFoundError:
    return FileNotFoundError(2, "No such file or directory", "nvidia-smi")


# --- nvidia-smi -q -x on every recorded log --------------------------------------------------

XML_EXPECTED = {
    A5000_XML: dict(
        driver="590.44.01",
        cuda="13.1",
        cards=[
            (A5000_UUIDS[0], "NVIDIA RTX A5000", 24564, 22437, 1678, "00000000:81:00.0", False, None),
            (A5000_UUIDS[1], "NVIDIA RTX A5000", 24564, 17253, 6862, "00000000:C1:00.0", False, None),
        ],
        migs=[],
        processes=[(100477, 22430, 0, None, LLAMA_SERVER), (100477, 17246, 1, None, LLAMA_SERVER)],
    ),
    A100_XML: dict(
        driver="535.54.03",
        cuda="12.2",
        cards=[(A100_CARD0, "NVIDIA A100-SXM4-80GB", 81920, 50, 80999, "00000000:01:00.0", True, True)],
        migs=[(0, 0, 3, 0, 19968, 12), (0, 1, 4, 0, 19968, 12), (0, 2, 5, 0, 19968, 12), (0, 3, 6, 0, 19968, 12)],
        processes=[],
    ),
    "netdata-a100-sxm4-40gb-mig.xml": dict(
        driver="510.47.03",
        cuda="11.6",
        cards=[
            ("GPU-27b94a00-ed54-5c24-b1fd-1054085de32a", "NVIDIA A100-SXM4-40GB", 40960, 38, 40315,
             "00000000:00:04.0", True, True),
        ],  # fmt: skip
        migs=[(0, 0, 1, 0, 19968, 19), (0, 1, 2, 0, 19968, 19)],
        processes=[],
    ),
    "telegraf-tesla-t4.xml": dict(
        driver="515.105.01",
        cuda="11.7",
        cards=[("GPU-d37e67a5-91dd-3774-a5cb-99096249601a", "Tesla T4", 15360, 1032, 13939, "00000000:00:1E.0", False, None)],
        migs=[],
        processes=[(675, 22, 0, None, "/usr/lib/xorg/Xorg"), (5762, 1005, 0, None, "python")],
    ),
    "telegraf-gtx-1070-ti.xml": dict(
        driver=None,  # this old, trimmed log has no versions, no MIG section, no processes
        cuda=None,
        cards=[("GPU-f9ba66fc-a7f5-94c5-da19-019ef2f9c665", "GeForce GTX 1070 Ti", 4096, 42, 4054, "00000000:01:00.0", False, None)],
        migs=[],
        processes=[],
    ),
}


def test_every_xml_fixture_is_covered() -> None:
    assert sorted(XML_EXPECTED) == sorted(p.name for p in FIXTURES.glob("*.xml"))


@pytest.mark.parametrize("name", sorted(XML_EXPECTED))
def test_parse_query_xml_reads_the_recorded_log(name: str) -> None:
    want = XML_EXPECTED[name]
    inv = parse_query_xml(fixture(name))
    assert (inv.driver_version, inv.cuda_version, inv.source) == (want["driver"], want["cuda"], "nvidia-smi")
    assert [
        (c.uuid, c.name, c.memory_total_mb, c.memory_used_mb, c.memory_free_mb, c.pci_bus_id, c.mig_mode, c.mig_pending)
        for c in inv.cards
    ] == want["cards"]
    assert [c.index for c in inv.cards] == list(range(len(want["cards"])))
    assert [
        (m.card, m.number, m.gpu_instance_id, m.compute_instance_id, m.memory_total_mb, m.memory_used_mb)
        for m in inv.migs
    ] == want["migs"]
    assert all(m.uuid is None and m.profile is None for m in inv.migs)  # the XML has neither
    assert [(p.pid, p.used_memory_mb, p.card, p.mig, p.name) for p in inv.processes] == want["processes"]


# --- nvidia-smi -L on every recorded listing -------------------------------------------------

LIST_EXPECTED = {
    A100_LIST: dict(
        cards=[
            (0, A100_CARD0, "NVIDIA A100-SXM4-80GB", True),
            (1, "GPU-d8594bd4-0fc3-8595-e355-7c98138f3b95", "NVIDIA A100-SXM4-80GB", False),
            (2, "GPU-5e375e7e-b41f-155b-dcdc-534524c356fc", "NVIDIA A100-SXM4-80GB", False),
            (3, "GPU-69ec2344-ebac-b028-f88f-452abb3d7f11", "NVIDIA A100-SXM4-80GB", False),
        ],
        migs=[(0, n, "1g.20gb", uuid) for n, uuid in enumerate(A100_MIG_UUIDS)],
    ),
    "nvidia-container-toolkit-issue-203-a100-80gb-pcie-mig-L.txt": dict(
        cards=[(0, "GPU-932bfb2c-849a-2a22-1e84-9eff6bc02b39", "NVIDIA A100 80GB PCIe", True)],
        migs=[
            (0, 0, "3g.40gb", "MIG-0929581a-2be6-5dec-bf34-0954c6c529a6"),
            (0, 1, "3g.40gb", "MIG-3adbed3a-d03d-549f-a016-ba1fd7359f23"),
        ],
    ),
    "datadog-agent-pr-33120-a100-sxm4-80gb-mig-L.txt": dict(
        cards=[(0, "GPU-7fdaf0a5-179b-f636-d15d-daf243e3ff16", "NVIDIA A100-SXM4-80GB", True)],
        migs=[
            (0, 0, "1g.10gb", "MIG-feb88891-0321-5fef-9c87-d4af3b54259e"),
            (0, 1, "1g.10gb", "MIG-a25704ba-3a06-5299-a795-fd7cf4d13973"),
            (0, 2, "1g.10gb", "MIG-50f1c4c9-1508-5e8d-bb06-d08145b22e01"),
            (0, 3, "1g.10gb", "MIG-36c795f2-5cf7-55d6-af30-e535e79b7bb6"),
            (0, 4, "1g.10gb", "MIG-3f45d38c-8cee-503e-b806-a1f1bdceedeb"),
            (0, 5, "1g.10gb", "MIG-96655de9-9525-58f9-a62b-0e4c1cc1c265"),
            (0, 6, "1g.10gb", "MIG-1aae4990-b962-574e-8375-119d6d9b9687"),
        ],
    ),
}


def test_every_list_fixture_is_covered() -> None:
    assert sorted(LIST_EXPECTED) == sorted(p.name for p in FIXTURES.glob("*.txt"))


@pytest.mark.parametrize("name", sorted(LIST_EXPECTED))
def test_parse_list_reads_the_recorded_listing(name: str) -> None:
    want = LIST_EXPECTED[name]
    cards, migs = parse_list(fixture(name))
    assert [(c.index, c.uuid, c.name, c.mig_mode) for c in cards] == want["cards"]
    assert all(c.memory_total_mb is None for c in cards)
    assert [(m.card, m.number, m.profile, m.uuid) for m in migs] == want["migs"]


def test_parse_list_skips_other_lines_and_refuses_an_orphan_mig_line() -> None:
    assert parse_list("No devices were found\n") == ((), ())
    with pytest.raises(ValueError, match="before any GPU"):
        parse_list(fixture(A100_LIST).split("\n", 1)[1])


# --- MIG on the nvidia-smi path --------------------------------------------------------------


def test_nvidia_smi_mig_machine_is_placed_by_its_instances() -> None:
    run = smi_runner({"-q -x": fixture(A100_XML), "-L": fixture(A100_LIST)})
    inv = read_nvidia_smi(run)
    assert [call[0] for call in run.calls] == [("nvidia-smi", "-q", "-x"), ("nvidia-smi", "-L")]  # type: ignore[attr-defined]
    assert all(call[1] == NVIDIA_SMI_TIMEOUT_S for call in run.calls)  # type: ignore[attr-defined]
    assert inv.source == "nvidia-smi" and inv.note == ""
    assert [(m.number, m.gpu_instance_id, m.uuid, m.profile, m.memory_total_mb) for m in inv.migs] == [
        (n, 3 + n, uuid, "1g.20gb", 19968) for n, uuid in enumerate(A100_MIG_UUIDS)
    ]
    units = inv.units()
    # Card 0 (MIG mode) is placed only through its 4 instances; cards 1-3 (only in -L) as themselves.
    assert [(u.index, u.display, u.uuid, u.gpu_class) for u in units[:4]] == [
        (1000 + n, f"0/mig{n}", uuid, "a100-80g-mig-1g.20gb") for n, uuid in enumerate(A100_MIG_UUIDS)
    ]
    assert [(u.index, u.display, u.gpu_class, u.memory_total_mb) for u in units[4:]] == [
        (1, "1", "a100-80g", None),
        (2, "2", "a100-80g", None),
        (3, "3", "a100-80g", None),
    ]


def test_nvidia_smi_without_the_listing_keeps_instances_without_uuid_or_profile() -> None:
    run = smi_runner({"-q -x": fixture(A100_XML), "-L": subprocess.CalledProcessError(9, ["nvidia-smi", "-L"])})
    inv = read_nvidia_smi(run)
    assert inv.source == "nvidia-smi"
    assert inv.note == "nvidia-smi -L failed (exit status 9): MIG instances lack UUID and profile"
    assert [(u.display, u.uuid, u.gpu_class, u.memory_total_mb) for u in inv.units()] == [
        (f"0/mig{n}", None, "a100-80g-mig", 19968) for n in range(4)
    ]


def with_mig_process(xml: str) -> str:
    """The recorded A100 log plus one process on GPU instance 5 (MIG device 2).

    No published MIG log with processes was found; the added block has the shape
    nvidia-smi gives process_info (see the recorded T4 and A5000 logs), with the GPU and
    compute instance ids filled in as nvidia-smi does on a card in MIG mode.
    """
    block = (
        "<processes>\n<process_info>\n<gpu_instance_id>5</gpu_instance_id>\n"
        "<compute_instance_id>0</compute_instance_id>\n<pid>4242</pid>\n<type>C</type>\n"
        "<process_name>python3</process_name>\n<used_memory>9807 MiB</used_memory>\n</process_info>\n</processes>"
    )
    assert xml.count("<processes />") == 1  # the recorded log's empty process list
    return xml.replace("<processes />", block)


def test_a_process_on_a_mig_instance_is_reported_there() -> None:
    inv = read_nvidia_smi(smi_runner({"-q -x": with_mig_process(fixture(A100_XML)), "-L": a100_list_card0()}))
    assert inv.processes == (GpuProcess(4242, 9807, 0, 2, "python3"),)
    assert inv.processes[0].where == "0/mig2"
    assert inv.foreign_processes(own_pids=[4242]) == ()
    assert inv.foreign_processes(own_pids=[1]) == inv.processes


# --- both paths agree on the same recorded machine -------------------------------------------


def test_nvml_and_nvidia_smi_agree_on_the_recorded_mig_machine() -> None:
    nvml = fake_pynvml(a100_machine(), driver="535.54.03", cuda=12020)
    from_nvml = read_nvml(nvml)
    from_smi = read_nvidia_smi(smi_runner({"-q -x": fixture(A100_XML), "-L": a100_list_card0()}))
    assert nvml.calls == ["init", "shutdown"]
    assert from_nvml.source == "nvml" and from_smi.source == "nvidia-smi"
    assert attrs.evolve(from_nvml, source="") == attrs.evolve(from_smi, source="")
    assert len(from_nvml.migs) == 4 and from_nvml.cuda_version == "12.2"


def test_nvml_and_nvidia_smi_agree_on_the_recorded_dual_card_machine() -> None:
    from_nvml = read_nvml(fake_pynvml(a5000_machine(), driver="590.44.01", cuda=13010))
    # No -L was recorded for this machine; on cards without MIG the XML alone suffices.
    from_smi = read_nvidia_smi(smi_runner({"-q -x": fixture(A5000_XML), "-L": subprocess.CalledProcessError(1, "x")}))
    assert attrs.evolve(from_nvml, source="") == attrs.evolve(from_smi, source="")
    assert [(p.pid, p.used_memory_mb, p.where) for p in from_nvml.processes] == [(100477, 22430, "0"), (100477, 17246, "1")]
    assert [u.gpu_class for u in from_nvml.units()] == ["rtx-a5000-24g", "rtx-a5000-24g"]


def test_nvml_and_nvidia_smi_agree_on_a_process_in_a_mig_instance() -> None:
    cards = a100_machine()
    cards[0].migs[2].processes.append((4242, 9807, "python3"))
    from_nvml = read_nvml(fake_pynvml(cards, driver="535.54.03", cuda=12020))
    from_smi = read_nvidia_smi(smi_runner({"-q -x": with_mig_process(fixture(A100_XML)), "-L": a100_list_card0()}))
    assert from_nvml.processes == (GpuProcess(4242, 9807, 0, 2, "python3"),)
    assert attrs.evolve(from_nvml, source="") == attrs.evolve(from_smi, source="")


# --- a card in MIG mode with nothing carved --------------------------------------------------

NOTHING_CARVED = "card 0 is in MIG mode with no instance carved: nothing can be placed on it"


def test_mig_card_with_no_instance_is_left_out_with_the_reason_on_both_paths() -> None:
    cards = a100_machine()
    cards[0].migs.clear()
    from_nvml = read_nvml(fake_pynvml(cards, driver="535.54.03", cuda=12020))
    # The recorded log with its mig_devices emptied the way nvidia-smi prints "none".
    xml = fixture(A100_XML)
    start, end = xml.index("<mig_devices>"), xml.index("</mig_devices>")
    xml = xml[:start] + "<mig_devices>\n            None\n        " + xml[end:]
    from_smi = read_nvidia_smi(smi_runner({"-q -x": xml, "-L": a100_list_card0().split("\n", 1)[0] + "\n"}))
    for inv in (from_nvml, from_smi):
        assert inv.note == NOTHING_CARVED
        assert inv.units() == ()
        assert [(c.index, c.mig_mode) for c in inv.cards] == [(0, True)]


def test_a_pending_mig_change_is_noted() -> None:
    xml = fixture(A100_XML).replace("<pending_mig>Enabled</pending_mig>", "<pending_mig>Disabled</pending_mig>")
    inv = read_nvidia_smi(smi_runner({"-q -x": xml, "-L": a100_list_card0()}))
    assert inv.cards[0].mig_pending is False
    assert inv.note == "card 0: MIG mode turns off at the next GPU reset"
    assert len(inv.units()) == 4  # MIG is on until then


# --- N/A and missing fields ------------------------------------------------------------------


def test_na_figures_become_none_never_zero() -> None:
    xml = (
        fixture("telegraf-tesla-t4.xml")
        .replace("<used_memory>22 MiB</used_memory>", "<used_memory>N/A</used_memory>")
        .replace("<used>1032 MiB</used>", "<used>N/A</used>")
    )
    inv = parse_query_xml(xml)
    assert inv.cards[0].memory_used_mb is None
    assert inv.cards[0].memory_total_mb == 15360
    assert [(p.pid, p.used_memory_mb) for p in inv.processes] == [(675, None), (5762, 1005)]


def test_fields_missing_from_an_old_log_are_none() -> None:
    inv = read_nvidia_smi(smi_runner({"-q -x": fixture("telegraf-gtx-1070-ti.xml"), "-L": not_found()}))
    assert (inv.driver_version, inv.cuda_version) == (None, None)
    assert inv.cards[0].mig_pending is None and inv.cards[0].mig_mode is False
    assert inv.note == ""


# --- nvidia-smi missing or broken ------------------------------------------------------------


def test_missing_nvidia_smi_is_an_empty_inventory_with_a_note() -> None:
    inv = read_nvidia_smi(smi_runner({"-q -x": not_found()}))
    assert inv == GpuInventory(note="nvidia-smi is not installed")


@pytest.mark.parametrize(
    "answer, note",
    [
        (fixture(A100_XML)[:5000], "nvidia-smi -q -x failed: nvidia-smi -q -x gave unreadable XML"),
        ("<html><body>proxy error</body></html>", "nvidia-smi -q -x failed: nvidia-smi -q -x gave <html>"),
        (
            subprocess.CalledProcessError(
                9,
                ["nvidia-smi", "-q", "-x"],
                output="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\nMake sure...\n",
            ),
            "nvidia-smi -q -x failed: exit status 9: NVIDIA-SMI has failed because it couldn't communicate",
        ),
        (subprocess.TimeoutExpired(["nvidia-smi"], NVIDIA_SMI_TIMEOUT_S), "nvidia-smi -q -x failed: no answer within 10 s"),
    ],
)
def test_failing_or_garbled_nvidia_smi_is_an_empty_inventory_with_the_reason(answer: Any, note: str) -> None:
    inv = read_nvidia_smi(smi_runner({"-q -x": answer}))
    assert (inv.cards, inv.migs, inv.source) == ((), (), "")
    assert inv.note.startswith(note)


# --- read_gpu_inventory: NVML first, nvidia-smi second ---------------------------------------


def test_nvml_is_used_when_it_answers() -> None:
    nvml = fake_pynvml(a5000_machine(), driver="590.44.01", cuda=13010)
    run = smi_runner({})
    inv = read_gpu_inventory(import_nvml=lambda: nvml, run=run)
    assert inv.source == "nvml" and len(inv.cards) == 2
    assert run.calls == []  # type: ignore[attr-defined]


def test_nvml_init_failure_falls_back_to_nvidia_smi() -> None:
    nvml = fake_pynvml([], driver="", cuda=0, fail_init="Driver Not Loaded")
    inv = read_gpu_inventory(
        import_nvml=lambda: nvml, run=smi_runner({"-q -x": fixture(A100_XML), "-L": a100_list_card0()})
    )
    assert inv.source == "nvidia-smi"
    assert len(inv.units()) == 4
    assert inv.note == "NVML passed over: NVML is not available (Driver Not Loaded)"
    assert nvml.calls == ["init"]


def test_nvml_failing_while_listing_falls_back_too_and_shuts_nvml_down() -> None:
    nvml = fake_pynvml(a100_machine(), driver="535.54.03", cuda=12020, fail_mig_handle=True)
    assert read_nvml(nvml) == GpuInventory(note="NVML failed while listing GPUs (GPU is lost)")
    assert nvml.calls == ["init", "shutdown"]
    inv = read_gpu_inventory(
        import_nvml=lambda: nvml, run=smi_runner({"-q -x": fixture(A100_XML), "-L": a100_list_card0()})
    )
    assert inv.source == "nvidia-smi"


def test_no_nvml_and_no_nvidia_smi_is_a_node_without_cards() -> None:
    def no_pynvml() -> Any:
        raise ImportError("No module named 'pynvml'")

    inv = read_gpu_inventory(import_nvml=no_pynvml, run=smi_runner({"-q -x": not_found()}))
    assert (inv.cards, inv.source) == ((), "")
    assert inv.note == (
        "no NVIDIA GPUs: the NVML Python bindings (nvidia-ml-py) cannot be imported "
        "(No module named 'pynvml'); nvidia-smi is not installed"
    )


def test_nvml_with_no_cards_says_so() -> None:
    inv = read_nvml(fake_pynvml([], driver="550.54.14", cuda=12040))
    assert (inv.source, inv.cards, inv.driver_version, inv.cuda_version) == ("nvml", (), "550.54.14", "12.4")
    assert inv.note == "no NVIDIA GPUs: the NVIDIA driver reports none"


# --- classes, placement numbers, display -----------------------------------------------------


@pytest.mark.parametrize(
    "name, memory_mb, want",
    [
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-80g"),  # telegraf a100-sxm4-v12.xml
        ("NVIDIA A100-SXM4-40GB", 40960, "a100-40g"),  # netdata a100-sxm4-mig.xml
        ("NVIDIA H100 80GB HBM3", 81559, "h100-80g"),
        ("NVIDIA H200", 143771, "h200-141g"),
        ("Tesla T4", 15360, "t4-16g"),  # telegraf tesla-t4.xml
        ("NVIDIA A10G", 23028, "a10g-24g"),
        ("NVIDIA RTX A5000", 24564, "rtx-a5000-24g"),  # telegraf dual_a5000-v13.xml
        ("GeForce GTX 1070 Ti", 4096, "gtx-1070-ti-4g"),  # telegraf gtx-1070-ti.xml
        ("NVIDIA RTX 4000 SFF Ada Generation", 20475, "rtx-4000-sff-ada-20g"),
        ("NVIDIA A100 80GB PCIe", None, "a100-80g"),  # -L only: the size written in the name
        ("Graphics Device", None, "graphics-device"),
        ("NVIDIA B200", 300_000, "b200-293g"),  # past the marketed list: GiB rounded up
    ],
)
def test_gpu_class(name: str, memory_mb: int | None, want: str) -> None:
    assert gpu_class(name, memory_mb) == want


def test_mig_class() -> None:
    assert mig_class("a100-80g", "3g.40gb") == "a100-80g-mig-3g.40gb"
    assert mig_class("h100-80g", "1g.10gb+me") == "h100-80g-mig-1g.10gb+me"
    assert mig_class("a100-80g", None) == "a100-80g-mig"


def test_placement_numbers_and_display() -> None:
    assert placement_index(0, 0) == 1000
    assert placement_index(1, 2) == 1102
    assert placement_index(7, 6) == 1706
    assert [display_name(i) for i in (0, 3, 999, 1000, 1102, 1706)] == ["0", "3", "999", "0/mig0", "1/mig2", "7/mig6"]
    for card, n in ((0, 100), (0, -1), (-1, 0)):
        with pytest.raises(ValueError):
            placement_index(card, n)


def test_combine_renumbers_cards_by_the_listing() -> None:
    """Cards are numbered as -L numbers them even where the XML lists them in another order."""
    query = parse_query_xml(fixture(A5000_XML))
    listing = f"GPU 0: NVIDIA RTX A5000 (UUID: {A5000_UUIDS[1]})\nGPU 1: NVIDIA RTX A5000 (UUID: {A5000_UUIDS[0]})\n"
    inv = combine(query, parse_list(listing))
    assert [(c.index, c.uuid, c.memory_used_mb) for c in inv.cards] == [(0, A5000_UUIDS[1], 17253), (1, A5000_UUIDS[0], 22437)]
    assert [(p.card, p.used_memory_mb) for p in inv.processes] == [(0, 17246), (1, 22430)]
