"""llmgw's own nftables table: which of llmgw's ports each source may reach.

One table, ``inet llmgw``, holds everything llmgw puts in the kernel's firewall; nothing
else is touched, and removing the table removes every rule llmgw made. Its one chain hooks
``input`` just before the usual filter chains and only ever *rejects* (a TCP reset: the
client sees "connection refused" at once) new connections to llmgw's protected ports from
sources not allowed; it accepts nothing on anyone else's behalf, so the machine's own
firewall keeps working as it was.

Allowed sources: this machine's own addresses (``fib saddr type local``: engines and the
agent reach each other, whatever address they use), loopback, and :attr:`FirewallPlan.peers`
(the control planes, the nodes, the networks the cluster setting ``firewall.networks``
lists). Protected ports: an agent's engine ports, a control plane's RPC and metrics ports
(the gateway's port is the public service and stays open). :func:`render` writes the table
as an ``nft -f`` script that replaces the whole table in one transaction (the kernel applies
all of it or none); :func:`apply` runs it.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterable, Sequence

import attrs

from llmgw.files import atomic_write

#: The table's family and name.
TABLE = "inet llmgw"
#: Just before the default filter priority (0): llmgw's rejections come first, its
#: acceptances decide nothing (later chains still see what llmgw lets through).
CHAIN_PRIORITY = "filter - 5"
#: Seconds ``nft`` may take to load the table.
NFT_TIMEOUT_S = 30.0

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class FirewallError(RuntimeError):
    """The table cannot be applied or removed (no nft, not root, nft refused it); the message says why."""


def parse_networks(values: Iterable[Any], what: str = "firewall.networks") -> tuple[Network, ...]:
    """Return ``values`` (addresses or CIDR networks, as text) as networks; raises ValueError
    naming ``what`` and the bad entry."""
    out = []
    for value in values:
        if not isinstance(value, str):
            raise ValueError(f"{what}: expected addresses or networks as text (10.0.0.0/8), got {value!r}")
        try:
            out.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"{what}: {value!r} is not an address or network: {exc}") from None
    return tuple(out)


def check_firewall_setting(data: Any) -> dict[str, Any]:
    """Return the cluster setting ``firewall`` with its defaults filled in (enabled true, no
    networks); raises ValueError naming the key and the reason."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"firewall: expected a mapping with enabled and networks, got {data!r}")
    unknown = sorted(set(data) - {"enabled", "networks"})
    if unknown:
        raise ValueError(f"firewall.{unknown[0]}: unknown key (firewall takes enabled and networks)")
    enabled = data.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ValueError(f"firewall.enabled: expected true or false, got {enabled!r}")
    networks = data.get("networks", [])
    if not isinstance(networks, list):
        raise ValueError(f"firewall.networks: expected a list of networks (10.0.0.0/8), got {networks!r}")
    parse_networks(networks)
    return {"enabled": enabled, "networks": list(networks)}


@attrs.frozen
class FirewallPlan:
    """What the table says: ``enabled`` (False: no table at all), the TCP ``ports`` it
    protects and the ``peers`` (networks) allowed to reach them besides this machine."""

    enabled: bool = True
    ports: tuple[int, ...] = ()
    peers: tuple[Network, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Return the plan as the JSON a control plane writes to ``firewall.json``."""
        return {"enabled": self.enabled, "ports": list(self.ports), "peers": [str(p) for p in self.peers]}

    @classmethod
    def from_json(cls, data: Any) -> FirewallPlan:
        """Return the plan in ``data`` (:meth:`to_json`'s form); raises ValueError saying what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("a firewall plan is a JSON object with enabled, ports and peers")
        enabled, ports = data.get("enabled", True), data.get("ports", [])
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled: expected true or false, got {enabled!r}")
        if not isinstance(ports, list) or not all(type(p) is int and 0 < p < 65536 for p in ports):
            raise ValueError(f"ports: expected TCP port numbers, got {ports!r}")
        peers = data.get("peers", [])
        if not isinstance(peers, list):
            raise ValueError(f"peers: expected a list of networks, got {peers!r}")
        return cls(enabled, tuple(sorted(set(ports))), parse_networks(peers, "peers"))


def _elements(items: Sequence[str]) -> str:
    return f" elements = {{ {', '.join(items)} }}" if items else ""


def render(plan: FirewallPlan) -> str:
    """Return the ``nft -f`` script that makes llmgw's table say ``plan`` (or removes it when
    the plan is disabled), replacing whatever table was there in one transaction."""
    head = [f"table {TABLE} {{}}", f"delete table {TABLE}"]  # creating first makes the delete never fail
    if not plan.enabled:
        return "\n".join(head) + "\n"
    v4 = sorted(str(p) for p in plan.peers if p.version == 4)
    v6 = sorted(str(p) for p in plan.peers if p.version == 6)
    ports = [str(p) for p in sorted(set(plan.ports))]
    body = [
        f"table {TABLE} {{",
        f"    set ports {{ type inet_service;{_elements(ports)} }}",
        f"    set peers4 {{ type ipv4_addr; flags interval; auto-merge;{_elements(v4)} }}",
        f"    set peers6 {{ type ipv6_addr; flags interval; auto-merge;{_elements(v6)} }}",
        "    chain input {",
        f"        type filter hook input priority {CHAIN_PRIORITY}; policy accept;",
        "        tcp dport != @ports accept",
        "        iifname \"lo\" accept",
        "        fib saddr type local accept",
        "        ip saddr @peers4 accept",
        "        ip6 saddr @peers6 accept",
        "        ct state established,related accept",
        "        meta l4proto tcp reject with tcp reset",
        "    }",
        "}",
    ]
    return "\n".join(head + body) + "\n"


def nft_command(prefix: Sequence[str] = ()) -> list[str]:
    """Return the argv that runs nft (after ``prefix``, e.g. ``ip netns exec NS``); raises
    FirewallError when nft is not installed."""
    nft = shutil.which("nft") or next((p for p in ("/usr/sbin/nft", "/sbin/nft") if Path(p).exists()), None)
    if nft is None:
        raise FirewallError("nft is not installed (Debian/Ubuntu: apt-get install nftables)")
    return [*prefix, nft]


def apply(plan: FirewallPlan, prefix: Sequence[str] = ()) -> None:
    """Load :func:`render` of ``plan`` with nft (all of it or nothing). Raises FirewallError
    with nft's own message when it refuses (not root, no nf_tables in the kernel)."""
    argv = [*nft_command(prefix), "-f", "-"]
    try:
        done = subprocess.run(argv, input=render(plan), capture_output=True, text=True, timeout=NFT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FirewallError(f"nft took over {NFT_TIMEOUT_S:.0f} s") from None
    except OSError as exc:
        raise FirewallError(f"cannot run nft: {exc}") from None
    if done.returncode != 0:
        raise FirewallError(f"nft refused llmgw's table (exit {done.returncode}): "
                            f"{(done.stderr or done.stdout).strip()[-1000:]}")


def read_plan(path: Path) -> FirewallPlan:
    """Return the plan in the JSON file ``path``; raises ValueError (or OSError) saying why not."""
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    try:
        return FirewallPlan.from_json(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def write_plan(path: Path, plan: FirewallPlan) -> bool:
    """Write ``plan`` to ``path`` (by renaming a new file over it) unless it says that already;
    return whether it changed. Raises OSError when the directory is not writable."""
    text = (json.dumps(plan.to_json(), indent=1, sort_keys=True) + "\n").encode()
    try:
        if path.read_bytes() == text:
            return False
    except OSError:
        pass
    atomic_write(path, text)
    return True
