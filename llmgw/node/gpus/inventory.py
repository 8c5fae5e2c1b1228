"""What a node's NVIDIA GPUs are: cards, MIG instances, processes, and the names placement uses.

Plain attrs values and pure helpers; nothing here does I/O. The readers
(:mod:`llmgw.node.gpus.nvml_inventory`, :mod:`llmgw.node.gpus.nvsmi`) fill these in.

Placement numbering: a card not in MIG mode is placed by its own index (``0``, ``1``...);
a MIG instance is placed as ``1000 + 100 * card + n`` and shown as ``card/migN``, where
``n`` is the instance's MIG device index within its card: the ``Device  n`` of
``nvidia-smi -L`` and the ``index`` NVML's ``nvmlDeviceGetMigDeviceHandleByIndex`` takes.
A card in MIG mode is never placed itself, only its instances.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

import attrs

from llmgw.spec import MIG_CARD_STRIDE, MIG_INDEX_BASE, gpu_display as display_name


#: Memory sizes (GB) NVIDIA sells cards with. A card reports a little less than its
#: marketed size (the driver keeps some: an H100 80GB shows 81559 MiB, an H200 143771 MiB,
#: a T4 15360 MiB, an A10G 23028 MiB), so the class takes the smallest of these that is
#: at least the reported GiB. Past the end of the list, the GiB are rounded up.
MARKETED_MEMORY_GB = (
    1, 2, 3, 4, 5, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64,
    80, 94, 96, 128, 141, 180, 192, 288,
)  # fmt: skip

#: Words in a product name that say nothing about which GPU it is: the brand, the
#: product line, and the form factor or memory kind (the size is added from the memory).
_NAME_NOISE = frozenset({"nvidia", "tesla", "geforce", "quadro", "generation"})
_NAME_NOISE_RE = re.compile(r"^(sxm\d*|pcie|nvl|hbm\d*e?|\d+gb)$")


@attrs.frozen
class GpuCard:
    """One physical card as the driver numbers it. Memory figures are None where unknown."""

    index: int
    uuid: str
    name: str
    memory_total_mb: int | None
    memory_used_mb: int | None
    memory_free_mb: int | None
    pci_bus_id: str | None = None  # "00000000:01:00.0"
    mig_mode: bool = False  # MIG is on now: the card is used only through its instances
    mig_pending: bool | None = None  # MIG after the next GPU reset; None: not MIG-capable or unknown


@attrs.frozen
class MigInstance:
    """One MIG device (a compute instance inside a GPU instance) of a card in MIG mode."""

    card: int
    number: int  # the MIG device index within the card: the N of ``card/migN``
    gpu_instance_id: int | None
    compute_instance_id: int | None
    profile: str | None  # "3g.40gb"; None when nvidia-smi -L could not be read
    uuid: str | None  # "MIG-..."; None when nvidia-smi -L could not be read
    memory_total_mb: int | None
    memory_used_mb: int | None

    @property
    def index(self) -> int:
        """Returns this instance's placement index (1000 + 100 x card + number)."""
        return placement_index(self.card, self.number)


@attrs.frozen
class GpuProcess:
    """A process holding memory on a card or on one of its MIG instances."""

    pid: int
    used_memory_mb: int | None  # None where the driver does not say (Windows WDDM, no rights)
    card: int
    mig: int | None = None  # the MIG instance number on ``card``, None for the whole card
    name: str | None = None

    @property
    def where(self) -> str:
        """Returns where it runs as every view shows it: "0" or "0/mig2"."""
        return str(self.card) if self.mig is None else display_name(placement_index(self.card, self.mig))


@attrs.frozen
class GpuUnit:
    """Something placement can put an engine on: a whole card, or one MIG instance."""

    index: int  # placement index: the card index, or 1000 + 100 x card + n
    uuid: str | None  # what CUDA_VISIBLE_DEVICES takes (GPU-... or MIG-...)
    gpu_class: str  # "a100-80g", "a100-80g-mig-3g.40gb"
    memory_total_mb: int | None
    memory_used_mb: int | None

    @property
    def display(self) -> str:
        """Returns the unit's name in every view: "0" or "0/mig2"."""
        return display_name(self.index)


@attrs.frozen
class GpuInventory:
    """Everything known about the node's NVIDIA GPUs at one reading.

    ``source`` is "nvml" or "nvidia-smi" when one of them answered, "" when neither did.
    ``note`` says why there are no GPUs, or what is there but cannot be used; "" when
    all is well. Build one with :func:`assemble` so the note covers unusable cards.
    """

    cards: tuple[GpuCard, ...] = ()
    migs: tuple[MigInstance, ...] = ()
    processes: tuple[GpuProcess, ...] = ()
    driver_version: str | None = None  # "535.54.03"
    cuda_version: str | None = None  # the newest CUDA the driver supports: "12.2"
    source: str = ""
    note: str = ""

    def card(self, index: int) -> GpuCard | None:
        """Returns the card with that index, or None."""
        return next((c for c in self.cards if c.index == index), None)

    def units(self) -> tuple[GpuUnit, ...]:
        """Returns what placement may use: cards not in MIG mode, and every MIG instance.

        A card in MIG mode is left out (only its instances count), so one in MIG mode
        with nothing carved gives nothing; :func:`assemble` says so in ``note``.
        """
        units = []
        for card in self.cards:
            card_class = gpu_class(card.name, card.memory_total_mb)
            if not card.mig_mode:
                units.append(GpuUnit(card.index, card.uuid, card_class, card.memory_total_mb, card.memory_used_mb))
                continue
            for mig in self.migs:
                if mig.card == card.index:
                    units.append(
                        GpuUnit(
                            mig.index,
                            mig.uuid,
                            mig_class(card_class, mig.profile),
                            mig.memory_total_mb,
                            mig.memory_used_mb,
                        )
                    )
        return tuple(units)

    def foreign_processes(self, own_pids: Iterable[int] = ()) -> tuple[GpuProcess, ...]:
        """Returns the processes holding GPU memory whose pid is not in ``own_pids``."""
        own = set(own_pids)
        return tuple(p for p in self.processes if p.pid not in own)


def placement_index(card: int, n: int) -> int:
    """Returns the placement index of MIG instance ``n`` on ``card``: 1000 + 100 x card + n.

    Raises ValueError for a negative card or an ``n`` outside 0..99.
    """
    if card < 0 or not 0 <= n < MIG_CARD_STRIDE:
        raise ValueError(f"no placement index for MIG instance {n} of card {card}")
    return MIG_INDEX_BASE + MIG_CARD_STRIDE * card + n


def gpu_class(name: str, memory_total_mb: int | None) -> str:
    """Returns a card's class: its model in lower case and its marketed memory, "a100-80g".

    The model is the product name without the brand and line ("NVIDIA", "Tesla",
    "GeForce", "Quadro"), the form factor ("SXM4", "PCIe", "NVL"), the memory kind
    ("HBM3") or a size written in it ("80GB"): "NVIDIA A100-SXM4-80GB" -> "a100",
    "NVIDIA GeForce RTX 3080" -> "rtx-3080". The memory is the smallest size in
    :data:`MARKETED_MEMORY_GB` at least the reported MiB / 1024 (81559 MiB -> 80g,
    143771 MiB -> 141g, 15360 MiB -> 16g). With the memory unknown, a size written in the
    name is taken ("A100-SXM4-80GB" -> 80g); with neither, the class is the model alone.
    """
    words = [w for w in re.split(r"[\s\-_/]+", name.lower()) if w]
    words = [re.sub(r"[^a-z0-9.]", "", w) for w in words if w not in _NAME_NOISE and not _NAME_NOISE_RE.match(w)]
    model = "-".join(w for w in words if w) or "gpu"
    if memory_total_mb is not None and memory_total_mb > 0:
        return f"{model}-{marketed_memory_gb(memory_total_mb)}g"
    written = re.search(r"(\d+)GB\b", name, re.IGNORECASE)
    return f"{model}-{int(written[1])}g" if written else model


def marketed_memory_gb(memory_total_mb: int) -> int:
    """Returns the marketed size (GB) of a card reporting ``memory_total_mb`` MiB (see :func:`gpu_class`)."""
    gib = memory_total_mb / 1024
    for size in MARKETED_MEMORY_GB:
        if size >= gib:
            return size
    return math.ceil(gib)


def mig_class(card_class: str, profile: str | None) -> str:
    """Returns a MIG instance's class: the card's class and the profile, "a100-80g-mig-3g.40gb".

    With the profile unknown (nvidia-smi -L unreadable) it is the card's class and "-mig".
    """
    return f"{card_class}-mig" if not profile else f"{card_class}-mig-{profile.lower()}"


def assemble(
    cards: Iterable[GpuCard],
    migs: Iterable[MigInstance] = (),
    processes: Iterable[GpuProcess] = (),
    *,
    driver_version: str | None = None,
    cuda_version: str | None = None,
    source: str = "",
    note: str = "",
) -> GpuInventory:
    """Returns a GpuInventory, sorted, whose note adds what cannot be used and why.

    A card in MIG mode with no instance carved gives "card 0 is in MIG mode with no
    instance carved: nothing can be placed on it"; a pending MIG change is mentioned too.
    The notes are joined with "; " after ``note``.
    """
    cards_t = tuple(sorted(cards, key=lambda c: c.index))
    migs_t = tuple(sorted(migs, key=lambda m: (m.card, m.number)))
    procs_t = tuple(sorted(processes, key=lambda p: (p.card, -1 if p.mig is None else p.mig, p.pid)))
    notes = [note] if note else []
    for card in cards_t:
        if card.mig_mode and not any(m.card == card.index for m in migs_t):
            notes.append(f"card {card.index} is in MIG mode with no instance carved: nothing can be placed on it")
        if card.mig_pending is not None and card.mig_pending != card.mig_mode:
            after = "on" if card.mig_pending else "off"
            notes.append(f"card {card.index}: MIG mode turns {after} at the next GPU reset")
    return GpuInventory(
        cards=cards_t,
        migs=migs_t,
        processes=procs_t,
        driver_version=driver_version or None,
        cuda_version=cuda_version or None,
        source=source,
        note="; ".join(notes),
    )
