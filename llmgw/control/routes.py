"""The gateway's routes: catalog models x ready replicas, kept current as either changes.

:class:`RouteFeed` reads the catalog from the store (again after every
:meth:`RouteFeed.catalog_changed`) and the ready replicas from the registry (after every
registry change), and hands both to the gateway
(:meth:`~llmgw.router.interface.GatewayInterface.replace_routes`).
"""

from __future__ import annotations

import logging

import trio

from llmgw.control.registry import Registry
from llmgw.control.store import Store
from llmgw.router.interface import GatewayInterface, ModelInfo, Replica
from llmgw.spec import ModelSpec

log = logging.getLogger(__name__)

#: Reading the catalog for the gateway's model list; on failure the old list stays.
CATALOG_READ_TIMEOUT = 10.0


def model_info(spec: ModelSpec) -> ModelInfo:
    """Returns what the gateway needs to know about catalog model ``spec`` beyond its replicas."""
    return ModelInfo(
        engine=spec.engine,
        adapters=tuple(a.name for a in spec.adapters),
        max_loaded_adapters=spec.max_loaded_adapters,
    )


class RouteFeed:
    """Keeps ``gateway``'s routes equal to ``store``'s catalog models x ``registry``'s ready replicas."""

    def __init__(self, store: Store, registry: Registry, gateway: GatewayInterface) -> None:
        self.store = store
        self.registry = registry
        self.gateway = gateway
        self._catalog_version = 0
        self._catalog_event = trio.Event()

    def catalog_changed(self) -> None:
        """The catalog changed: read it again. Synchronous; never raises."""
        self._catalog_version += 1
        self._catalog_event.set()
        self._catalog_event = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Feed the gateway until cancelled; report started once the first routes are in.

        A store that cannot be read keeps the previous model list (the gateway goes on
        routing) and is retried on the next change.
        """
        infos: dict[str, ModelInfo] = {}  # catalog models, in catalog order
        seen_registry = -1
        seen_catalog = -1
        started = False
        while True:
            if seen_catalog != self._catalog_version:
                seen_catalog = self._catalog_version
                try:
                    with trio.fail_after(CATALOG_READ_TIMEOUT):
                        specs = await self.store.list_models()
                    infos = {m.name: model_info(m) for m in specs}
                except Exception as exc:  # noqa: BLE001 - keep serving with the last good list
                    log.warning("gateway: could not read the catalog: %s", exc)
            seen_registry = self.registry.version
            self.gateway.replace_routes(
                {
                    model: [Replica(r.id, r.model, r.endpoint, r.node_id, r.engine, r.adapters)
                            for r in self.registry.replicas_of(model)]
                    for model in infos
                },
                infos,
            )
            if not started:
                task_status.started()
                started = True
            async with trio.open_nursery() as waiters:
                catalog_event = self._catalog_event

                async def registry_changed() -> None:
                    await self.registry.wait_changed(seen_registry)
                    waiters.cancel_scope.cancel()

                async def catalog_changed() -> None:
                    await catalog_event.wait()
                    waiters.cancel_scope.cancel()

                waiters.start_soon(registry_changed)
                waiters.start_soon(catalog_changed)
