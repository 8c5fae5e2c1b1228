"""What a gateway is configured with: the ``server.yaml`` sections it reads, in one value.

Kept apart from :mod:`llmgw.router.build` (which imports the whole gateway) so that the
worker wire protocol can carry it without import cycles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from llmgw.config import AuthConfig, GatewayConfig, MetricsConfig, RoutingConfig, ServingConfig, TracingConfig
from llmgw.usage_journal import journal_dir


@attrs.frozen
class GatewaySettings:
    """``server.yaml``'s ``gateway``, ``serving``, ``auth``, ``routing`` and ``tracing``
    sections (``tracing`` None: off), and where each serving process journals its usage
    (``usage_journal``: a directory, :mod:`llmgw.usage_journal`; None: no journal)."""

    gateway: GatewayConfig = GatewayConfig()
    serving: ServingConfig = ServingConfig()
    auth: AuthConfig = AuthConfig()
    routing: RoutingConfig = RoutingConfig()
    tracing: TracingConfig | None = None
    usage_journal: Path | None = None
    #: ``metrics:``: who may read /metrics, and whether it has its own address.
    metrics: MetricsConfig = MetricsConfig()

    @classmethod
    def of(cls, config: Any) -> GatewaySettings:
        """Return the gateway's sections of ``config`` (a :class:`llmgw.config.ServerConfig`),
        journaling usage under its ``state_dir``."""
        return cls(gateway=config.gateway, serving=config.serving, auth=config.auth, routing=config.routing,
                   metrics=config.metrics,
                   tracing=config.tracing, usage_journal=journal_dir(config.state_dir))
