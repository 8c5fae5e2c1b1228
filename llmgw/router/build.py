"""Gateway assembly: one place that turns :class:`GatewaySettings` into a gateway.

:func:`build_gateway` returns what the control plane drives
(:class:`~llmgw.router.interface.GatewayInterface`): with ``gateway.workers`` 1 a
:class:`~llmgw.router.local.LocalGateway`, above 1 a
:class:`~llmgw.router.workers.pool.GatewayPool`. :func:`assemble_gateway` builds the
:class:`~llmgw.router.app.Gateway` object itself, for the local gateway, for the pool's
master state and for each worker process.
"""

from __future__ import annotations

from llmgw.usage_journal import UsageJournal

from .admission import Admission, AdmissionLimits
from .app import Gateway
from .auth import AuthTable
from .http.upstream import UpstreamTimeouts
from .local import GatewayState, LocalGateway
from .replicas import LoadTracker, ReplicaTable
from .settings import GatewaySettings
from .tracing import create_tracer
from .usage import UsageMeter
from .workers.pool import GatewayPool, ObservedAuthTable, ObservedTable, PooledAdmission


def admission_limits(settings: GatewaySettings) -> AdmissionLimits:
    """Return the admission limits of ``settings.serving``; each tenant limit is divided
    among ``settings.gateway.workers`` (every worker enforces its part)."""
    serving = settings.serving
    return AdmissionLimits(serving.max_inflight_per_replica, serving.queue_size, serving.queue_timeout,
                           tenant_parts=settings.gateway.workers)


def upstream_timeouts(settings: GatewaySettings) -> UpstreamTimeouts:
    """Return the upstream deadlines of ``settings.gateway``."""
    gateway = settings.gateway
    return UpstreamTimeouts(
        connect=gateway.connect_timeout, first_byte=gateway.first_byte_timeout, chunk=gateway.chunk_timeout
    )


def assemble_gateway(
    settings: GatewaySettings,
    *,
    table: ReplicaTable | None = None,
    auth: AuthTable | None = None,
    admission: Admission | None = None,
    served: bool = True,
) -> Gateway:
    """Return a :class:`Gateway` configured by ``settings`` over ``table`` (None: a new one).

    ``auth`` and ``admission`` default to a fresh :class:`AuthTable` (``auth.enabled``) and
    :class:`Admission` (``serving`` limits). A served gateway journals its usage in
    ``settings.usage_journal`` when that is set. With ``served`` False the gateway only holds
    state for others to serve (the pool's master): it gets no routing policy, upstream
    deadlines, tracer or usage journal of its own (its usage comes from the workers). Raises
    ``RuntimeError`` if tracing is on but
    OpenTelemetry is not installed, ``ValueError`` for a malformed tracing endpoint.
    """
    table = table if table is not None else ReplicaTable()
    auth = auth if auth is not None else AuthTable(enabled=settings.auth.enabled)
    admission = admission if admission is not None else Admission(admission_limits(settings))
    if not served:
        return Gateway(table, auth=auth, admission=admission, max_request_bytes=settings.serving.max_request_bytes)
    load = LoadTracker()
    journal = UsageJournal(settings.usage_journal) if settings.usage_journal is not None else None
    gateway = Gateway(
        table, load=load, routing=settings.routing, timeouts=upstream_timeouts(settings),
        tracer=create_tracer(settings.tracing), auth=auth, admission=admission, usage=UsageMeter(journal),
        max_request_bytes=settings.serving.max_request_bytes, metrics_config=settings.metrics,
    )
    if journal is not None:
        journal.on_failure = gateway.metrics.usage_journal_failed
    return gateway


def build_gateway(settings: GatewaySettings) -> GatewayState:
    """Return the gateway ``settings`` describe, not yet serving (call its ``serve``).

    Raises as :func:`assemble_gateway`; with ``gateway.workers`` > 1 tracing errors come
    from the workers when they start instead.
    """
    if settings.gateway.workers > 1:
        master = assemble_gateway(
            settings, table=ObservedTable(), auth=ObservedAuthTable(enabled=settings.auth.enabled),
            admission=PooledAdmission(admission_limits(settings)), served=False,
        )
        return GatewayPool(master, settings)
    return LocalGateway(assemble_gateway(settings), shutdown_grace=settings.gateway.shutdown_grace)
