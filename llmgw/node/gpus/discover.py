"""This node's GPU inventory: NVML first, ``nvidia-smi`` when NVML cannot give one."""

from __future__ import annotations

import importlib
from typing import Any, Callable

import attrs

from llmgw.node.gpus.inventory import GpuInventory
from llmgw.node.gpus.nvml_inventory import read_nvml
from llmgw.node.gpus.nvsmi import Runner, read_nvidia_smi, run_nvidia_smi


def import_pynvml() -> Any:
    """Returns nvidia-ml-py's ``pynvml`` module; raises ImportError where it is not installed."""
    return importlib.import_module("pynvml")


def read_gpu_inventory(
    import_nvml: Callable[[], Any] = import_pynvml,
    run: Runner = run_nvidia_smi,
) -> GpuInventory:
    """Returns this node's NVIDIA GPUs. Never raises.

    NVML answers first; where its bindings are missing or it fails, ``nvidia-smi`` is
    asked (run through ``run``), and the note keeps why NVML was passed over. Where
    neither answers the node has no NVIDIA cards: an empty inventory, source "", whose
    note starts "no NVIDIA GPUs: " and gives both reasons. That is a node without
    cards, not a failed discovery.
    """
    try:
        nvml = import_nvml()
    except Exception as exc:
        why_not_nvml = f"the NVML Python bindings (nvidia-ml-py) cannot be imported ({exc})"
    else:
        inventory = read_nvml(nvml)
        if inventory.source:
            return inventory
        why_not_nvml = inventory.note
    inventory = read_nvidia_smi(run)
    if inventory.source:
        note = f"NVML passed over: {why_not_nvml}"
        return attrs.evolve(inventory, note=f"{inventory.note}; {note}" if inventory.note else note)
    return GpuInventory(note=f"no NVIDIA GPUs: {why_not_nvml}; {inventory.note}")
