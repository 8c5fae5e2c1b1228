"""A control plane's own firewall, as a file for root to apply: ``<state_dir>/firewall.json``.

The control plane runs as ``llmgw``, never as root, so it cannot load nft rules itself. It
writes what its machine's table should say (llmgw/nftables.py's plan) to ``firewall.json``
in its state directory, and ``llmgw-firewall-sync.path`` (a systemd path unit watching that
file) runs ``llmgw firewall sync`` as root, which applies it.

Protected: the RPC port, and the metrics port unless it listens on loopback only; the
gateway's port is the public service and stays open. Allowed besides the machine itself:
the networks of the cluster setting ``firewall.networks``, every control plane of the store,
and the nodes the leader has a session with. With no networks listed the RPC port is not
restricted (mutual TLS guards it and nodes may join from anywhere); the agents still keep
their engines' ports to the control planes. ``firewall.enabled: false`` removes the table.

:func:`keep_firewall_file` rewrites the file when any of that changes, looking every
:data:`REFRESH_S`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Awaitable, Callable, Iterable, Sequence

import trio

from llmgw.nftables import FirewallPlan, check_firewall_setting, parse_networks, write_plan

log = logging.getLogger(__name__)

#: The file, in the control plane's state directory.
FIREWALL_FILE = "firewall.json"
#: Seconds between looks at the setting, the control planes and the nodes.
REFRESH_S = 5.0
#: Bound on one look (a store read).
READ_TIMEOUT_S = 10.0


def control_plane_plan(setting: object, ports: Sequence[int], peers: Iterable[str]) -> FirewallPlan:
    """Return the table a control plane's machine should have for the stored ``setting``
    (None: the defaults), its protected ``ports`` and the ``peers`` (control plane and node
    addresses) allowed besides the listed networks. Raises ValueError for a setting that
    does not check (:func:`llmgw.nftables.check_firewall_setting`)."""
    checked = check_firewall_setting(setting)
    if not checked["enabled"]:
        return FirewallPlan(enabled=False)
    networks = checked["networks"]
    if not networks:
        return FirewallPlan(enabled=True)  # nothing restricted: see the module docstring
    return FirewallPlan(True, tuple(sorted(set(ports))), parse_networks([*networks, *peers]))


async def keep_firewall_file(path: Path, read_setting: Callable[[], Awaitable[object]], ports: Sequence[int],
                             peers: Callable[[], Awaitable[Iterable[str]]], *,
                             task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Write ``path`` now and whenever the plan changes, until cancelled.

    ``read_setting()`` returns the stored setting, ``peers()`` the addresses of the control
    planes and nodes. A failed look or write is logged and tried again at the
    next look; started (``nursery.start``) once the first look was tried.
    """
    started = False
    last_problem = ""
    while True:
        try:
            with trio.fail_after(READ_TIMEOUT_S):
                setting = await read_setting()
                addresses = await peers()
            plan = control_plane_plan(setting, ports, addresses)
            if await trio.to_thread.run_sync(write_plan, path, plan):
                log.info("firewall: %s now says %s", path, plan.to_json())
            last_problem = ""
        except Exception as exc:  # noqa: BLE001 - tried again at the next look
            if str(exc) != last_problem:
                log.warning("firewall: cannot write %s: %s", path, exc)
            last_problem = str(exc)
        if not started:
            task_status.started()
            started = True
        await trio.sleep(REFRESH_S)
