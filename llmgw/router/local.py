"""A gateway in this process, driven through :class:`~llmgw.router.interface.GatewayInterface`.

:class:`GatewayState` applies what the control plane sends to one
:class:`~llmgw.router.app.Gateway` object and reads usage and status back from it.
:class:`LocalGateway` also serves that gateway's app over HTTP. The worker pool
(:class:`~llmgw.router.workers.pool.GatewayPool`) keeps its master state in a
:class:`GatewayState` too, and serves through its worker processes instead.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Mapping, Sequence

import trio

from llmgw.spec import KvDelta

from .admin_api import AdminApiHandler
from .admission import AdmissionShares, TenantCounters, TenantDemand, demand_since
from .app import Gateway, describe_routing, leader_state
from .http.serve import GRACEFUL_SHUTDOWN_S, serve_gateway
from .interface import (
    AccessState, GatewayInterface, GatewayStatus, ModelInfo, Replica, UsageBatch, UsageCounts,
)


class GatewayState(GatewayInterface):
    """The interface applied to ``gateway``'s table, KV index, keys, ``stopped`` and meters
    (everything but :meth:`serve`, left to subclasses)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._demand_mark: dict[str, TenantCounters] = gateway.admission.snapshot()

    def replace_routes(self, replicas: Mapping[str, Sequence[Replica]], models: Mapping[str, ModelInfo]) -> None:
        self.gateway.table.replace_all({model: replicas.get(model, ()) for model in models}, models)

    def kv_update(self, replica_id: str, delta: KvDelta) -> None:
        self.gateway.kv_update(replica_id, delta)

    def kv_forget(self, replica_id: str) -> None:
        self.gateway.kv_forget(replica_id)

    def set_readiness(self, not_ready: str | None) -> None:
        self.gateway.not_ready = not_ready

    def set_leader(self, leading: bool, leader: str, epoch: int) -> None:
        self.gateway.leader = leader_state(leading, leader, epoch)

    def set_admin_api(self, handler: AdminApiHandler | None) -> None:
        self.gateway.admin_api = handler

    def set_extra_metrics(self, render: Callable[[], Awaitable[bytes]] | None) -> None:
        self.gateway.extra_metrics = render

    async def apply_access(self, access: AccessState) -> None:
        self.gateway.auth.replace(access.keys)
        self.gateway.stopped = access.stopped
        self.apply_routing(access.routing)

    def apply_routing(self, overrides: Mapping[str, Any]) -> None:
        """Route by server.yaml's ``routing:`` with ``overrides`` over it (:meth:`Gateway.apply_routing`)."""
        self.gateway.apply_routing(overrides)

    async def apply_admission_shares(self, shares: AdmissionShares) -> None:
        self.gateway.admission.set_shares(shares)

    def admission_demand(self) -> dict[str, TenantDemand]:
        now = self.gateway.admission.snapshot()
        demand = demand_since(self._demand_mark, now)
        self._demand_mark = now
        return demand

    def drain_usage(self) -> UsageBatch:
        return self.gateway.usage.drain()

    def restore_usage(self, drained: UsageBatch) -> None:
        self.gateway.usage.restore(drained)

    async def pending_usage(self) -> dict[tuple[str, str], UsageCounts]:
        return self.gateway.usage.pending()

    def status(self) -> GatewayStatus:
        return GatewayStatus(
            stopped=self.gateway.stopped,
            admission=self.gateway.admission.snapshot(),
            kv_alarms=tuple(sorted(set(self.gateway.policy.alarms()))),
            routing=describe_routing(self.gateway.routing),
            shares=self.gateway.admission.shares,
        )

    async def scrape(self) -> bytes | None:
        """Returns the Prometheus text exposition of the gateway's metrics (a pool: every
        worker's, merged), for ``metrics.listen`` (llmgw/router/metrics_access.py)."""
        return await self.gateway.metrics_body()


class LocalGateway(GatewayState):
    """One gateway serving in this process (``gateway.workers: 1``); when it stops, in-flight
    requests get ``shutdown_grace`` seconds (``gateway.shutdown_grace``) to finish."""

    def __init__(self, gateway: Gateway, *, shutdown_grace: float = GRACEFUL_SHUTDOWN_S) -> None:
        super().__init__(gateway)
        self.shutdown_grace = shutdown_grace

    async def serve(self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the gateway's app (:func:`~llmgw.router.http.serve.serve_gateway`): reports
        the bound port, raises ``OSError`` if it cannot bind. Cancellation drains: no new
        connections, in-flight requests get ``shutdown_grace`` seconds, then the streams
        still open end with an SSE error event; returns once the app has stopped (its usage
        journal closed: every request it counted is journaled)."""
        try:
            await serve_gateway(self.gateway.app, host, port, graceful_timeout=self.shutdown_grace,
                                on_grace_over=self.gateway.streams.cut_all, task_status=task_status)
        finally:
            self.gateway.usage.close()
