"""The control planes an agent dials: its agent.yaml list plus what the leader told it.

The leader sends every node the RPC addresses of every control plane of the cluster, the
leader first, when the node joins and whenever a control plane appears
(``Agent.controlPlanes``). :class:`ControlPlaneList` keeps the last list it was sent in
``control_planes.json`` beside the agent's state, so a restarted agent whose agent.yaml
names only one control plane still finds the others when that one is down. The dial
order is the learned list, then the agent.yaml addresses it does not name.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)

#: The file, in the agent's state directory.
PLANES_FILE = "control_planes.json"
#: More addresses than any cluster has control planes: a list past this is refused.
MAX_PLANES = 64


class ControlPlaneList:
    """``configured`` (agent.yaml) plus the learned addresses kept in ``state_dir``."""

    def __init__(self, configured: Sequence[str], state_dir: Path) -> None:
        self.configured = list(configured)
        self.path = state_dir / PLANES_FILE
        self.learned: list[str] = self._load()

    def _load(self) -> list[str]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("agent: ignoring %s (%s): dialling the control planes of agent.yaml", self.path, exc)
            return []
        if not (isinstance(data, list) and all(isinstance(a, str) and a for a in data)):
            log.warning("agent: ignoring %s: not a list of addresses", self.path)
            return []
        return data[:MAX_PLANES]

    def addresses(self) -> list[str]:
        """Returns the dial order: the learned addresses, then the configured ones not among them."""
        return self.learned + [a for a in self.configured if a not in self.learned]

    def learn(self, addresses: Sequence[str]) -> None:
        """Remember ``addresses`` (the leader's list) and persist them; raises ValueError for
        a malformed list (nothing changes). A failed write is logged: the list is kept in
        memory all the same."""
        if len(addresses) > MAX_PLANES or not all(isinstance(a, str) and a and ":" in a for a in addresses):
            raise ValueError(f"a control plane list must be at most {MAX_PLANES} host:port addresses")
        learned = list(dict.fromkeys(addresses))
        if learned == self.learned:
            return
        self.learned = learned
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(learned))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("agent: could not save the control plane list to %s: %s", self.path, exc.strerror or exc)
        log.info("agent: control planes of the cluster: %s", ", ".join(learned))
