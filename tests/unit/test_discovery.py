"""Discovery: node id, route address, hardware (GPUs from recorded nvidia-smi output; this machine for real)."""

from __future__ import annotations

import socket
from pathlib import Path

import psutil
import pytest

from llmgw.node import discovery
from llmgw.node.gpus.inventory import GpuInventory, assemble
from llmgw.node.gpus.nvsmi import combine, parse_list, parse_query_xml
from llmgw.spec import Hardware, gpu_display


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"


def recorded(xml: str, listing: str | None = None) -> GpuInventory:
    """The inventory of a recorded ``nvidia-smi -q -x`` (and ``-L``) output."""
    query = parse_query_xml((FIXTURES / xml).read_text())
    return combine(query, parse_list((FIXTURES / listing).read_text())) if listing else query


def test_whole_cards_are_placed_by_index_with_their_class() -> None:
    hw = discovery.read_hardware(lambda: recorded("telegraf-dual-rtx-a5000.xml"))
    assert hw.gpu_note == "" and hw.driver_version and hw.cuda_version
    assert [(g.index, g.name, g.gpu_class) for g in hw.gpus] == [(0, "NVIDIA RTX A5000", "rtx-a5000-24g"),
                                                                 (1, "NVIDIA RTX A5000", "rtx-a5000-24g")]
    assert all(g.uuid.startswith("GPU-") and 0 <= g.memory_free_mb <= g.memory_total_mb for g in hw.gpus)


def test_a_card_in_mig_mode_is_its_instances() -> None:
    gpus, note = discovery.gpus_of(recorded("telegraf-a100-sxm4-80gb-mig.xml", "telegraf-issue-5812-a100-sxm4-80gb-mig-L.txt"))
    migs = [g for g in gpus if g.index >= 1000]
    assert note == "" and [g.index for g in migs] == [1000, 1001, 1002, 1003]
    assert {g.gpu_class for g in migs} == {"a100-80g-mig-1g.20gb"} and all(g.uuid.startswith("MIG-") for g in migs)
    assert migs[0].name == "NVIDIA A100-SXM4-80GB MIG 1g.20gb" and gpu_display(migs[2].index) == "0/mig2"
    assert [g.index for g in gpus if g.index < 1000] == [1, 2, 3]  # the whole cards beside it


def test_a_card_in_mig_mode_with_nothing_carved_gives_nothing_and_says_why() -> None:
    whole = recorded("telegraf-a100-sxm4-80gb-mig.xml")
    inventory = assemble(whole.cards, (), driver_version=whole.driver_version, cuda_version=whole.cuda_version,
                         source=whole.source, note="")
    gpus, note = discovery.gpus_of(inventory)
    assert gpus == () and note.startswith("no GPUs: ") and "MIG mode with no instance carved" in note


def test_no_nvidia_gpus_says_why() -> None:
    gpus, note = discovery.gpus_of(GpuInventory(note="no NVIDIA GPUs: nvidia-smi is not installed"))
    assert gpus == () and note == "no NVIDIA GPUs: nvidia-smi is not installed"
    assert discovery.gpus_of(GpuInventory(source="nvml")) == ((), "no GPUs: the NVIDIA driver reports none")


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
        assert hw.gpu_note.startswith("no ") and "GPUs: " in hw.gpu_note
    assert hw.arch and hw.os and set(hw.cpu_flags) <= discovery.VECTOR_EXTENSIONS


def test_node_id_is_the_host_name() -> None:
    assert discovery.node_id() == socket.gethostname().split(".")[0]


def test_route_address_to_loopback() -> None:
    assert discovery.route_address("127.0.0.1") == "127.0.0.1"
    assert discovery.route_address("localhost") in ("127.0.0.1", "::1")


def test_route_address_unresolvable_host_says_so() -> None:
    with pytest.raises(OSError, match="cannot resolve the control plane host"):
        discovery.route_address("no-such-host.invalid")

