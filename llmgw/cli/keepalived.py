"""A keepalived configuration that keeps a floating address on the leading control plane.

Every control plane runs keepalived with the same virtual router and priority; each one's
check asks its own ``GET /leader`` (200 only on the leader). A failing check puts that
keepalived in FAULT, so the address can only live where the check passes: the leader.
"""

from __future__ import annotations

import ipaddress
import shutil
from pathlib import Path

import psutil

#: Seconds between checks, and how many fail/pass in a row flip it: the floating address
#: follows a new leader within about two seconds of ``/leader`` answering 200 there.
CHECK_INTERVAL_S = 1
CHECK_FALL = 2
CHECK_RISE = 1
#: The VRRP router id every control plane of one cluster shares (1-255; pick another with
#: --vip-router-id where this one is taken on the network segment).
DEFAULT_ROUTER_ID = 51
#: How every configuration this module writes begins (``llmgw wipe`` removes only such a one).
WRITTEN_BY = "# Written by `llmgw server join --vip`"
#: Linux's IFF_LOOPBACK in /sys/class/net/NAME/flags: keepalived runs no VRRP there.
IFF_LOOPBACK = 0x8


def interface_of(address: str) -> str | None:
    """Returns the network interface that holds ``address`` on this machine (None: none does)."""
    for name, entries in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in entries):
            return name
    return None


def check_interface(name: str) -> None:
    """Raises ValueError unless keepalived can float an address on the interface ``name`` of
    this machine: it exists and is not a loopback (keepalived ignores VRRP on one)."""
    present = sorted(psutil.net_if_stats())
    if name not in present:
        raise ValueError(f"this machine has no network interface {name!r} (it has {', '.join(present)})")
    try:
        flags = int(Path("/sys/class/net", name, "flags").read_text().strip(), 16)
    except (OSError, ValueError):
        flags = 0
    if flags & IFF_LOOPBACK or name == "lo":
        raise ValueError(f"{name} is a loopback interface, where keepalived runs no VRRP: give the interface "
                         "of the network the control planes share")


def parse_vip(vip: str) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface:
    """Returns ``vip`` (``ADDRESS`` or ``ADDRESS/PREFIX``; a lone address is a /32 or /128);
    raises ValueError for anything else."""
    return ipaddress.ip_interface(vip if "/" in vip else f"{vip}/{32 if ':' not in vip else 128}")


def check_command(http_address: str) -> str:
    """Returns the shell command that succeeds only while the control plane at
    ``http_address`` (host:port) leads."""
    url = f"http://{http_address}/leader"
    curl = shutil.which("curl")
    if curl is not None:
        return f"{curl} -fsS -m 2 -o /dev/null {url}"
    return f"/usr/bin/env python3 -c \\\"import urllib.request; urllib.request.urlopen('{url}', timeout=2)\\\""


def render(vip: str, interface: str, http_address: str, *, router_id: int = DEFAULT_ROUTER_ID) -> str:
    """Returns keepalived.conf text floating ``vip`` (``ADDRESS`` or ``ADDRESS/PREFIX``) on
    ``interface`` to whichever control plane leads. Raises ValueError for a bad address or id."""
    network = parse_vip(vip)
    if not 1 <= router_id <= 255:
        raise ValueError(f"the VRRP router id must be 1-255, got {router_id}")
    return f"""{WRITTEN_BY}: {network} follows the leading llmgw control plane.
global_defs {{
    enable_script_security
    script_user nobody
}}

vrrp_script llmgw_leader {{
    script "{check_command(http_address)}"
    interval {CHECK_INTERVAL_S}
    timeout 2
    fall {CHECK_FALL}
    rise {CHECK_RISE}
}}

vrrp_instance llmgw {{
    state BACKUP
    interface {interface}
    virtual_router_id {router_id}
    priority 100
    advert_int 1
    virtual_ipaddress {{
        {network.with_prefixlen} dev {interface}
    }}
    track_script {{
        llmgw_leader
    }}
}}
"""
