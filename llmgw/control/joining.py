"""Joining with a one-time token: the ``JoinDesk`` an RPC connection without a certificate gets.

``llmgw ctl servers add NAME`` stores a token (:mod:`llmgw.jointoken`) for a new control
plane. On the new machine, ``llmgw server join`` connects without a certificate, checks
the CA this desk hands out against the pin in its token, then redeems the token with a
certificate request made with a key that never leaves it. The desk marks the token used
(once, in one transaction: racing joins get one certificate), signs the request's key for
the token's role and name, and hands back what that machine needs to run: the CA (with its
key for a control plane, so any control plane can sign after a failover), the store's
URL, the lease and every control plane's address.

Any control plane holding the CA's key answers joins; one without it does not listen for
connections without a certificate at all.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

import attrs
import trio

from llmgw.config.values import parse_node_id
from llmgw.control.refusals import AUDIT_TIMEOUT_S
from llmgw.control.store import Store
from llmgw.control.store.base import JoinTokenRefused
from llmgw.jointoken import parse_token
from llmgw.labels import to_pairs
from llmgw.logthrottle import LogThrottle
from llmgw.rpc import schema
from llmgw.rpc.tls import ClusterCA, Role, check_sans, identity_of, request_name, request_public_key

log = logging.getLogger(__name__)

#: Addresses one control plane's certificate may name: more is a mistake or an attack.
MAX_SANS = 16

_refusals = LogThrottle(log)


@attrs.frozen
class JoinService:
    """What the desk needs: the store, the CA (with its key), and what a new control plane is told."""

    store: Store
    ca: ClusterCA
    store_url: str
    leader_lease: float
    control_planes: Callable[[], Awaitable[list[str]]]


def make_join_desk(service: JoinService, peer: str | None) -> Any:
    """Return a ``JoinDesk`` server object for one connection from ``peer`` (its address)."""

    class JoinDeskServer(schema.load().JoinDesk.Server):  # type: ignore[misc]
        async def caCertificate(self, _context: Any, **_: Any) -> None:
            _context.results.pem = service.ca.cert_pem

        async def redeem(self, token: str, request: bytes, sans: Any, role: str, _context: Any, **_: Any) -> None:
            _context.results.grant = await redeem(service, str(token), bytes(request), [str(s) for s in sans],
                                                  peer or "?", role=str(role))

    return JoinDeskServer()


async def redeem(service: JoinService, token_text: str, request: bytes, sans: list[str], peer: str,
                 *, role: str = "") -> dict[str, Any]:
    """Redeem ``token_text`` for a certificate over ``request``'s key; return the grant (a
    capnp ``JoinGrant`` dict). ``role`` ("": any) is what the joiner runs: a token for
    another role is refused before it is spent. Raises PermissionError when the token is refused (the reason
    logged, throttled, and audited) and ValueError for a bad request or SANs."""
    try:
        token = parse_token(token_text)
    except ValueError as exc:
        await _refused(service, peer, str(exc))
        raise PermissionError(str(exc)) from None
    if len(sans) > MAX_SANS:
        raise ValueError(f"a control plane's certificate names at most {MAX_SANS} addresses, got {len(sans)}")
    # Check the request and the addresses before the token is spent: a mistyped
    # --advertise must not cost the operator a token.
    public_key = request_public_key(request)
    check_sans(sans)
    try:
        record = await service.store.redeem_join_token(token.id, token.secret_sha256, peer, role=role)
    except JoinTokenRefused as exc:
        await _refused(service, peer, str(exc))
        raise PermissionError(str(exc)) from None
    control = record.role == Role.CONTROL.value
    name = record.name or await _node_name(service, request)
    certificate = service.ca.sign(record.role, name, public_key, sans=sans if control else ())
    if record.role == Role.NODE.value:  # `ctl nodes remove` revokes it
        await service.store.record_node_certificate(name, identity_of(certificate).serial)
    with trio.move_on_after(AUDIT_TIMEOUT_S):
        await service.store.audit(f"join:{peer}", "join.redeem", name,
                                  {"role": record.role, "token": record.id, "from": peer})
    log.info("%s %s joined from %s with token %s", record.role, name, peer, record.id)
    return {
        "role": record.role,
        "name": name,
        "certificate": certificate,
        "ca": service.ca.cert_pem,
        "caKey": service.ca.key_pem() if control else b"",
        "storeUrl": service.store_url if control else "",
        "leaderLease": service.leader_lease if control else 0.0,
        "controlPlanes": await service.control_planes(),
        "labels": to_pairs(record.overrides.labels),
        "disabledEngines": list(record.overrides.disabled_engines),
    }


async def check_new_node_name(store: Store, name: str) -> None:
    """Raises ValueError when ``name`` cannot name a node, or a node of that name is in the cluster."""
    try:
        parse_node_id(name)
    except ValueError as exc:
        raise ValueError(f"{name!r} cannot name a node: {exc}") from None
    if any(node.id == name for node in await store.list_known_nodes()):
        raise ValueError(f"a node named {name!r} is in the cluster already: "
                         f"`llmgw ctl nodes remove {name}` first to replace it")


async def _node_name(service: JoinService, request: bytes) -> str:
    """Returns the name a node asks for in its certificate request (its host name, or
    ``agent join --name``), for a token that names none; raises ValueError as
    :func:`check_new_node_name`, saying to join with another name."""
    name = request_name(request)
    try:
        await check_new_node_name(service.store, name)
    except ValueError as exc:
        raise ValueError(f"{exc} (or join with --name NAME)") from None
    return name


async def _refused(service: JoinService, peer: str, reason: str) -> None:
    if _refusals.failure(("join", peer, reason), logging.WARNING, "refused a join from %s: %s", peer, reason):
        with trio.move_on_after(AUDIT_TIMEOUT_S):
            try:
                await service.store.audit(f"join:{peer}", "refused.join", "", {"reason": reason})
            except Exception:  # noqa: BLE001 - the refusal stands whatever the audit log does
                log.warning("could not audit a refused join from %s", peer, exc_info=True)
