"""Joining a cluster with a one-time token, the network half (``llmgw server join``, ``llmgw agent join``).

:func:`redeem` dials a control plane without a certificate, fetches the cluster CA, checks
it against the pin in the token and the server's certificate against it (so the token is
only ever sent to the cluster that minted it), then redeems the token with a certificate
request made from the caller's key. The key itself never leaves the caller.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import attrs
import capnp
import trio

from llmgw.jointoken import JoinToken, NodeOverrides
from llmgw.labels import parse_pairs
from llmgw.rpc import net, schema
from llmgw.rpc.connection import open_client
from llmgw.rpc.errors import remote_reason
from llmgw.rpc.kjtrio import capnp_runtime, runtime_active
from llmgw.rpc.tls import anonymous_client_context, certificate_request, check_pinned_server

#: Deadline of each call to the join desk (one store write and one signature).
JOIN_CALL_TIMEOUT_S = 30.0


class JoinError(Exception):
    """The join failed; the message says why and what to do."""


@attrs.frozen
class Grant:
    """What a redeemed token gave: the certificate for this machine's key and how to run."""

    role: str
    name: str
    certificate: bytes
    ca: bytes
    ca_key: bytes = attrs.field(repr=False)
    store_url: str = attrs.field(repr=False)
    leader_lease: float
    control_planes: tuple[str, ...]
    #: Nodes: what the token adds to agent.yaml (labels, disabled engines).
    overrides: NodeOverrides = NodeOverrides()


async def redeem(addresses: Sequence[str], token: JoinToken, key_pem: bytes, sans: Sequence[str],
                 name: str = "joining", role: str = "") -> Grant:
    """Redeem ``token`` at the first of ``addresses`` that answers; return the :class:`Grant`.

    ``key_pem`` is this machine's private key (only a request signed with it is sent),
    ``sans`` the addresses a control plane's certificate should name, ``name`` the name a
    node asks for where its token names none (its host name), ``role`` what this machine
    will run (a token for another role is refused unspent; "": any). Raises
    :class:`JoinError` when no control plane could be reached, the server is not the
    cluster the token pins (nothing secret was sent then), or the token was refused.
    """
    async with contextlib.AsyncExitStack() as stack:
        if not runtime_active():
            await stack.enter_async_context(capnp_runtime())
        try:
            address, stream = await net.connect_first(addresses, anonymous_client_context())
        except net.ConnectError as exc:
            raise JoinError(f"no control plane answered: {exc}") from None
        async with open_client(stream) as client:
            desk = client.bootstrap().cast_as(schema.load().JoinDesk)
            try:
                with trio.fail_after(JOIN_CALL_TIMEOUT_S):
                    ca = bytes((await desk.caCertificate()).pem)
                    try:
                        check_pinned_server(stream.getpeercert(binary_form=True), ca, token.ca_sha256)
                    except (PermissionError, ValueError) as exc:
                        raise JoinError(f"{address}: {exc}") from None
                    request = certificate_request(key_pem, name)
                    grant = (await desk.redeem(str(token), request, list(sans), role)).grant
            except trio.TooSlowError:
                raise JoinError(f"{address} did not answer within {JOIN_CALL_TIMEOUT_S:g}s") from None
            except capnp.KjException as exc:
                if exc.type == "DISCONNECTED":
                    raise JoinError(f"{address} closed the connection: it does not answer joins (it holds no "
                                    "cluster CA key, or runs an llmgw without `server join`)") from None
                raise JoinError(f"{address} refused the join: {remote_reason(exc)}") from None
            return Grant(str(grant.role), str(grant.name), bytes(grant.certificate), bytes(grant.ca),
                         bytes(grant.caKey), str(grant.storeUrl), float(grant.leaderLease),
                         tuple(str(a) for a in grant.controlPlanes),
                         NodeOverrides(parse_pairs(str(p) for p in grant.labels),
                                       tuple(str(e) for e in grant.disabledEngines)))
