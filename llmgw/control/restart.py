"""``llmgw ctl restart``: every agent, then every standby, then the leader, engines serving throughout.

:func:`restart_cluster` runs on the leader. Each agent restarts over its session
(``Agent.restart``: it execs itself, and adopts its engines when it starts again); the step
ends when every one of them has joined again. Then each standby restarts over its peer
session (``GatewayFeed.restart``), one at a time, each back (streaming from the leader
again) before the next. The caller restarts the leader itself last, after answering.
Each wait is bounded by :data:`STEP_TIMEOUT_S`: a node or standby that is not back by then
is named in the error, and the restart goes no further.
"""

from __future__ import annotations

import logging
from typing import Any

import capnp
import trio

from llmgw.control.peers import FeedTee
from llmgw.control.registry import NodeState, Registry
from llmgw.control.sessions import NodeSessions
from llmgw.rpc.errors import remote_reason

log = logging.getLogger(__name__)

#: How long one step may take: the agents back, or one standby back.
STEP_TIMEOUT_S = 60.0
#: Bound on the restart call itself (it only schedules the restart).
CALL_TIMEOUT_S = 10.0


async def restart_cluster(
    registry: Registry, sessions: NodeSessions, tee: FeedTee, *, answering: str = "",
) -> tuple[int, int]:
    """Restart every agent, then every standby but ``answering`` (the one the caller's call
    came through, if any: it is asked to restart last, right after this returns, and does so
    once it has passed on the answer); returns how many agents and standbys. Raises
    RuntimeError naming what did not come back within :data:`STEP_TIMEOUT_S`."""
    agents = sessions.all()
    old = {s.node_id: s for s in agents}
    log.info("restart: %d agent(s) first", len(agents))
    refused: list[str] = []
    async with trio.open_nursery() as nursery:
        for session in agents:
            nursery.start_soon(_call, session.agent.restart, f"node {session.node_id}", refused)
    if refused:
        raise RuntimeError("restart stopped: " + "; ".join(sorted(refused)))
    with trio.move_on_after(STEP_TIMEOUT_S):
        while _not_back(registry, sessions, old):
            await registry.wait_changed(registry.version)
    missing = _not_back(registry, sessions, old)
    if missing:
        raise RuntimeError(f"restart stopped: node(s) {', '.join(missing)} did not join again within "
                           f"{STEP_TIMEOUT_S:g}s (see `llmgw ctl nodes`); the control planes were not restarted")
    standbys = tee.standbys()
    last = [(n, f) for n, f in standbys if n == answering]
    for name, feed in [(n, f) for n, f in standbys if n != answering]:
        log.info("restart: standby %s", name)
        with trio.move_on_after(STEP_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_call, feed.restart, f"standby {name}", refused)
                while not any(n == name and f is not feed for n, f in tee.standbys()):
                    await tee.wait_attached()
            if refused:
                raise RuntimeError("restart stopped: " + "; ".join(refused))
            continue
        raise RuntimeError(f"restart stopped: standby {name} was not back within {STEP_TIMEOUT_S:g}s; "
                           "the leader was not restarted")
    for name, feed in last:
        # It restarts a moment after it is asked (its reply grace), by when it has passed
        # this call's answer on to the caller.
        trio.lowlevel.spawn_system_task(_restart_last, feed, name)
    return len(agents), len(standbys)


async def _restart_last(feed: Any, name: str) -> None:
    """Ask standby ``name`` to restart; log a failure (nobody is left to answer)."""
    refused: list[str] = []
    try:
        await _call(feed.restart, f"standby {name}", refused)
    except Exception as exc:  # noqa: BLE001 - a system task must not raise
        refused.append(f"standby {name}: {exc}")
    for reason in refused:
        log.warning("restart: %s", reason)


async def _call(method: Any, what: str, refused: list[str]) -> None:
    """Call ``method`` (a restart); add why to ``refused`` when it failed."""
    try:
        with trio.fail_after(CALL_TIMEOUT_S):
            await method()
    except capnp.KjException as exc:
        refused.append(f"{what} refused to restart: {remote_reason(exc)}")
    except trio.TooSlowError:
        refused.append(f"{what} did not answer the restart within {CALL_TIMEOUT_S:g}s")


def _not_back(registry: Registry, sessions: NodeSessions, old: dict[str, Any]) -> list[str]:
    """Returns the nodes of ``old`` (node id -> its session before the restart) that have no
    new session or are not ONLINE, sorted."""
    nodes = registry.snapshot().nodes
    missing = []
    for node_id, before in old.items():
        try:
            current = sessions.get(node_id)
        except LookupError:
            current = before
        node = nodes.get(node_id)
        if current is before or node is None or node.state is not NodeState.ONLINE:
            missing.append(node_id)
    return sorted(missing)
