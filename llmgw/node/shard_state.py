"""What the agent remembers about each shard across its own restarts.

Layout under the agent's state directory::

    shards/<shard id>/state.json   spec, port, engine process identity, restarts, failure
    shards/<shard id>/engine.log   the engine's stdout+stderr (appended; rotated once)

``state.json`` is replaced atomically (temporary file, fsync, rename, fsync of the
directory), so after a crash or power loss it holds either the old or the new record,
never a torn one. All functions here block on the file system: call them through
``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import attrs

from llmgw.files import atomic_write
from llmgw.node.kvevents import KvEventsConfig
from llmgw.node.process import ProcessIdentity
from llmgw.spec import Compute, ShardSpec, adapters_from_dicts, adapters_to_dicts
from llmgw.node.engines.compute import compute_from_json, compute_to_json

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATE_FILE = "state.json"
LOG_FILE = "engine.log"
#: state.json holds the engine's secret: readable by the agent's user only, in directories
#: only that user can enter.
STATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700

# Shard ids become directory names: keep them to a safe, portable alphabet.
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}$")


@attrs.define
class ShardRecord:
    """The persisted part of a shard: enough to adopt or restart its engine."""

    spec: ShardSpec
    port: int
    identity: ProcessIdentity | None = None
    restarts: int = 0
    failed: bool = False  # gave up; kept so a restarted agent still reports FAILED
    message: str = ""
    last_output: tuple[str, ...] = ()
    compute: Compute | None = None  # what the engine said it computes on (at READY)
    # Where the engine publishes KV events (None: it does not). Chosen once at the first start:
    # an adopted engine keeps connecting to the same endpoint, so the subscriber binds it again.
    kv_events: KvEventsConfig | None = None

    def to_json(self) -> dict[str, Any]:
        """Returns a JSON-ready dict (see :meth:`from_json`)."""
        spec = self.spec
        return {
            "format": FORMAT_VERSION,
            "spec": {
                "id": spec.id,
                "model": spec.model,
                "engine": spec.engine,
                "source": spec.source,
                "args": list(spec.args),
                "env": dict(spec.env),
                "memory_mb": spec.memory_mb,
                "cpu_cores": spec.cpu_cores,
                "gpus": list(spec.gpus),
                "adapters": adapters_to_dicts(spec.adapters),
                "max_loaded_adapters": spec.max_loaded_adapters,
                "api_key": spec.api_key,
                "fingerprint": spec.fingerprint,
                "gpu_uuids": list(spec.gpu_uuids),
            },
            "port": self.port,
            "identity": None if self.identity is None else self.identity.to_json(),
            "restarts": self.restarts,
            "failed": self.failed,
            "message": self.message,
            "last_output": list(self.last_output),
            "compute": compute_to_json(self.compute),
            "kv_events": None if self.kv_events is None else self.kv_events.to_dict(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardRecord:
        """Returns the record; raises ValueError/KeyError/TypeError if ``data`` is malformed."""
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"unsupported shard state format {data.get('format')!r}")
        s = data["spec"]
        spec = ShardSpec(
            id=str(s["id"]),
            model=str(s["model"]),
            engine=str(s["engine"]),
            source=str(s["source"]),
            args=tuple(str(a) for a in s.get("args", ())),
            env={str(k): str(v) for k, v in s.get("env", {}).items()},
            memory_mb=int(s.get("memory_mb", 0)),
            cpu_cores=float(s.get("cpu_cores", 0.0)),
            gpus=tuple(int(g) for g in s.get("gpus", ())),
            adapters=adapters_from_dicts(s.get("adapters", ())),
            max_loaded_adapters=int(s.get("max_loaded_adapters", 0)),
            api_key=str(s.get("api_key", "")),  # "": an engine started before engines had secrets
            fingerprint=str(s.get("fingerprint", "")),
            gpu_uuids=tuple(str(u) for u in s.get("gpu_uuids", ())),
        )
        identity = data.get("identity")
        kv_events = data.get("kv_events")
        return cls(
            spec=spec,
            port=int(data["port"]),
            identity=None if identity is None else ProcessIdentity.from_json(identity),
            restarts=int(data.get("restarts", 0)),
            failed=bool(data.get("failed", False)),
            message=str(data.get("message", "")),
            last_output=tuple(str(x) for x in data.get("last_output", ())),
            compute=compute_from_json(data.get("compute")),
            kv_events=None if kv_events is None else KvEventsConfig.from_dict(kv_events),
        )


def check_shard_id(shard_id: str) -> None:
    """Raises ValueError unless ``shard_id`` is safe to use as a directory name."""
    if not _SAFE_ID.match(shard_id):
        raise ValueError(
            f"shard id {shard_id!r} is not usable on this node: use letters, digits and . _ : @ - "
            "(starting with a letter or digit, at most 200 characters)"
        )


def shards_root(state_dir: Path) -> Path:
    """Returns the directory that holds one subdirectory per shard."""
    return state_dir / "shards"


def shard_dir(state_dir: Path, shard_id: str) -> Path:
    """Returns the shard's directory (not created). Raises ValueError for an unsafe id."""
    check_shard_id(shard_id)
    return shards_root(state_dir) / shard_id


def make_private_dirs(state_dir: Path, directory: Path) -> None:
    """Creates ``directory`` (under ``state_dir``) and the directories between them, each 0700.

    Shard directories hold the engine's secret (state.json) and its log: only the agent's
    user may list or read them. Directories that exist already are narrowed to 0700 too
    (``state_dir`` itself is only created, 0700, when missing). Raises OSError if one cannot
    be created or changed.
    """
    state_dir.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    parts = directory.relative_to(state_dir).parts
    path = state_dir
    for part in parts:
        path = path / part
        try:
            path.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            pass
        if path.stat().st_mode & 0o777 != PRIVATE_DIR_MODE:
            os.chmod(path, PRIVATE_DIR_MODE)


def save(state_dir: Path, record: ShardRecord) -> None:
    """Atomically writes ``record`` to its shard's state.json (0600), creating directories (0700).

    Raises OSError if the disk refuses (full, read-only); the old file then stays intact.
    """
    directory = shard_dir(state_dir, record.spec.id)
    make_private_dirs(state_dir, directory)
    payload = json.dumps(record.to_json(), indent=1, sort_keys=True).encode()
    atomic_write(directory / STATE_FILE, payload, mode=STATE_FILE_MODE)


def load_all(state_dir: Path) -> list[ShardRecord]:
    """Returns every readable shard record, sorted by shard id.

    A directory without state.json (interrupted start) is skipped. An unreadable or
    malformed state.json is logged and renamed to ``state.json.bad`` so an operator can
    inspect it; loading never fails because of one broken shard.
    """
    root = shards_root(state_dir)
    if not root.is_dir():
        return []
    records = []
    for directory in sorted(root.iterdir()):
        path = directory / STATE_FILE
        if not path.is_file():
            continue
        try:
            record = ShardRecord.from_json(json.loads(path.read_bytes()))
            if record.spec.id != directory.name:
                raise ValueError(f"it names shard {record.spec.id!r}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.error(
                "shard state %s is unreadable (%s); moved aside to %s.bad, the shard is not adopted", path, exc, path
            )
            try:
                os.replace(path, path.with_name(STATE_FILE + ".bad"))
            except OSError:
                pass
            continue
        records.append(record)
    return records


def remove(state_dir: Path, shard_id: str) -> None:
    """Deletes the shard's directory (state and engine log). Missing is fine."""
    shutil.rmtree(shard_dir(state_dir, shard_id), ignore_errors=True)
