"""The one interface through which a control plane drives a gateway, and the values it carries.

:class:`GatewayInterface` is all the control plane knows of the gateway: it is given the
routes (catalog models x ready replicas), the engines' KV-cache deltas, the access
tables (API keys with their tenants, ``serving.stopped``), and it hands back usage and a
status. Two implementations exist, both made by :func:`llmgw.router.build.build_gateway`:
one gateway serving in this process (:class:`llmgw.router.local.LocalGateway`) and a pool
of worker processes on one port (:class:`llmgw.router.workers.pool.GatewayPool`). A
standby control plane feeds its own gateway through the same methods, from the leader's
stream instead of its own registry and store.

Every feeding method but :meth:`GatewayInterface.apply_access` is synchronous, cheap and
never raises, so it can be called from a registry or session callback on the trio
thread. The values are the router's own plain ``attrs`` classes (their modules import
nothing heavier than attrs and trio), re-exported here so that ``llmgw.control`` imports
nothing else of the router.
"""

from __future__ import annotations

import abc
from typing import Any, Awaitable, Callable, Mapping, Sequence

import attrs
import trio

from llmgw.spec import KvDelta

from .admin_api import NO_ADMIN_API, AdminApiHandler, ApiRequest, ApiResponse, api_error
from .admission import AdmissionShares, TenantCounters, TenantDemand, TenantShare
from .auth import KeyEntry, Tenant
from .replicas import ModelInfo, Replica
from .usage import UsageBatch, UsageCounts

__all__ = [
    "NO_ADMIN_API", "AccessState", "AdminApiHandler", "AdmissionShares", "ApiRequest", "ApiResponse", "api_error",
    "GatewayInterface", "GatewayStatus", "KeyEntry", "ModelInfo", "Replica",
    "Tenant", "TenantCounters", "TenantDemand", "TenantShare", "UsageBatch", "UsageCounts", "UsageCountsByKey",
]

#: Usage counts keyed by ``(tenant, model)``.
UsageCountsByKey = Mapping[tuple[str, str], UsageCounts]


@attrs.frozen
class AccessState:
    """Who may use the gateway and how it routes: the active API keys (each with its tenant
    and limits), the cluster setting ``serving.stopped`` (True: every POST under /v1/ answers
    503) and the cluster setting ``routing`` (:class:`~llmgw.config.RoutingConfig` field
    values over server.yaml's ``routing:``; empty: server.yaml's as it is)."""

    keys: tuple[KeyEntry, ...] = ()
    stopped: bool = False
    routing: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class GatewayStatus:
    """What ``llmgw ctl status`` shows of the gateway."""

    #: ``serving.stopped`` as the gateway applies it.
    stopped: bool
    #: Per-tenant admission counters (summed over the workers of a pool).
    admission: Mapping[str, TenantCounters]
    #: KV-routing hash-agreement alarms in words, sorted, once each ([] without a KV-aware policy).
    kv_alarms: tuple[str, ...]
    #: The routing in effect (server.yaml's ``routing:`` with the cluster setting over it), in words.
    routing: str = ""
    #: This gateway's shares of the tenants' limits (all 1 with one gateway; docs/ha.md).
    shares: AdmissionShares = AdmissionShares()


class GatewayInterface(abc.ABC):
    """A gateway as the control plane drives it (see the module docstring)."""

    # -- routes and KV-cache state (down) ------------------------------------------------

    @abc.abstractmethod
    def replace_routes(self, replicas: Mapping[str, Sequence[Replica]], models: Mapping[str, ModelInfo]) -> None:
        """Make the served models exactly ``models`` (catalog order), each routed over its
        ``replicas`` (a model without an entry there has none ready)."""

    @abc.abstractmethod
    def kv_update(self, replica_id: str, delta: KvDelta) -> None:
        """Apply one KV-cache delta reported for ``replica_id``, in the order they arrive."""

    @abc.abstractmethod
    def kv_forget(self, replica_id: str) -> None:
        """Drop ``replica_id``'s KV-cache state (its shard stopped or its node was lost)."""

    @abc.abstractmethod
    def set_readiness(self, not_ready: str | None) -> None:
        """Say why the gateway is not ready (``GET /readyz`` answers 503 with it), or None
        once it is (200). A control plane that starts marks it not ready until its replica
        table is rebuilt; ``/healthz`` (liveness) does not change."""

    @abc.abstractmethod
    def set_leader(self, leading: bool, leader: str, epoch: int) -> None:
        """Say whether this control plane leads (``GET /leader`` answers 200 on the leader,
        503 elsewhere, for load balancers and keepalived), who does and at which epoch
        (``leader`` "" while unknown)."""

    @abc.abstractmethod
    def set_admin_api(self, handler: AdminApiHandler | None) -> None:
        """Answer ``/api/v1/*`` on the gateway's port with ``handler`` (None: 404, no admin API)."""

    @abc.abstractmethod
    def set_extra_metrics(self, render: Callable[[], Awaitable[bytes]] | None) -> None:
        """Append what ``render()`` returns (series in the Prometheus text format, families of
        their own) to every scrape of the gateway's ``/metrics`` (None: nothing): the control
        plane's fleet telemetry, written outside the trio thread. A pool appends it to the
        workers' merged samples, from this process."""

    # -- access (down) -------------------------------------------------------------------

    @abc.abstractmethod
    async def apply_access(self, access: AccessState) -> None:
        """Apply ``access`` to every request from now on.

        Returns once it is applied; a pool waits (bounded) for its workers, so a revoked
        key is refused when the admin call that revoked it returns. Never raises.
        """

    # -- admission shares (several control planes: llmgw/control/admission_shares.py) ---

    @abc.abstractmethod
    async def apply_admission_shares(self, shares: AdmissionShares) -> None:
        """Enforce ``shares`` of every tenant's limits from the next request on.

        Returns once they are applied; a pool waits (bounded) for its workers, and a
        worker that starts later gets them before it listens. Never raises.
        """

    @abc.abstractmethod
    def admission_demand(self) -> dict[str, TenantDemand]:
        """Return each tenant's demand since the previous call (in flight now; admitted,
        shed and tokens asked for since then), leaving out tenants with none. A pool's is
        as of its workers' last reports. Synchronous; never raises."""

    # -- usage and status (up) -----------------------------------------------------------

    @abc.abstractmethod
    def drain_usage(self) -> UsageBatch:
        """Return the usage counted since the last drain and reset it (the caller now owns
        it: store its counts with its journal marks, or give it back with :meth:`restore_usage`)."""

    @abc.abstractmethod
    def restore_usage(self, drained: UsageBatch) -> None:
        """Add ``drained`` back (a store write failed; the next drain returns it again)."""

    @abc.abstractmethod
    async def pending_usage(self) -> dict[tuple[str, str], UsageCounts]:
        """Return the usage counted up to now and not yet drained, without draining it (a
        pool asks its workers first, waiting a few seconds at most)."""

    @abc.abstractmethod
    def status(self) -> GatewayStatus:
        """Return the gateway's status as of now."""

    # -- serving -------------------------------------------------------------------------

    @abc.abstractmethod
    async def serve(self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve HTTP on ``host``:``port`` (0: a free port) until cancelled.

        Reports the bound port once requests are accepted. Raises ``OSError`` if the port
        cannot be bound. Cancellation finishes in-flight requests for a short grace period,
        then returns; usage counted until then is in :meth:`drain_usage`.
        """
