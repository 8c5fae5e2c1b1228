"""The reconciler: brings the fleet towards the catalog, one placement pass at a time.

Public API::

    rec = Reconciler(registry, catalog, executor)       # catalog: async () -> Sequence[ModelSpec]
    await nursery.start(rec.run)                          # runs until cancelled
    rec.catalog_changed()                                 # the caller saw the catalog change
    await rec.reconcile_once() -> PassResult              # one pass (run() calls this)
    rec.last_unplaceable, rec.last_waiting, rec.last_pass # for `ctl replicas` / status

The executor is implemented by the RPC layer (it calls agents)::

    class Executor(Protocol):
        async def start_replica(self, node_id: str, spec: ShardSpec) -> None
        async def stop_replica(self, node_id: str, shard_id: str) -> None
        async def drain_replica(self, node_id: str, shard_id: str, timeout: float) -> bool

A pass reads the catalog and a registry snapshot, updates the failure book
(:func:`~llmgw.control.placement.note_failures`), computes
:func:`~llmgw.control.placement.plan` and executes it: each node's actions run in order
(stops before starts), different nodes concurrently, each action under
``action_timeout``. Before a start the shard is reserved in the registry
(``shard_started``); after a stop succeeds it is removed (``shard_removed``), and so
is a shard the node answers "unknown shard" for (nothing runs there to stop). A start that
fails marks the shard FAILED in the registry, so the next pass asks the node to stop it
(it may have started after all) and the model's failure backoff applies. A stop that fails
is simply planned again. Nothing an executor raises ends the loop; cancellation does.

A stop that is a rollout step (``StopReplica.rollout``) first takes the replica out of
routing (``shard_draining``), waits ``rollout_settle`` seconds for the route change to reach
every gateway, then asks the node to wait until the engine has no request in flight, at most
``rollout_drain`` seconds (``drain_replica``), and stops it then, drained or not. The node's
actions wait for the drain (a long stream holds that node's next actions, never other
nodes'). A drain that fails (an agent without the call) falls back to the old fixed wait,
:data:`ROLLOUT_DRAIN_S`. Rollouts log each step with its reason.

Passes run one at a time: after a registry change, ``catalog_changed()``, the end of a
failure backoff, or every ``tick`` seconds as a safety net.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Awaitable, Callable, Protocol, Sequence

import attrs
import capnp
import trio

from llmgw.control import placement
from llmgw.control.placement import Action, StartReplica, StopReplica, Unplaceable, Waiting
from llmgw.control.registry import Registry
from llmgw.logthrottle import LogThrottle
from llmgw.rpc.errors import remote_reason
from llmgw.spec import ModelSpec, ShardSpec, ShardState, ShardStatus, UnknownShard

log = logging.getLogger(__name__)
#: An unplaceable model, or a start or stop that keeps failing, repeats every pass until
#: something changes: one line per kind, then one per interval with a count.
_repeats = LogThrottle(log)

# Safety net: even if a change notification were missed (or free GPU memory moved, which
# heartbeats do not announce), a pass runs at least this often.
RECONCILE_TICK_S = 30.0
# After a change, wait this long before the pass so a burst (many nodes joining after a
# control-plane failover, a batch of status reports) is handled by one pass, not hundreds.
RECONCILE_COALESCE_S = 0.2
# One start or stop call to an agent. The agent answers once the engine process is
# spawned (not when it is ready), so this only has to cover a slow or dying peer; a pass
# waits for its slowest action, so it must not be long.
ACTION_TIMEOUT_S = 15.0
# Reading the catalog from the store; on failure the pass is skipped (never treated as
# an empty catalog, which would stop every replica) and retried after CATALOG_RETRY_S.
CATALOG_TIMEOUT_S = 10.0
CATALOG_RETRY_S = 5.0
# A rollout stops a replica that serves: it is first taken out of routing, then left this long
# before the engine is asked whether it is idle, so the route change reaches every gateway
# (standbys get it streamed from the leader) and a request sent on the old route has arrived.
ROLLOUT_SETTLE_S = 1.0
# The most a rollout waits for an old replica's engine to finish its requests in flight (streams
# included) before stopping it anyway: long generations finish, a stuck client cannot hold the
# rollout (and that node's next actions) for ever.
ROLLOUT_DRAIN_MAX_S = 120.0
# The fixed wait when the drain call fails (an agent too old to have it): the wait every rollout
# had before the drain read the engine; a stream longer than this is cut.
ROLLOUT_DRAIN_S = 5.0
#: While no node has joined for this long after the reconciler started, "cannot place" is
#: logged at INFO: every start of a control plane (and `llmgw up`) waits that briefly for
#: its nodes; a cluster without nodes past it is worth a warning.
NO_NODE_GRACE_S = 60.0


class Executor(Protocol):
    """Carries out placement actions on agents; implemented by the RPC layer."""

    async def start_replica(self, node_id: str, spec: ShardSpec) -> None:
        """Ask ``node_id`` to start ``spec``; may raise if the peer is dead or refuses."""
        ...

    async def stop_replica(self, node_id: str, shard_id: str) -> None:
        """Ask ``node_id`` to stop and forget ``shard_id`` (idempotent); may raise.

        Raises :class:`~llmgw.spec.UnknownShard` if the node has no such shard: the
        reconciler counts it as stopped (removed from the registry, so the next pass,
        which that removal triggers, places the model anew).
        """
        ...

    async def drain_replica(self, node_id: str, shard_id: str, timeout: float) -> bool:
        """Ask ``node_id`` to wait until ``shard_id``'s engine has no request in flight, at most
        ``timeout`` seconds; returns whether it got there (logging what is still in flight when
        not). May raise (the reconciler then
        waits :data:`ROLLOUT_DRAIN_S` instead)."""
        ...


@attrs.frozen
class PassResult:
    """What one pass did. ``errors`` pairs each action that failed with the error text;
    ``skipped`` is set (and the rest empty) when the catalog could not be read."""

    at: float
    actions: tuple[Action, ...] = ()
    errors: tuple[tuple[Action, str], ...] = ()
    skipped: str = ""


class Reconciler:
    """The reconcile loop. See the module docstring for the API and behaviour."""

    def __init__(
        self,
        registry: Registry,
        catalog: Callable[[], Awaitable[Sequence[ModelSpec]]],
        executor: Executor,
        *,
        tick: float = RECONCILE_TICK_S,
        coalesce: float = RECONCILE_COALESCE_S,
        action_timeout: float = ACTION_TIMEOUT_S,
        catalog_timeout: float = CATALOG_TIMEOUT_S,
        new_id: Callable[[str], str] = placement.random_shard_id,
        rollout_drain: float = ROLLOUT_DRAIN_MAX_S,
        rollout_settle: float = ROLLOUT_SETTLE_S,
    ) -> None:
        self._registry = registry
        self._catalog = catalog
        self._executor = executor
        self._tick = tick
        self._coalesce = coalesce
        self._action_timeout = action_timeout
        self._catalog_timeout = catalog_timeout
        self._new_id = new_id
        self._rollout_drain = rollout_drain
        self._rollout_settle = rollout_settle
        self._catalog_event = trio.Event()
        self._failures: dict[str, placement.FailureRecord] = {}
        self.passes = 0
        self._started: float | None = None  # the first pass's time
        self.last_pass: PassResult | None = None
        self.last_unplaceable: tuple[Unplaceable, ...] = ()
        self.last_waiting: tuple[Waiting, ...] = ()

    @property
    def failures(self) -> dict[str, placement.FailureRecord]:
        """The per-model failure book (a copy), for display."""
        return dict(self._failures)

    def catalog_changed(self) -> None:
        """Ask for a pass soon: the desired state changed. Safe to call any time."""
        self._catalog_event.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run passes until cancelled. Reports started before the first pass."""
        task_status.started()
        while True:
            seen = self._registry.version
            result = await self.reconcile_once()
            now = trio.current_time()
            wake = now + self._tick
            if result.skipped:
                wake = min(wake, now + CATALOG_RETRY_S)
            for w in self.last_waiting:
                wake = min(wake, w.until)
            if result.errors:
                # Retry failed actions on a later pass, but not in a tight loop.
                wake = min(wake, now + self._action_timeout)
            with trio.move_on_at(wake):
                await self._wait_for_change(seen)
            await trio.sleep(self._coalesce)

    async def _wait_for_change(self, seen: int) -> None:
        async with trio.open_nursery() as nursery:

            async def registry_changed() -> None:
                await self._registry.wait_changed(seen)
                nursery.cancel_scope.cancel()

            async def catalog_changed() -> None:
                await self._catalog_event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(registry_changed)
            nursery.start_soon(catalog_changed)

    async def reconcile_once(self) -> PassResult:
        """Run one pass: read catalog and fleet, plan, execute; return what happened.

        Executor failures are logged and recorded in the result, never raised. If the
        catalog cannot be read the pass does nothing and says so in ``skipped``.
        """
        self.passes += 1
        self._catalog_event = trio.Event()
        try:
            with trio.fail_after(self._catalog_timeout):
                desired = list(await self._catalog())
        except Exception as exc:
            log.warning("reconcile pass skipped: cannot read the catalog: %s", exc)
            result = PassResult(at=trio.current_time(), skipped=f"cannot read the catalog: {exc}")
            self.last_pass = result
            return result

        now = trio.current_time()
        fleet = self._registry.snapshot()
        names = {m.name for m in desired}
        book = placement.note_failures(self._failures, fleet, now)
        self._failures = {m: r for m, r in book.items() if m in names}
        actions = placement.plan(desired, fleet, now=now, failures=self._failures, new_id=self._new_id)

        per_node: dict[str, list[StartReplica | StopReplica]] = defaultdict(list)
        for action in actions:
            if isinstance(action, (StartReplica, StopReplica)):
                per_node[action.node_id].append(action)
                if isinstance(action, StartReplica):
                    # Reserve now, before any await, so the reservation is visible at once.
                    self._registry.shard_started(action.node_id, action.shard_spec)
        self.last_unplaceable = tuple(a for a in actions if isinstance(a, Unplaceable))
        self.last_waiting = tuple(a for a in actions if isinstance(a, Waiting))
        if self._started is None:
            self._started = now
        starting = not fleet.nodes and now - self._started < NO_NODE_GRACE_S
        level = logging.INFO if starting else logging.WARNING
        for u in self.last_unplaceable:
            _repeats.failure(("unplaceable", u.model, u.reason, level), level,
                             "cannot place %d replica(s): %s", u.missing, u.reason)

        errors: list[tuple[Action, str]] = []
        async with trio.open_nursery() as nursery:
            for node_id in sorted(per_node):
                nursery.start_soon(self._run_node, node_id, per_node[node_id], errors)
        if per_node:
            log.info(
                "reconcile pass %d: %d action(s) on %d node(s), %d failed",
                self.passes, sum(map(len, per_node.values())), len(per_node), len(errors),
            )
        result = PassResult(at=now, actions=tuple(actions), errors=tuple(errors))
        self.last_pass = result
        return result

    async def _run_node(
        self, node_id: str, actions: list[StartReplica | StopReplica], errors: list[tuple[Action, str]]
    ) -> None:
        """Execute one node's actions in order, stops first; record failures in ``errors``."""
        ordered = sorted(actions, key=lambda a: isinstance(a, StartReplica))
        for action in ordered:
            if isinstance(action, StopReplica) and action.rollout:
                await self._drain(node_id, action)
            try:
                with trio.fail_after(self._action_timeout):
                    if isinstance(action, StopReplica):
                        log.info("stopping %s on node %s: %s", action.shard_id, node_id, action.reason)
                        try:
                            await self._executor.stop_replica(node_id, action.shard_id)
                        except UnknownShard as exc:  # nothing runs there: gone, and placed anew at once
                            log.info("node %s: %s; counting it as stopped", node_id, exc)
                    else:
                        spec = action.shard_spec
                        log.info("starting %s on node %s: %s", spec.id, node_id, action.reason)
                        await self._executor.start_replica(node_id, spec)
            except Exception as exc:
                text = _describe(exc, self._action_timeout)
                errors.append((action, text))
                if isinstance(action, StopReplica):
                    _repeats.failure(("stop", node_id, action.shard_id), logging.WARNING,
                                     "stop of %s on node %s failed (will retry): %s", action.shard_id, node_id, text)
                else:
                    _repeats.failure(("start", node_id, action.shard_spec.model), logging.WARNING,
                                     "start of %s on node %s failed: %s", action.shard_spec.id, node_id, text)
                    self._start_failed(node_id, action.shard_spec, text)
                continue
            if isinstance(action, StopReplica):
                self._registry.shard_removed(node_id, action.shard_id)

    async def _drain(self, node_id: str, action: StopReplica) -> None:
        """Takes the replica a rollout stops out of routing, waits ``rollout_settle`` seconds,
        then for its engine's requests in flight (at most ``rollout_drain`` seconds; a failed
        drain call: :data:`ROLLOUT_DRAIN_S`); returns at once if the registry no longer has it."""
        if not self._registry.shard_draining(node_id, action.shard_id):
            return
        log.info("rollout: draining %s on node %s (at most %g s) before it stops (%s)",
                 action.shard_id, node_id, self._rollout_drain, action.reason)
        start = trio.current_time()
        await trio.sleep(self._rollout_settle)
        try:
            idle = await self._executor.drain_replica(node_id, action.shard_id, self._rollout_drain)
        except UnknownShard:
            return  # nothing runs there: the stop that follows counts it as stopped
        except Exception as exc:
            log.warning("rollout: drain of %s on node %s failed (%s); waiting a fixed %g s instead",
                        action.shard_id, node_id, _describe(exc, self._rollout_drain), ROLLOUT_DRAIN_S)
            await trio.sleep_until(start + ROLLOUT_DRAIN_S)
            return
        if idle:  # not idle: the executor has logged how many requests are still in flight
            log.info("rollout: drained %s on node %s in %.1f s", action.shard_id, node_id, trio.current_time() - start)

    def _start_failed(self, node_id: str, spec: ShardSpec, text: str) -> None:
        status = ShardStatus(id=spec.id, state=ShardState.FAILED, message=f"start request failed: {text}")
        try:
            self._registry.shard_status(node_id, status)
        except Exception:  # the node was forgotten meanwhile: nothing left to mark
            log.debug("node %s gone before its failed start could be recorded", node_id)


def _describe(exc: Exception, timeout: float) -> str:
    """Returns one line saying why an action failed: a node's refusal in its own words."""
    if isinstance(exc, trio.TooSlowError):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, capnp.KjException):
        return remote_reason(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
