"""The node's side of llmgw's firewall: its engines' ports reachable only from the control
planes and the networks the cluster allows.

The leader sends each agent the cluster setting ``firewall`` (``enabled``, ``networks``) when
it joins and a second after a change (``Agent.firewall``); the agent keeps it in its state
directory (``firewall.json``), so the rules are back after a restart before any session.
:class:`NodeFirewall` turns it, the control planes' addresses (agent.yaml's and what the
leader sent) and the ports given to its shards into llmgw's nft table
(llmgw/nftables.py) and applies it whenever one of those changes. Engine ports change as
shards start and stop, so the inputs are looked at every :data:`REFRESH_S`; nft runs only
when the table would change.

It needs root (CAP_NET_ADMIN) and nft: without them the rules are not applied, the reason is
logged once and kept in :attr:`NodeFirewall.problem`; serving goes on.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import trio

from llmgw import nftables
from llmgw.files import atomic_write, read_json_mapping
from llmgw.rpc.net import split_address
from llmgw.nftables import FirewallError, FirewallPlan, check_firewall_setting, parse_networks

log = logging.getLogger(__name__)

#: The file in the agent's state directory holding the last setting the leader sent.
SETTING_FILE = "firewall.json"
#: Seconds between looks at the shards' ports and the control planes (a port given to a new
#: shard is protected within this long: usually before its engine even listens).
REFRESH_S = 1.0
#: Seconds a name lookup of a control plane's host may take.
RESOLVE_TIMEOUT_S = 5.0


def read_setting(state_dir: Path) -> dict[str, Any] | None:
    """Return the firewall setting kept in ``state_dir`` (None: none kept or unreadable, logged)."""
    try:
        return read_json_mapping(state_dir / SETTING_FILE)
    except (OSError, ValueError) as exc:
        log.error("firewall: ignoring the kept setting: %s", exc)
        return None


def resolve_hosts(addresses: Iterable[str]) -> list[str]:
    """Return the IP addresses of the hosts in ``host:port`` ``addresses`` (blocking; names
    that do not resolve are logged and left out)."""
    out: set[str] = set()
    for address in addresses:
        host, _ = split_address(address)
        try:
            for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP):
                out.add(str(info[4][0]).split("%", 1)[0])
        except OSError as exc:
            log.warning("firewall: cannot resolve control plane %s (%s): it is not allowed until it resolves",
                        host, exc)
    return sorted(out)


class NodeFirewall:
    """Keeps llmgw's nft table on this node in step with its inputs (see the module docstring).

    ``state_dir`` keeps the setting; ``ports()`` returns the ports given to this node's shards (before their engines start);
    ``planes()`` the control planes' ``host:port`` addresses; ``prefix`` runs nft through
    another command (``ip netns exec NS`` in the tests). ``applied`` is the plan in the
    kernel now (None: none applied by this agent).
    """

    def __init__(self, state_dir: Path, ports: Callable[[], Iterable[int]], planes: Callable[[], Sequence[str]],
                 prefix: Sequence[str] = ()) -> None:
        self.state_dir = state_dir
        self.ports = ports
        self.planes = planes
        self.prefix = tuple(prefix)
        self.setting = read_setting(state_dir)
        self.applied: FirewallPlan | None = None
        self._refused: FirewallPlan | None = None  # the last plan nft refused: not retried until it changes
        self.problem = ""
        self._wake = trio.Event()
        self._resolved: tuple[tuple[str, ...], list[str]] = ((), [])

    def set(self, data: Any) -> None:
        """Take the cluster setting ``firewall`` (checked: ValueError), keep it and apply it soon."""
        setting = check_firewall_setting(data)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.state_dir / SETTING_FILE, (json.dumps(setting, sort_keys=True) + "\n").encode())
        self.setting = setting
        self._wake.set()

    async def plan(self) -> FirewallPlan | None:
        """Return the table this node should have now (None: no setting received yet)."""
        if self.setting is None:
            return None
        if not self.setting["enabled"]:
            return FirewallPlan(enabled=False)
        planes = tuple(self.planes())
        if planes != self._resolved[0]:
            with trio.move_on_after(RESOLVE_TIMEOUT_S):
                self._resolved = (planes, await trio.to_thread.run_sync(resolve_hosts, planes, abandon_on_cancel=True))
        peers = parse_networks([*self._resolved[1], *self.setting["networks"]])
        return FirewallPlan(True, tuple(sorted(set(self.ports()))), peers)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply the plan whenever it changes, until cancelled (the table stays in the kernel:
        the next agent takes it over)."""
        task_status.started()
        while True:
            plan = await self.plan()
            if plan is not None and plan != self.applied and plan != self._refused:
                await self._apply(plan)
            with trio.move_on_after(REFRESH_S):
                await self._wake.wait()
            self._wake = trio.Event()

    async def _apply(self, plan: FirewallPlan) -> None:
        if self.prefix == () and os.geteuid() != 0:
            self._refused = plan
            self._fail("the agent does not run as root, so it cannot load llmgw's nft table")
            return
        try:
            await trio.to_thread.run_sync(nftables.apply, plan, self.prefix)
        except FirewallError as exc:
            self._refused = plan
            self._fail(str(exc))
            return
        self.applied = plan
        self.problem = ""
        if plan.enabled:
            log.info("firewall: engine ports %s reachable from this machine and %s",
                     ", ".join(map(str, plan.ports)) or "(none)", ", ".join(map(str, plan.peers)) or "nothing else")
        else:
            log.info("firewall: disabled by the cluster setting; llmgw's table removed")

    def _fail(self, reason: str) -> None:
        if reason != self.problem:
            log.warning("firewall: not applied: %s", reason)
        self.problem = reason
