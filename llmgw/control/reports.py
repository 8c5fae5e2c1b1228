"""What a node may report about its shards: endpoints on its own address, shard ids of its own.

A node certificate proves which node is calling, nothing more. Without these checks a node
could report a READY shard of any model whose endpoint is any host (the gateway would send
that model's requests, and their API-checked prompts, there), or claim a shard id that runs
on another node (its KV-cache reports would then overwrite the other replica's). The
control plane therefore accepts:

* an endpoint only when its host is the address the node registered or the address its
  session comes from (:func:`endpoint_refusal`; an empty endpoint, before READY, is fine);
* at join, a reported shard only when no other node holds that shard id
  (:func:`screen_shards`); after join, reports arrive through a reporter capability the
  control plane made for one shard it placed or adopted, so no other id can be named.

A refused shard is left out of the registry (never routed to, never adopted); each refusal
is logged with the reason, once per node and kind, then at most once per interval.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Callable, Collection, Iterable
from urllib.parse import urlsplit

from llmgw.logthrottle import LogThrottle
from llmgw.spec import ShardSpec, ShardStatus

log = logging.getLogger(__name__)
#: A rogue or misconfigured node repeats its report on every join and status change.
_refusals = LogThrottle(log)

__all__ = ["endpoint_hosts", "endpoint_refusal", "log_refusal", "screen_shards"]


def _normal(host: str) -> str:
    """Returns ``host`` in one spelling: an IP address compressed, a name lower-cased."""
    host = host.strip().strip("[]")
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host.lower().rstrip(".")


def endpoint_hosts(registered: str, peer: str | None) -> frozenset[str]:
    """Returns the hosts a node's endpoints may name: its registered address and its peer address."""
    return frozenset(_normal(h) for h in (registered, peer or "") if h.strip())


def endpoint_refusal(endpoint: str, hosts: Collection[str]) -> str | None:
    """Returns why ``endpoint`` is not on one of ``hosts`` (from :func:`endpoint_hosts`),
    or None when it is (or is empty: a shard that is not READY has none yet)."""
    if not endpoint:
        return None
    try:
        host = urlsplit(endpoint).hostname
    except ValueError:
        host = None
    if not host:
        return f"endpoint {endpoint[:200]!r} is not a URL with a host"
    if _normal(host) not in hosts:
        return f"endpoint host {host[:200]!r} is not this node's address ({', '.join(sorted(hosts)) or 'none'})"
    return None


def log_refusal(node_id: str, kind: str, message: str) -> None:
    """Logs one refused report of ``node_id`` (once per node and ``kind``, then per interval)."""
    _refusals.failure((node_id, kind), logging.WARNING, "node %s: refused %s", node_id, message)


def screen_shards(
    node_id: str,
    hosts: Collection[str],
    shards: Iterable[tuple[ShardSpec, ShardStatus]],
    owner_of: Callable[[str], str | None],
) -> list[tuple[ShardSpec, ShardStatus]]:
    """Returns the shards of a join registration the control plane accepts, in their order.

    Drops (and logs, :func:`log_refusal`) a shard whose endpoint is not on ``hosts`` or
    whose id ``owner_of`` says another node holds. Never raises for a refused shard.
    """
    accepted: list[tuple[ShardSpec, ShardStatus]] = []
    for spec, status in shards:
        owner = owner_of(spec.id)
        if owner is not None and owner != node_id:
            log_refusal(node_id, "join-shard-id", f"shard {spec.id[:200]!r} at join: that shard id runs on node {owner}")
            continue
        reason = endpoint_refusal(status.endpoint, hosts)
        if reason is not None:
            log_refusal(node_id, "join-endpoint", f"shard {spec.id[:200]!r} of {spec.model[:200]!r} at join: {reason}")
            continue
        accepted.append((spec, status))
    return accepted
