"""The RPC port's bootstrap refuses calls a certificate's role or name does not fit, and
logs and audits each kind once with the certificate's name (llmgw/control/refusals.py).

The real ``Cluster`` bootstrap over an in-memory stream (the identity is what TLS would
have read from the client certificate) and a real SQLite store.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, AsyncIterator

import capnp
import pytest
import trio
import trio.testing

from llmgw.control.cluster import ClusterServices, handle_connection
from llmgw.control.store import Store, open_store
from llmgw.rpc import schema
from llmgw.rpc.connection import open_client
from llmgw.rpc.kjtrio import capnp_runtime
from llmgw.rpc.tls import Identity, Role

DEADLINE_S = 10
#: Calls per test: a client retrying in a loop, which must not write a record or line each time.
ATTEMPTS = 20


def _unused(*_: Any) -> Any:
    raise AssertionError("a refused call reached the cluster's services")


@contextlib.asynccontextmanager
async def cluster_as(identity: Identity, store: Store) -> AsyncIterator[Any]:
    """Yields the ``Cluster`` bootstrap as ``identity`` sees it."""
    services = ClusterServices(store=store, heartbeat_interval=1.0, term=_unused, not_leader=_unused,
                               make_admin=_unused, control_planes=_unused)
    server_end, client_end = trio.testing.memory_stream_pair()
    async with capnp_runtime(), trio.open_nursery() as nursery:
        nursery.start_soon(handle_connection, services, server_end, identity)
        async with open_client(client_end) as client:
            yield client.bootstrap().cast_as(schema.load().Cluster)
        nursery.cancel_scope.cancel()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    async with open_store(tmp_path / "llmgw.db") as opened:
        yield opened


async def _refused(call: Any) -> str:
    with trio.fail_after(DEADLINE_S), pytest.raises(capnp.KjException) as caught:
        await call()
    return str(caught.value)


def _refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llmgw.control.refusals"]


async def test_a_node_certificate_asking_for_admin_is_refused_and_audited_with_its_name(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    intruder = Identity(Role.NODE, "gpu-rogue-1")
    async with cluster_as(intruder, store) as cluster:
        for _ in range(ATTEMPTS):
            message = await _refused(lambda: cluster.admin())
            assert "certificate of node 'gpu-rogue-1' cannot act as admin" in message
            assert "Traceback" not in message
    audit = [e for e in await store.list_audit() if e.action == "refused.admin"]
    assert len(audit) == 1  # one per kind and interval, however often it is tried
    assert audit[0].actor == "node:gpu-rogue-1"
    assert audit[0].detail["reason"] == "certificate of node 'gpu-rogue-1' cannot act as admin"
    lines = _refusal_lines(caplog)
    assert len(lines) == 1 and "gpu-rogue-1" in lines[0]


async def test_a_node_joining_as_another_node_is_refused_and_audited_with_both_names(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with cluster_as(Identity(Role.NODE, "node-a"), store) as cluster:
        for _ in range(ATTEMPTS):
            message = await _refused(lambda: cluster.join({"nodeId": "node-b", "address": "10.0.0.9"}))
            assert "certificate is for node 'node-a', but it tried to join as node 'node-b'" in message
    audit = [e for e in await store.list_audit() if e.action == "refused.join"]
    assert [(e.actor, e.target) for e in audit] == [("node:node-a", "node-b")]
    assert len(_refusal_lines(caplog)) == 1


async def test_an_admin_certificate_joining_as_a_node_is_refused_and_audited(store: Store) -> None:
    async with cluster_as(Identity(Role.ADMIN, "ops"), store) as cluster:
        message = await _refused(lambda: cluster.join({"nodeId": "ops", "address": "10.0.0.9"}))
        assert "certificate of admin 'ops' cannot act as node" in message
    assert [(e.actor, e.action) for e in await store.list_audit()] == [("admin:ops", "refused.join")]
