"""The control plane's side of the gateway interface, against a recording gateway.

What a standby control plane will rely on: the route feed and the access sync drive any
:class:`~llmgw.router.interface.GatewayInterface`, not only the gateways llmgw builds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import trio

from llmgw.catalog import validate_model
from llmgw.control.keys import SERVING_STOPPED, AccessSync, new_api_key
from llmgw.control.registry import Registry
from llmgw.control.routes import NOT_READY_REASON, RouteFeed
from llmgw.control.store import open_store
from llmgw.control.store.base import TenantRecord
from llmgw.router.interface import (
    AccessState, AdmissionShares, GatewayInterface, GatewayStatus, ModelInfo, Replica, TenantDemand, UsageBatch,
    UsageCounts,
)
from llmgw.spec import Hardware, KvDelta


class RecordingGateway(GatewayInterface):
    """Keeps what it is given; hands back the usage a test puts in ``counted``, and when it
    stops serving, ``last`` (as a worker pool's workers hand over their last counts)."""

    def __init__(self) -> None:
        self.routes: list[tuple[dict[str, list[Replica]], dict[str, ModelInfo]]] = []
        self.routes_changed = trio.Event()
        self.access: list[AccessState] = []
        self.counted: dict[tuple[str, str], UsageCounts] = {}
        self.last: dict[tuple[str, str], UsageCounts] = {}
        self.readiness: list[str | None] = []
        self.collectors: list[object] = []
        self.readiness_changed = trio.Event()

    def replace_routes(self, replicas: Mapping[str, Sequence[Replica]], models: Mapping[str, ModelInfo]) -> None:
        self.routes.append(({m: list(r) for m, r in replicas.items()}, dict(models)))
        self.routes_changed.set()
        self.routes_changed = trio.Event()

    def kv_update(self, replica_id: str, delta: KvDelta) -> None:
        raise AssertionError("no KV deltas in these tests")

    def kv_forget(self, replica_id: str) -> None:
        raise AssertionError("no KV deltas in these tests")

    def set_leader(self, leading: bool, leader: str, epoch: int) -> None:
        self.leader = (leading, leader, epoch)

    def set_admin_api(self, handler: object) -> None:
        self.admin_api = handler

    def set_extra_metrics(self, render: object) -> None:
        self.collectors.append(render)

    def set_readiness(self, not_ready: str | None) -> None:
        self.readiness.append(not_ready)
        self.readiness_changed.set()
        self.readiness_changed = trio.Event()

    async def apply_access(self, access: AccessState) -> None:
        self.access.append(access)

    async def apply_admission_shares(self, shares: AdmissionShares) -> None:
        self.shares = shares

    def admission_demand(self) -> dict[str, TenantDemand]:
        return {}

    def drain_usage(self) -> UsageBatch:
        drained, self.counted = self.counted, {}
        return UsageBatch(drained)

    def restore_usage(self, drained: UsageBatch) -> None:
        self.counted.update(drained.counts)

    async def pending_usage(self) -> dict[tuple[str, str], UsageCounts]:
        return dict(self.counted)

    def status(self) -> GatewayStatus:
        return GatewayStatus(stopped=False, admission={}, kv_alarms=())

    async def serve(self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(port)
        try:
            await trio.sleep_forever()
        finally:
            self.counted.update(self.last)


async def test_the_route_feed_follows_the_catalog(tmp_path: Path) -> None:
    async with open_store(f"sqlite://{tmp_path}/llmgw.db") as store:
        await store.put_model(validate_model({"name": "a", "engine": "sim"}), create_only=True)
        gateway = RecordingGateway()
        feed = RouteFeed(store, Registry(), gateway)
        async with trio.open_nursery() as nursery:
            await nursery.start(feed.run)
            assert gateway.routes[-1] == ({"a": []}, {"a": ModelInfo(engine="sim")})
            await store.put_model(validate_model({"name": "b", "engine": "sim"}), create_only=True)
            changed = gateway.routes_changed
            feed.catalog_changed()
            await changed.wait()
            assert gateway.routes[-1] == ({"a": [], "b": []}, {"a": ModelInfo("sim"), "b": ModelInfo("sim")})
            nursery.cancel_scope.cancel()


async def test_the_gateway_is_ready_once_the_known_nodes_are_back(tmp_path: Path) -> None:
    async with open_store(f"sqlite://{tmp_path}/llmgw.db") as store:
        await store.record_node_seen("a", "10.0.0.1")
        await store.record_node_seen("b", "10.0.0.2")
        gateway = RecordingGateway()
        registry = Registry()
        feed = RouteFeed(store, registry, gateway, heartbeat_interval=3600)  # the window never ends here
        async with trio.open_nursery() as nursery:
            await nursery.start(feed.run)
            assert gateway.readiness == [NOT_READY_REASON], "not ready before the first routes"
            hw = Hardware(cpu_count=1, memory_total_mb=1, memory_available_mb=1)
            registry.node_joined("a", "10.0.0.1", hw, ())
            await gateway.routes_changed.wait()
            assert gateway.readiness == [NOT_READY_REASON], "b is not back yet"
            changed = gateway.readiness_changed
            registry.node_joined("b", "10.0.0.2", hw, ())
            await changed.wait()
            assert gateway.readiness == [NOT_READY_REASON, None]
            nursery.cancel_scope.cancel()


async def test_a_fresh_control_plane_is_ready_at_once_and_a_missing_node_is_not_waited_for(tmp_path: Path) -> None:
    async with open_store(f"sqlite://{tmp_path}/llmgw.db") as store:
        gateway = RecordingGateway()
        async with trio.open_nursery() as nursery:
            await nursery.start(RouteFeed(store, Registry(), gateway).run)
            assert gateway.readiness == [NOT_READY_REASON, None], "no node to wait for"
            nursery.cancel_scope.cancel()
        await store.record_node_seen("gone", "10.0.0.9")
        gateway = RecordingGateway()
        async with trio.open_nursery() as nursery:
            await nursery.start(RouteFeed(store, Registry(), gateway, heartbeat_interval=0.01).run)
            with trio.fail_after(10):
                while gateway.readiness[-1] is not None:
                    await gateway.readiness_changed.wait()
            nursery.cancel_scope.cancel()


async def test_access_sync_applies_keys_and_stores_the_usage_left_when_serving_stops(tmp_path: Path) -> None:
    async with open_store(f"sqlite://{tmp_path}/llmgw.db") as store:
        await store.put_tenant(TenantRecord("acme"), create_only=True)
        record, _key = new_api_key("acme", "")
        await store.create_api_key(record)
        await store.set_setting(SERVING_STOPPED, True, "test")
        gateway = RecordingGateway()
        sync = AccessSync(store, gateway, usage_flush_interval=3600)
        async with trio.open_nursery() as nursery:
            await nursery.start(sync.run)
            [access] = gateway.access
            assert access.stopped and [(k.key_id, k.tenant.name) for k in access.keys] == [(record.id, "acme")]
            assert await nursery.start(sync.serve, "127.0.0.1", 1234) == 1234
            gateway.counted[("acme", "m")] = UsageCounts(2, 3, 4)
            assert [(u.requests, u.prompt_tokens) for u in await sync.usage_totals()] == [(2, 3)]
            gateway.last[("acme", "n")] = UsageCounts(1, 1, 1)
            nursery.cancel_scope.cancel()  # the gateway stops: all it counted is stored
        stored = [(u.tenant, u.model, u.requests, u.prompt_tokens, u.completion_tokens)
                  for u in await store.list_usage()]
        assert stored == [("acme", "m", 2, 3, 4), ("acme", "n", 1, 1, 1)]
        assert gateway.counted == {}
