"""This node's NVIDIA GPUs, MIG instances included, read from NVML or from ``nvidia-smi``.

:func:`read_gpu_inventory` is the entry point: NVML first, ``nvidia-smi`` when NVML
cannot load, and an empty :class:`GpuInventory` with a note (never an exception) on a
node without NVIDIA cards. The parsers and the NVML reader are pure and take their
inputs as parameters, so tests feed them recorded output and stand-ins.
"""

from __future__ import annotations

from llmgw.node.gpus.discover import read_gpu_inventory
from llmgw.node.gpus.inventory import (
    GpuCard,
    GpuInventory,
    GpuProcess,
    GpuUnit,
    MigInstance,
    display_name,
    gpu_class,
    mig_class,
    placement_index,
)

__all__ = [
    "GpuCard",
    "GpuInventory",
    "GpuProcess",
    "GpuUnit",
    "MigInstance",
    "display_name",
    "gpu_class",
    "mig_class",
    "placement_index",
    "read_gpu_inventory",
]
