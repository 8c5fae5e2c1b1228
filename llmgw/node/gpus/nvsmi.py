"""GPUs from the ``nvidia-smi`` program: the second path, for when NVML cannot load.

``nvidia-smi -q -x`` gives the cards, their memory, MIG mode, each MIG device's GPU and
compute instance ids and memory, and the processes; ``nvidia-smi -L`` gives what the XML
lacks: each MIG device's UUID and profile ("MIG 3g.40gb     Device  0: (UUID: MIG-...)").
The parsers are pure; :func:`read_nvidia_smi` runs the program and never raises.
"""

from __future__ import annotations

import re
import subprocess
import xml.etree.ElementTree as ET
from typing import Callable, Sequence

import attrs

from llmgw.node.gpus.inventory import GpuCard, GpuInventory, GpuProcess, MigInstance, assemble

NVIDIA_SMI = "nvidia-smi"

#: How long one nvidia-smi call may take. Without persistence mode the driver sets each
#: card up anew on every call (seconds on an 8-card node); a driver that hangs (a card
#: fallen off the bus) would otherwise stall discovery for good.
NVIDIA_SMI_TIMEOUT_S = 10.0

#: Runs argv with a timeout (seconds) and returns its standard output. Raises
#: FileNotFoundError when the program is missing, subprocess.CalledProcessError when it
#: exits non-zero, subprocess.TimeoutExpired when it overruns, OSError otherwise.
Runner = Callable[[Sequence[str], float], str]

_LIST_GPU_RE = re.compile(r"^GPU (\d+): (.*?) \(UUID: (GPU-[^)\s]+)\)\s*$")
_LIST_MIG_RE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)\s]+)\)\s*$")
_MIB_RE = re.compile(r"^(\d+)\s*MiB$")


def parse_list(text: str) -> tuple[tuple[GpuCard, ...], tuple[MigInstance, ...]]:
    """Returns (cards, MIG instances) read from ``nvidia-smi -L`` output.

    Cards carry index, name and UUID only (memory None; ``mig_mode`` True where MIG
    devices are listed under them); instances carry card, number (the listed "Device N"),
    profile and UUID only. Lines of any other shape are skipped. Raises ValueError for a
    MIG line before any GPU line.
    """
    cards: list[GpuCard] = []
    migs: list[MigInstance] = []
    for line in text.splitlines():
        gpu = _LIST_GPU_RE.match(line)
        if gpu:
            cards.append(GpuCard(int(gpu[1]), gpu[3], gpu[2].strip(), None, None, None))
            continue
        mig = _LIST_MIG_RE.match(line)
        if mig:
            if not cards:
                raise ValueError(f"nvidia-smi -L lists a MIG device before any GPU: {line.strip()!r}")
            card = cards[-1].index
            migs.append(MigInstance(card, int(mig[2]), None, None, mig[1], mig[3], None, None))
    with_migs = {m.card for m in migs}
    return tuple(attrs.evolve(c, mig_mode=c.index in with_migs) for c in cards), tuple(migs)


def parse_log(text: str | bytes) -> ET.Element:
    """Returns the root of an ``nvidia-smi -q -x`` log; raises ValueError for text that is not XML,
    or XML that is not nvidia-smi's log."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ValueError(f"nvidia-smi -q -x gave unreadable XML ({exc})") from None
    if root.tag != "nvidia_smi_log":
        raise ValueError(f"nvidia-smi -q -x gave <{root.tag}>, not <nvidia_smi_log>")
    return root


def parse_query_xml(text: str) -> GpuInventory:
    """Returns what ``nvidia-smi -q -x`` says: cards, MIG instances, processes, versions.

    Cards are numbered in the order the XML lists them (nvidia-smi's own order). MIG
    instances have no UUID or profile (the XML has neither; see :func:`combine`). A
    process is put on the MIG instance whose GPU and compute instance ids it names.
    "N/A" or missing figures become None, never 0. The result's source is "nvidia-smi".
    Raises ValueError for text that is not an nvidia-smi XML log.
    """
    root = parse_log(text)
    cards: list[GpuCard] = []
    migs: list[MigInstance] = []
    processes: list[GpuProcess] = []
    for index, gpu in enumerate(root.findall("gpu")):
        card_migs = [_xml_mig(index, m) for m in gpu.findall("mig_devices/mig_device")]
        cards.append(
            GpuCard(
                index=index,
                uuid=_text(gpu, "uuid") or "",
                name=_text(gpu, "product_name") or "",
                memory_total_mb=_mib(gpu, "fb_memory_usage/total"),
                memory_used_mb=_mib(gpu, "fb_memory_usage/used"),
                memory_free_mb=_mib(gpu, "fb_memory_usage/free"),
                pci_bus_id=_text(gpu, "pci/pci_bus_id") or gpu.get("id") or None,
                mig_mode=_enabled(_text(gpu, "mig_mode/current_mig")) is True,
                mig_pending=_enabled(_text(gpu, "mig_mode/pending_mig")),
            )
        )
        migs.extend(card_migs)
        by_ids = {(m.gpu_instance_id, m.compute_instance_id): m.number for m in card_migs}
        for info in gpu.findall("processes/process_info"):
            pid = _int(_text(info, "pid"))
            if pid is None:
                continue
            ids = (_int(_text(info, "gpu_instance_id")), _int(_text(info, "compute_instance_id")))
            processes.append(
                GpuProcess(
                    pid=pid,
                    used_memory_mb=_mib(info, "used_memory"),
                    card=index,
                    mig=by_ids.get(ids) if ids[0] is not None else None,
                    name=_text(info, "process_name"),
                )
            )
    return GpuInventory(
        cards=tuple(cards),
        migs=tuple(migs),
        processes=tuple(processes),
        driver_version=_text(root, "driver_version"),
        cuda_version=_text(root, "cuda_version"),
        source="nvidia-smi",
    )


def combine(query: GpuInventory, listed: tuple[tuple[GpuCard, ...], tuple[MigInstance, ...]]) -> GpuInventory:
    """Returns the ``-q -x`` reading completed by the ``-L`` one (from :func:`parse_list`).

    Cards are matched by UUID and take ``-L``'s index; MIG instances are matched by card
    and number and take ``-L``'s UUID and profile. A card only one of them lists is kept
    with what that one knows (an XML-only card is numbered after the listed ones). The
    result goes through :func:`assemble`, so its note covers unusable cards.
    """
    listed_cards, listed_migs = listed
    by_uuid = {c.uuid: c for c in listed_cards}
    renumber: dict[int, int] = {}
    cards: list[GpuCard] = []
    next_free = max((c.index for c in listed_cards), default=-1) + 1
    for card in query.cards:
        known = by_uuid.pop(card.uuid, None)
        if known is not None:
            renumber[card.index] = known.index
        else:
            renumber[card.index] = next_free
            next_free += 1
        cards.append(attrs.evolve(card, index=renumber[card.index], name=card.name or (known.name if known else "")))
    cards.extend(by_uuid.values())
    listed_by_key = {(m.card, m.number): m for m in listed_migs}
    migs: list[MigInstance] = []
    for mig in query.migs:
        card = renumber[mig.card]
        known = listed_by_key.pop((card, mig.number), None)
        migs.append(
            attrs.evolve(
                mig,
                card=card,
                profile=known.profile if known else mig.profile,
                uuid=known.uuid if known else mig.uuid,
            )
        )
    # Instances only -L lists are kept on a card the XML lacks or shows in MIG mode:
    # what -L knows is still true there (a card the XML shows out of MIG mode wins).
    xml_cards = set(renumber.values())
    xml_mig_cards = {renumber[c.index] for c in query.cards if c.mig_mode}
    migs.extend(m for m in listed_by_key.values() if m.card not in xml_cards or m.card in xml_mig_cards)
    processes = [attrs.evolve(p, card=renumber[p.card]) for p in query.processes]
    return assemble(
        cards,
        migs,
        processes,
        driver_version=query.driver_version,
        cuda_version=query.cuda_version,
        source="nvidia-smi",
        note=query.note,
    )


def run_nvidia_smi(argv: Sequence[str], timeout: float) -> str:
    """Runs ``argv`` and returns its standard output (see :data:`Runner` for the errors)."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=True)
    return done.stdout


def read_nvidia_smi(run: Runner = run_nvidia_smi) -> GpuInventory:
    """Returns this node's GPUs as ``nvidia-smi`` reports them. Never raises.

    A missing nvidia-smi gives an empty inventory (source "") whose note says so; one
    that fails, overruns :data:`NVIDIA_SMI_TIMEOUT_S` or prints what cannot be parsed
    gives an empty inventory with the reason. If only ``-L`` fails, the cards are still
    given, their MIG instances without UUID or profile, and the note says why.
    """
    try:
        query = parse_query_xml(run([NVIDIA_SMI, "-q", "-x"], NVIDIA_SMI_TIMEOUT_S))
    except FileNotFoundError:
        return GpuInventory(note="nvidia-smi is not installed")
    except Exception as exc:
        return GpuInventory(note=f"nvidia-smi -q -x failed: {_reason(exc)}")
    try:
        listed = parse_list(run([NVIDIA_SMI, "-L"], NVIDIA_SMI_TIMEOUT_S))
    except Exception as exc:
        listed = ((), ())
        if query.migs or any(c.mig_mode for c in query.cards):
            query = attrs.evolve(query, note=f"nvidia-smi -L failed ({_reason(exc)}): MIG instances lack UUID and profile")
    inventory = combine(query, listed)
    if not inventory.cards:
        return attrs.evolve(inventory, note=inventory.note or "no NVIDIA GPUs: nvidia-smi lists none")
    return inventory


def _xml_mig(card: int, node: ET.Element) -> MigInstance:
    """Returns one <mig_device> of card ``card`` (no UUID or profile: the XML has neither)."""
    return MigInstance(
        card=card,
        number=_int(_text(node, "index")) or 0,
        gpu_instance_id=_int(_text(node, "gpu_instance_id")),
        compute_instance_id=_int(_text(node, "compute_instance_id")),
        profile=None,
        uuid=None,
        memory_total_mb=_mib(node, "fb_memory_usage/total"),
        memory_used_mb=_mib(node, "fb_memory_usage/used"),
    )


def _text(node: ET.Element, path: str) -> str | None:
    """Returns the stripped text at ``path``; None where it is missing, empty or "N/A"."""
    found = node.find(path)
    if found is None or found.text is None:
        return None
    text = found.text.strip()
    return None if not text or text in ("N/A", "Not Supported", "Unknown Error") else text


def _int(text: str | None) -> int | None:
    """Returns the text as an int, None where it is None or not a number."""
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _mib(node: ET.Element, path: str) -> int | None:
    """Returns "19968 MiB" at ``path`` as 19968; None where it is missing or "N/A"."""
    text = _text(node, path)
    match = _MIB_RE.match(text) if text else None
    return int(match[1]) if match else None


def _enabled(text: str | None) -> bool | None:
    """Returns True for "Enabled", False for "Disabled", None for anything else (N/A)."""
    return {"enabled": True, "disabled": False}.get((text or "").lower())


def _reason(exc: Exception) -> str:
    """Returns why an nvidia-smi run failed, in words (its first output line where it has one)."""
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"no answer within {exc.timeout:g} s"
    if isinstance(exc, subprocess.CalledProcessError):
        output = (exc.stdout or exc.stderr or "").strip()
        first = output.splitlines()[0] if output else ""
        return f"exit status {exc.returncode}" + (f": {first}" if first else "")
    return str(exc) or type(exc).__name__
