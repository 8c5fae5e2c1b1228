"""Mutual TLS over real TCP on 127.0.0.1 with trio.SSLStream, both ends built from
llmgw.rpc.tls: who gets in, who is refused, and what each side is told."""

from __future__ import annotations

import datetime
import functools
import ssl
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from llmgw.rpc.tls import (
    ClusterCA,
    Identity,
    IssuedCert,
    Role,
    client_ssl_context,
    explain_tls_error,
    peer_identity,
    require_role,
    server_ssl_context,
)

#: Every exchange here is a few loopback round trips; this only stops a hung test.
DEADLINE_S = 10
LOOPBACK = "127.0.0.1"


@attrs.define
class Outcome:
    """What one side of a connection saw."""

    peer: Identity | None = None
    error: BaseException | None = None
    received: bytes = b""
    version: str | None = None


@attrs.frozen
class Pki:
    ca: ClusterCA
    other: ClusterCA  # another cluster's CA
    server: IssuedCert  # control plane cp1, reachable at 127.0.0.1


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    base: Path = tmp_path_factory.mktemp("pki")
    ca = ClusterCA.create(base / "ca")
    return Pki(
        ca=ca,
        other=ClusterCA.create(base / "other"),
        server=ca.issue("control", "cp1", sans=[LOOPBACK, "localhost.test"]),
    )


def server_ctx(pki: Pki, issued: IssuedCert | None = None) -> ssl.SSLContext:
    issued = issued or pki.server
    return server_ssl_context(pki.ca.cert_pem, issued.cert_pem, issued.key_pem)


def client_ctx(pki: Pki, issued: IssuedCert) -> ssl.SSLContext:
    return client_ssl_context(pki.ca.cert_pem, issued.cert_pem, issued.key_pem)


async def exchange(
    server_context: ssl.SSLContext | None,
    client_context: ssl.SSLContext | None,
    *,
    server_hostname: str = LOOPBACK,
    authorise: Any = None,
    message: bytes = b"ping",
) -> tuple[Outcome, Outcome]:
    """Serve one connection on 127.0.0.1 and dial it; return what (server, client) saw.

    The server handshakes, reads the peer identity, runs ``authorise(identity)``, then
    answers the client's ``message``. A ``None`` context means that side speaks plain TCP. The server's
    outcome is complete when this returns: the handler reports it through a channel.
    """
    server, client = Outcome(), Outcome()
    done_send, done_receive = trio.open_memory_channel[None](1)

    async def handler(tcp: trio.SocketStream) -> None:
        stream: trio.abc.Stream = tcp
        try:
            if server_context is not None:
                ssl_stream = trio.SSLStream(tcp, server_context, server_side=True)
                stream = ssl_stream
                await ssl_stream.do_handshake()
                server.version = ssl_stream.version()
                server.peer = peer_identity(ssl_stream)
                if authorise is not None:
                    authorise(server.peer)
            server.received = await stream.receive_some()
            await stream.send_all(b"pong:" + server.received)
        except (trio.BrokenResourceError, PermissionError) as exc:
            server.error = exc
        finally:
            await trio.aclose_forcefully(stream)
            await done_send.send(None)

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, handler, 0, host=LOOPBACK)
            )
            port = listeners[0].socket.getsockname()[1]
            tcp = await trio.open_tcp_stream(LOOPBACK, port)
            stream: trio.abc.Stream = tcp
            try:
                if client_context is not None:
                    ssl_stream = trio.SSLStream(tcp, client_context,
                                                server_hostname=server_hostname)
                    stream = ssl_stream
                    await ssl_stream.do_handshake()
                    client.version = ssl_stream.version()
                    client.peer = peer_identity(ssl_stream)
                await stream.send_all(message)
                client.received = await stream.receive_some()
            except trio.BrokenResourceError as exc:
                client.error = exc
            finally:
                await trio.aclose_forcefully(stream)
            await done_receive.receive()
            nursery.cancel_scope.cancel()
    return server, client


def explained(outcome: Outcome, side: str) -> str:
    assert outcome.error is not None, f"the {side} expected a failure, got {outcome}"
    return explain_tls_error(outcome.error, side=side)  # type: ignore[arg-type]


def client_refused(outcome: Outcome) -> str | None:
    """Return the explanation of a TLS 1.3 client's failure on its first read after the
    server refused its certificate, or None where that read ended cleanly instead.

    Python 3.11.7 and later raise there (the server's alert, or an unexpected EOF); 3.11.2
    (Debian 12's) reads a clean end of stream. llmgw's client then sees its first call
    disconnected and says the server refused its certificate (``llmgw/client``).
    """
    if outcome.error is None and sys.version_info < (3, 11, 7):
        assert outcome.received == b"" and outcome.version == "TLSv1.3", outcome
        return None
    return explained(outcome, "client")


# --- the good path --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "name"), [(Role.NODE, "gpu-07"), (Role.ADMIN, "alice@example.org"), (Role.CONTROL, "cp2")]
)
async def test_mutual_tls_identifies_both_ends(pki: Pki, role: Role, name: str) -> None:
    client_cert = pki.ca.issue(role, name)
    server, client = await exchange(server_ctx(pki), client_ctx(pki, client_cert))
    assert server.error is None and client.error is None
    assert server.peer == Identity(role, name)
    assert client.peer == Identity(Role.CONTROL, "cp1")
    assert server.received == b"ping"
    assert client.received == b"pong:ping"
    assert server.version in ("TLSv1.2", "TLSv1.3") and client.version == server.version
    require_role(client.peer, Role.CONTROL)  # what a client checks about its server


async def test_server_reached_by_dns_san(pki: Pki) -> None:
    # "localhost.test" is in the SANs; the TCP address is still 127.0.0.1.
    server, client = await exchange(
        server_ctx(pki), client_ctx(pki, pki.ca.issue("node", "n1")),
        server_hostname="localhost.test",
    )
    assert client.error is None and client.received == b"pong:ping"


# --- refused client certificates ------------------------------------------------------------


@pytest.mark.parametrize("max_version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
async def test_client_certificate_from_another_ca_is_refused(
    pki: Pki, max_version: ssl.TLSVersion
) -> None:
    # TLS 1.3: the client's handshake succeeds and it fails on its first read;
    # TLS 1.2: it fails during the handshake. The explanation is the same.
    context = server_ctx(pki)
    context.maximum_version = max_version
    server, client = await exchange(context, client_ctx(pki, pki.other.issue("node", "n1")))
    assert server.peer is None
    assert client.received == b""
    assert explained(server, "server").startswith(
        "client certificate refused: not issued by this cluster's CA "
        "(certificate verify failed: unable to get local issuer certificate)"
    )
    message = client_refused(client) if max_version == ssl.TLSVersion.TLSv1_3 else explained(client, "client")
    if message is not None:
        assert message.startswith("the server closed the connection during or right after the TLS")
        assert "this is how a server refuses a client certificate" in message
        assert "issued by the cluster's CA" in message and "llmgw ctl certs issue" in message


async def test_expired_client_certificate_is_refused(pki: Pki) -> None:
    long_ago = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
    expired = pki.ca.issue("node", "n1", not_before=long_ago, days=1)
    server, client = await exchange(server_ctx(pki), client_ctx(pki, expired))
    assert server.peer is None
    assert explained(server, "server").startswith(
        "client certificate refused: it has expired (certificate verify failed: "
        "certificate has expired)"
    )
    message = client_refused(client)
    assert message is None or "has not expired" in message


async def test_client_without_certificate_is_refused(pki: Pki) -> None:
    bare = ssl.create_default_context(cadata=pki.ca.cert_pem.decode())
    server, client = await exchange(server_ctx(pki), bare)
    assert server.peer is None and client.received == b""
    assert "client certificate refused" in explained(server, "server")
    assert "the client sent none" in explained(server, "server")
    client_refused(client)  # a failure (3.11.7 and later), or a clean end of stream (3.11.2)


# --- refused server certificates ------------------------------------------------------------


async def test_server_certificate_from_another_ca_is_refused(pki: Pki) -> None:
    foreign = pki.other.issue("control", "cp1", sans=[LOOPBACK])
    server, client = await exchange(server_ctx(pki, foreign), client_ctx(pki, pki.ca.issue("node", "n1")))
    assert client.peer is None and server.peer is None
    assert explained(client, "client").startswith(
        "the peer's certificate was not issued by this cluster's CA "
        "(certificate verify failed: unable to get local issuer certificate): "
        "copy this cluster's CA certificate (ca.pem) to this machine, "
        "or re-issue the certificate with `llmgw ctl certs issue`"
    )
    assert explained(server, "server").startswith(
        "the client closed the connection during the TLS handshake"
    )


async def test_expired_server_certificate_is_refused(pki: Pki) -> None:
    long_ago = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
    expired = pki.ca.issue("control", "cp1", sans=[LOOPBACK], not_before=long_ago, days=1)
    server, client = await exchange(server_ctx(pki, expired), client_ctx(pki, pki.ca.issue("node", "n1")))
    assert client.peer is None
    assert explained(client, "client").startswith("the server's certificate has expired")


async def test_server_certificate_must_name_the_dialled_address(pki: Pki) -> None:
    server, client = await exchange(
        server_ctx(pki), client_ctx(pki, pki.ca.issue("node", "n1")), server_hostname="cp9.test"
    )
    assert client.peer is None
    message = explained(client, "client")
    assert message.startswith("the server's certificate does not name the address")
    assert "advertise_hosts" in message


async def test_node_certificate_cannot_serve(pki: Pki) -> None:
    # A node's certificate is client-only: a machine posing as a control plane with one
    # is refused by the client during verification.
    posing = pki.ca.issue("node", "cp1")
    server, client = await exchange(server_ctx(pki, posing), client_ctx(pki, pki.ca.issue("node", "n1")))
    assert client.peer is None
    assert explained(client, "client").startswith("the server's certificate is not a control plane's")


# --- authorisation over a verified connection ----------------------------------------------


async def test_node_certificate_cannot_act_as_admin(pki: Pki) -> None:
    server, client = await exchange(
        server_ctx(pki), client_ctx(pki, pki.ca.issue("node", "a")),
        authorise=lambda peer: require_role(peer, Role.ADMIN),
    )
    assert server.peer == Identity(Role.NODE, "a")
    assert isinstance(server.error, PermissionError)
    assert str(server.error) == "certificate of node 'a' cannot act as admin"
    assert server.received == b""


async def test_node_certificate_cannot_claim_another_node(pki: Pki) -> None:
    server, client = await exchange(
        server_ctx(pki), client_ctx(pki, pki.ca.issue("node", "a")),
        authorise=lambda peer: require_role(peer, Role.NODE, "b"),
    )
    assert isinstance(server.error, PermissionError)
    assert str(server.error) == "certificate is for node 'a', but it tried to join as node 'b'"


# --- not TLS at all -------------------------------------------------------------------------


async def test_plain_http_to_the_rpc_port(pki: Pki) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: cp1\r\n\r\n"
    server, client = await exchange(server_ctx(pki), None, message=request)
    assert explained(server, "server").startswith("the client sent plain HTTP to the RPC port")
    assert server.received == b"" and client.received == b""


async def test_tls_client_dialling_a_plain_port(pki: Pki) -> None:
    server, client = await exchange(None, client_ctx(pki, pki.ca.issue("node", "n1")))
    # The plain server answers the ClientHello with bytes that are not a TLS record.
    assert explained(client, "client").startswith("the server is not speaking TLS")
