"""NVLink error counters per card, summed over its active links, from NVML.

The counters only grow (until the driver reloads or someone resets them), so the control
plane compares one minute's sums with the last. Synchronous and quick; callers on the trio
loop may use ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

logger = logging.getLogger(__name__)

# How often an agent reads the NVLink counters (issue 16): they change only when a link
# misbehaves, and reading every link of eight cards is a few hundred NVML calls.
NVLINK_INTERVAL_S = 60.0

# Links tried per card when the bindings do not say (NVML_NVLINK_MAX_LINKS): 18 on Hopper,
# and nvidia-ml-py 12.560+ says 36. Reading stops early at the first link NVML calls
# invalid, so a larger number costs nothing on smaller cards.
DEFAULT_MAX_LINKS = 18

# nvmlNvLinkErrorCounter_t values, for bindings that lack the names.
_COUNTERS = (
    ("crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT", 2),
    ("crc_data", "NVML_NVLINK_ERROR_DL_CRC_DATA", 3),
    ("replay", "NVML_NVLINK_ERROR_DL_REPLAY", 0),
    ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY", 1),
)


@attrs.frozen
class NvLinkErrors:
    """One card's NVLink error counters, each summed over its active links.

    A counter is None when no active link would give it (NVML says NotSupported for
    some counters on some generations); ``active_links`` is how many links were up.
    """

    index: int
    uuid: str
    taken_at: float
    active_links: int
    crc_flit: int | None = None
    crc_data: int | None = None
    replay: int | None = None
    recovery: int | None = None


def read_nvlink_errors(nvml: Any, now: float) -> dict[str, NvLinkErrors | None]:
    """Returns, for each card NVML lists (by UUID, in index order), its NVLink errors.

    The value is None for a card without NVLink. ``nvml`` is the ``pynvml`` module (or a
    stand-in), already initialised. A card whose handle or UUID cannot be read is left out
    (and logged). Raises ``nvml.NVMLError`` only when the number of cards cannot be read.
    """
    result: dict[str, NvLinkErrors | None] = {}
    for index in range(int(nvml.nvmlDeviceGetCount())):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = nvml.nvmlDeviceGetUUID(handle)
        except nvml.NVMLError as exc:
            logger.warning("GPU %d: no NVLink counters: NVML could not open it (%s)", index, exc)
            continue
        uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        result[uuid] = read_card_nvlink_errors(nvml, handle, index, uuid, now)
    return result


def read_card_nvlink_errors(nvml: Any, handle: Any, index: int, uuid: str, now: float) -> NvLinkErrors | None:
    """Returns one card's NVLink counters summed over its active links; None without NVLink.

    A card has no NVLink when NVML answers NotSupported for its first link's state. Links
    are tried from 0 until NVML calls one invalid (InvalidArgument) or
    NVML_NVLINK_MAX_LINKS is reached; a link whose state cannot be read is skipped. Never
    raises NVMLError.
    """
    not_supported = getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3)
    invalid = getattr(nvml, "NVML_ERROR_INVALID_ARGUMENT", 2)
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", DEFAULT_MAX_LINKS))
    sums: dict[str, int | None] = {name: None for name, _constant, _default in _COUNTERS}
    active = 0
    for link in range(max_links):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if link == 0 and code == not_supported:
                return None
            if code in (invalid, not_supported):
                break
            logger.debug("GPU %d: NVLink %d state: %s", index, link, exc)
            continue
        if state != enabled:
            continue
        active += 1
        for name, constant, default in _COUNTERS:
            try:
                count = int(nvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, getattr(nvml, constant, default)))
            except nvml.NVMLError as exc:
                logger.debug("GPU %d: NVLink %d %s: %s", index, link, name, exc)
                continue
            sums[name] = (sums[name] or 0) + count
    return NvLinkErrors(
        index=index,
        uuid=uuid,
        taken_at=now,
        active_links=active,
        crc_flit=sums["crc_flit"],
        crc_data=sums["crc_data"],
        replay=sums["replay"],
        recovery=sums["recovery"],
    )
