"""Sending each node its layer of the cluster settings: when it joins, and a second after a change.

:class:`SettingsPush` runs in the leader's term. :meth:`SettingsPush.changed` (an admin call
stored an ``agents.*`` setting) wakes it; it waits :data:`PUSH_DELAY_S` so a burst of
changes goes out once, reads the settings, and sends every connected node its layer
(:func:`llmgw.control.settings.agent_layer`) through ``Agent.settings`` and the ``firewall``
setting through ``Agent.firewall`` (agents listing that feature), all nodes at once,
each call bounded. A node that refuses (its agent.yaml and the layer do not load together)
is logged with its reason; it keeps running as it is.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import capnp
import trio

from llmgw.control.sessions import NodeSession, NodeSessions
from llmgw.control.settings import FIREWALL, agent_layer
from llmgw.nodeprotocol import FIREWALL as FIREWALL_FEATURE
from llmgw.control.store import Store
from llmgw.rpc.errors import remote_reason

log = logging.getLogger(__name__)

#: Changes within this many seconds go out as one push ("a second after a change").
PUSH_DELAY_S = 1.0
#: Bound on reading the settings and on one node's call.
PUSH_TIMEOUT_S = 10.0


async def stored_settings(store: Store) -> dict[str, Any]:
    """Returns every setting's current value by key (unset ones left out)."""
    with trio.fail_after(PUSH_TIMEOUT_S):
        return {s.key: s.value for s in await store.list_settings() if s.value is not None}


async def push_to(session: NodeSession, settings: dict[str, Any]) -> None:
    """Send ``session``'s node its layer of ``settings``; log a refusal or failure."""
    layer = agent_layer(settings, session.node_id)
    try:
        with trio.fail_after(PUSH_TIMEOUT_S):
            await session.agent.settings(json.dumps(layer, sort_keys=True))
            if FIREWALL_FEATURE in session.features:
                await session.agent.firewall(json.dumps(settings.get(FIREWALL) or {}, sort_keys=True))
        session.settings_problem = ""
    except capnp.KjException as exc:
        reason = remote_reason(exc)
        session.settings_problem = f"refused the cluster settings: {reason}"
        log.warning("node %s did not take its cluster settings: %s", session.node_id, reason)
    except trio.TooSlowError:
        log.warning("node %s did not answer its cluster settings within %gs", session.node_id, PUSH_TIMEOUT_S)


class SettingsPush:
    """Pushes the agent settings to ``sessions`` after every :meth:`changed` (see the module docstring)."""

    def __init__(self, store: Store, sessions: NodeSessions) -> None:
        self.store = store
        self.sessions = sessions
        self._wake = trio.Event()
        #: Pushes sent so far (a count, for tests and benchmarks).
        self.pushes = 0

    def changed(self) -> None:
        """An ``agents.*`` setting changed. Synchronous; never raises."""
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Push after each change until cancelled; a store that cannot be read is logged and
        the push tried again after the next change."""
        task_status.started()
        while True:
            await self._wake.wait()
            await trio.sleep(PUSH_DELAY_S)
            self._wake = trio.Event()
            try:
                settings = await stored_settings(self.store)
            except Exception as exc:  # noqa: BLE001 - the next change tries again
                log.warning("could not read the cluster settings to push them: %s", exc)
                continue
            async with trio.open_nursery() as nursery:
                for session in self.sessions.all():
                    nursery.start_soon(push_to, session, settings)
            self.pushes += 1
