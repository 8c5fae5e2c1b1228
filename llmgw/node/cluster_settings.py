"""The cluster's settings for this node, as the leader sends them, and when they restart the agent.

The leader sends each node its layer of the cluster settings (``agents.default`` with
``agents.nodes.<id>`` over it: :func:`llmgw.control.settings.agent_layer`) when it joins
and a second after a change (``Agent.settings``). :class:`ClusterSettings` checks that the
layer loads together with the node's agent.yaml (the file keeps what only it may say);
if it does and it changes what the agent runs with, it is written to
``cluster_settings.json`` in the state directory and the agent restarts on it, its engines
left running and adopted by the next agent. A layer that does not load is refused with the
reason (the leader logs it) and the agent keeps running as it is.

The same goes for agent.yaml itself: :meth:`ClusterSettings.watch_file` notices an edit;
one that loads restarts the agent, one that does not is logged and ignored.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

import trio

from llmgw.files import read_json_mapping

log = logging.getLogger(__name__)

#: The file, in the agent's state directory.
SETTINGS_FILE = "cluster_settings.json"
#: How often agent.yaml's modification time and size are looked at.
FILE_POLL_S = 2.0
#: A restart asked for over RPC waits this long, so the call's answer is on the wire first.
REPLY_GRACE_S = 0.2

#: ``load(layer) -> config``: the agent's configuration from its file with ``layer`` over it;
#: raises ``ValueError`` (ConfigError) naming the key and the reason.
Loader = Callable[[dict[str, Any]], Any]


def read_layer(state_dir: Path) -> dict[str, Any]:
    """Returns the layer kept in ``state_dir`` ({} when there is none or it is unreadable, logged)."""
    try:
        return read_json_mapping(state_dir / SETTINGS_FILE) or {}
    except (OSError, ValueError) as exc:
        log.error("agent: ignoring the kept cluster settings: %s", exc)
        return {}


class ClusterSettings:
    """This agent's cluster layer: the one it runs with, and the restart a change asks for.

    ``layer`` and ``config`` are what the agent was started with; ``load`` builds a
    configuration from the file and a layer; ``config_file`` is agent.yaml (None: none).
    :attr:`restart` is set once the agent should restart on a new configuration.
    """

    def __init__(self, state_dir: Path, layer: dict[str, Any], config: Any, load: Loader,
                 config_file: Path | None) -> None:
        self.path = state_dir / SETTINGS_FILE
        self.layer = layer
        self.config = config
        self.load = load
        self.config_file = config_file
        self.restart = trio.Event()
        self.reason = ""
        #: None: the agent restarts by exec'ing itself; a status: it exits with it instead (an
        #: upgrade: its service manager starts the new release, llmgw/releases.py).
        self.exit_status: int | None = None
        #: Why the agent runs on an older configuration ("": it does not); reported to the
        #: control plane (``ctl nodes``) whenever it changes (:attr:`problem_changed`).
        self.problem = ""
        self.problem_changed = trio.Event()

    def apply(self, layer: dict[str, Any]) -> bool:
        """Take ``layer`` from the leader; returns whether the agent restarts on it.

        Raises ValueError with the reason when it does not load with agent.yaml (nothing
        changes then). A layer that changes nothing the agent runs with is kept without a restart.
        """
        if layer == self.layer:
            return False
        try:
            config = self.load(layer)
        except ValueError as exc:
            log.error("agent: refused the cluster settings the leader sent: %s; running on the old ones", exc)
            raise ValueError(f"the cluster settings do not load with this node's agent.yaml: {exc}") from None
        self._save(layer)
        self.layer = layer
        if config == self.config:
            return False
        self._restart("the cluster settings changed")
        return True

    def _save(self, layer: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(layer, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            # Running on them anyway: the next start without them is the file's configuration.
            log.warning("agent: could not save the cluster settings to %s: %s", self.path, exc.strerror or exc)

    def restart_soon(self, reason: str, exit_status: int | None = None) -> None:
        """Restart after :data:`REPLY_GRACE_S` (an RPC asked: its answer goes out first);
        with ``exit_status``, by exiting with it rather than exec'ing this same command."""
        self.exit_status = exit_status
        async def later() -> None:
            await trio.sleep(REPLY_GRACE_S)
            self._restart(reason)

        trio.lowlevel.spawn_system_task(later)

    def _restart(self, reason: str) -> None:
        self.reason = reason
        log.warning("agent: %s: restarting (the engines keep running and are adopted)", reason)
        self.restart.set()

    async def watch_file(self) -> None:
        """Restart when agent.yaml changes into something that loads, until cancelled."""
        if self.config_file is None:
            await trio.sleep_forever()
        assert self.config_file is not None
        seen = _stamp(self.config_file)
        while True:
            await trio.sleep(FILE_POLL_S)
            stamp = _stamp(self.config_file)
            if stamp == seen:
                continue
            seen = stamp
            try:
                config = self.load(self.layer)
            except ValueError as exc:
                log.error("agent: %s changed but does not load: %s; running on the old one", self.config_file, exc)
                self._set_problem(f"{self.config_file} changed but does not load: {exc}")
                continue
            self._set_problem("")
            if config != self.config:
                self._restart(f"{self.config_file} changed")
                return


    def _set_problem(self, problem: str) -> None:
        if problem != self.problem:
            self.problem = problem
            self.problem_changed.set()
            self.problem_changed = trio.Event()


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
