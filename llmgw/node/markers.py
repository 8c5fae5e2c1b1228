"""Engines carry a marker in their environment, so no engine of ours is ever orphaned.

The persisted record (:mod:`llmgw.node.shard_state`) is how an agent normally finds the
engines of its predecessor. A record can be lost or stale: the disk was full when a new
pid was to be written, the state file was moved aside as unreadable, an engine retitled
itself after the last write. So every engine also gets two variables:

    LLMGW_STATE_DIR=<the supervisor's state directory, absolute>
    LLMGW_SHARD_ID=<its shard id>

and :func:`find_marked` lists the live processes carrying this state directory's
marker, from the whole process table. Only process-group leaders count: an engine is
started in its own session (pid == pgid), and the workers it forks inherit the marker
but are stopped with their group, never on their own.

Reading another process's environment needs the same user or root (``/proc/PID/environ``);
processes that cannot be read are skipped. Blocks on /proc: call through
``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import attrs
import psutil

from llmgw.node.process import ProcessIdentity, identity_of, same_process
from llmgw.node.shard_state import ShardRecord

__all__ = ["MarkedEngine", "SHARD_VAR", "STATE_VAR", "find_marked", "marker_env", "match_marked"]

STATE_VAR = "LLMGW_STATE_DIR"
SHARD_VAR = "LLMGW_SHARD_ID"


@attrs.frozen
class MarkedEngine:
    """A live engine process that carries a state directory's marker."""

    shard_id: str
    identity: ProcessIdentity


def marker_env(state_dir: Path, shard_id: str) -> dict[str, str]:
    """Returns the variables that mark an engine of ``shard_id`` under ``state_dir``."""
    return {STATE_VAR: str(Path(state_dir).absolute()), SHARD_VAR: shard_id}


def find_marked(state_dir: Path) -> list[MarkedEngine]:
    """Returns the live process-group leaders marked with ``state_dir``, oldest first.

    Zombies, processes that exit during the scan and processes whose environment this
    user cannot read are left out. Never raises for one process; OSError only if /proc
    itself cannot be listed.
    """
    wanted = str(Path(state_dir).absolute())
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpgid(proc.pid):
                continue
            environ = proc.environ()
            if environ.get(STATE_VAR) != wanted or not environ.get(SHARD_VAR):
                continue
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
        identity = identity_of(proc.pid)  # None: a zombie, or gone since
        if identity is not None:
            found.append(MarkedEngine(shard_id=environ[SHARD_VAR], identity=identity))
    found.sort(key=lambda m: m.identity.create_time)
    return found


def match_marked(records: Sequence[ShardRecord], marked: Sequence[MarkedEngine]) -> list[MarkedEngine]:
    """Points each record at its shard's marked engine; returns the marked engines to stop.

    For a record with marked engines: the one its identity names (same pid and start
    time) is kept, else, unless the shard is FAILED, the oldest (the one a lost record was
    written for; later ones could not bind its port); the record's identity is set to
    that engine's current identity (its current command line), so adoption finds it.
    Every other marked engine is returned: a second engine of a shard, an engine of a
    FAILED shard whose record does not name it, and an engine of a shard with no record
    at all. Pure: no I/O.
    """
    by_id = {r.spec.id: r for r in records}
    strays: list[MarkedEngine] = []
    claimed: dict[str, MarkedEngine] = {}
    for engine in marked:  # oldest first
        record = by_id.get(engine.shard_id)
        if record is None or (record.failed and not _named_by(record, engine)):
            strays.append(engine)
            continue
        kept = claimed.get(engine.shard_id)
        if kept is None or (_named_by(record, engine) and not _named_by(record, kept)):
            if kept is not None:
                strays.append(kept)
            claimed[engine.shard_id] = engine
        else:
            strays.append(engine)
    for shard_id, engine in claimed.items():
        by_id[shard_id].identity = engine.identity
    return strays


def _named_by(record: ShardRecord, engine: MarkedEngine) -> bool:
    """Returns True if ``record``'s identity is ``engine``'s process."""
    return record.identity is not None and same_process(record.identity, engine.identity)
