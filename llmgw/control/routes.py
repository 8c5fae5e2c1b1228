"""The gateway's routes: catalog models x ready replicas, kept current as either changes.

:class:`RouteFeed` reads the catalog from the store (again after every
:meth:`RouteFeed.catalog_changed`) and the ready replicas from the registry (after every
registry change), and hands both to the gateway
(:meth:`~llmgw.router.interface.GatewayInterface.replace_routes`).

It also says when the gateway is ready
(:meth:`~llmgw.router.interface.GatewayInterface.set_readiness`): a control plane that
starts has an empty registry, so until the nodes it knew have joined again its gateway
would answer 503 for models whose engines are running fine. The gateway is not ready
until every node in the store's list is back, or :data:`REJOIN_HEARTBEATS` heartbeat
intervals have passed (a node that is not back by then is not waited for), and a pass of
routes has been handed over after that.

A control plane that takes the lead from another (a failover) was a standby whose gateway
routed by the old leader's table: it passes that table as ``inherited``, and until the
nodes are back the gateway routes to the replicas the table had on every node not yet
rejoined (their engines kept serving), and stays ready.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import trio

from llmgw.config.defaults import DEFAULT_HEARTBEAT_INTERVAL
from llmgw.control.registry import NodeState, Registry
from llmgw.control.store import Store
from llmgw.router.interface import GatewayInterface, ModelInfo, Replica
from llmgw.spec import ModelSpec

log = logging.getLogger(__name__)

#: Reading the catalog for the gateway's model list; on failure the old list stays.
CATALOG_READ_TIMEOUT = 10.0
#: How long a starting control plane waits for the nodes it knew, in heartbeat intervals:
#: an agent notices the restart at its next heartbeat (one interval), redials within about
#: a second (its reconnect backoff is capped there) and joins; three intervals cover that
#: with room for a busy node, and bound how long a node that is gone for good delays readiness.
REJOIN_HEARTBEATS = 3
#: What ``/readyz`` says until then.
NOT_READY_REASON = "starting: waiting for the nodes to rejoin and the replica table to be rebuilt"


def model_info(spec: ModelSpec) -> ModelInfo:
    """Returns what the gateway needs to know about catalog model ``spec`` beyond its replicas."""
    return ModelInfo(
        engine=spec.engine,
        adapters=tuple(a.name for a in spec.adapters),
        max_loaded_adapters=spec.max_loaded_adapters,
    )


class RouteFeed:
    """Keeps ``gateway``'s routes equal to ``store``'s catalog models x ``registry``'s ready
    replicas, and its readiness (see the module docstring; ``heartbeat_interval`` is the
    cluster's, in seconds)."""

    def __init__(
        self, store: Store, registry: Registry, gateway: GatewayInterface | Any, *,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        inherited: Mapping[str, Sequence[Replica]] | None = None,
    ) -> None:
        self.store = store
        self.registry = registry
        self.gateway = gateway  # or anything with its feeding methods (llmgw.control.peers.FeedTee)
        self.inherited = inherited
        #: Set once the nodes the store knew are back (or the rejoin window is over): from
        #: then on the registry is the fleet, and placing replicas on it is safe.
        self.rejoined = trio.Event()
        self.rejoin_window = REJOIN_HEARTBEATS * heartbeat_interval
        self._catalog_version = 0
        self._catalog_event = trio.Event()

    def catalog_changed(self) -> None:
        """The catalog changed: read it again. Synchronous; never raises."""
        self._catalog_version += 1
        self._catalog_event.set()
        self._catalog_event = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Feed the gateway until cancelled; report started once the first routes are in.

        The gateway is marked not ready before anything else, and ready after the first
        pass once the known nodes are back (or the rejoin window is over). A store that
        cannot be read keeps the previous model list (the gateway goes on routing) and is
        retried on the next change; a node list that cannot be read is waited for the whole
        window.
        """
        if self.inherited is None:
            self.gateway.set_readiness(NOT_READY_REASON)
        ready_at = trio.current_time() + self.rejoin_window
        expected = await self._known_nodes()
        infos: dict[str, ModelInfo] = {}  # catalog models, in catalog order
        seen_registry = -1
        seen_catalog = -1
        started = False
        ready = False
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
                {model: self._replicas(model, inherit=not ready) for model in infos}, infos,
            )
            if not started:
                task_status.started()
                started = True
            if not ready and self._rejoined(expected, ready_at):
                ready = True
                self.gateway.set_readiness(None)
                self.rejoined.set()
                log.info("gateway ready: the replica table is rebuilt")
                if self.inherited:
                    continue  # once more, without the inherited replicas of nodes that did not come back
            async with trio.open_nursery() as waiters:
                catalog_event = self._catalog_event

                async def registry_changed() -> None:
                    await self.registry.wait_changed(seen_registry)
                    waiters.cancel_scope.cancel()

                async def catalog_changed() -> None:
                    await catalog_event.wait()
                    waiters.cancel_scope.cancel()

                async def window_over() -> None:
                    await trio.sleep_until(ready_at)
                    waiters.cancel_scope.cancel()

                waiters.start_soon(registry_changed)
                waiters.start_soon(catalog_changed)
                if not ready:
                    waiters.start_soon(window_over)

    def _replicas(self, model: str, *, inherit: bool) -> list[Replica]:
        """Returns ``model``'s ready replicas in the registry, and, with ``inherit``, the
        inherited ones on nodes that have not rejoined yet."""
        replicas = [Replica(r.id, r.model, r.endpoint, r.node_id, r.engine, r.adapters, r.api_key)
                    for r in self.registry.replicas_of(model)]
        if inherit and self.inherited:
            nodes = self.registry.snapshot().nodes
            replicas += [r for r in self.inherited.get(model, ()) if r.node_id not in nodes]
        return replicas

    async def _known_nodes(self) -> set[str] | None:
        """Returns the ids of every node the store has seen join (None: the store failed)."""
        try:
            with trio.fail_after(CATALOG_READ_TIMEOUT):
                return {node.id for node in await self.store.list_known_nodes()}
        except Exception as exc:  # noqa: BLE001 - readiness then waits for the whole window
            log.warning("gateway: could not read the known nodes: %s", exc)
            return None

    def _rejoined(self, expected: set[str] | None, ready_at: float) -> bool:
        """Returns whether the gateway may be ready: every ``expected`` node is ONLINE
        again (None: unknown), or the window ending at ``ready_at`` is over."""
        if trio.current_time() >= ready_at:
            return True
        if expected is None:
            return False
        nodes = self.registry.snapshot().nodes
        return all(node_id in nodes and nodes[node_id].state is NodeState.ONLINE for node_id in expected)
