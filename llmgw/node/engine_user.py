"""The unprivileged user engines run as (agent.yaml ``engine_user``, default ``llmgw-engine``).

An engine parses untrusted prompts and loads adapters; it must not hold the machine. An agent
running as root starts every engine as the engines' user, with that user's groups plus the
group owning the NVIDIA device files (so GPUs stay usable), with a home of their own
(:func:`prepare_home`). The agent's TLS key, the shards' state records (which hold their
secrets) and the store stay root's and unreadable to it.

:func:`resolve` finds the user afresh for every start, so a user created after the agent
started is used without a restart; a user that does not exist fails the shard with that
reason: nothing falls back to root. An agent that is not root cannot switch users: its engines
run as its own user (``engine_user: ""`` asks for that explicitly, also as root).
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
from pathlib import Path
from typing import Any

import attrs

#: The engines' user a node's agent.yaml names when it names none (`llmgw agent join` creates it).
DEFAULT_ENGINE_USER = "llmgw-engine"
#: Device files whose group an engine needs for GPUs (where the driver makes them group-owned).
GPU_DEVICE_GLOB = "nvidia*"
#: The engines' home, beside the agent's shard records (``<agent state_dir>/engine-home``).
ENGINE_HOME_DIR = "engine-home"
#: The engines' home: private to the engines' user; their caches (HF, vLLM, Triton, torch) live here.
HOME_MODE = 0o700
#: What the engine path's ``llmgw_undumpable`` reads: set for an engine started as the engines'
#: user, which then keeps its environment (its secret) from the others (a test keeps it in step).
UNDUMPABLE_ENV = "LLMGW_ENGINE_UNDUMPABLE"
#: Where to create the engines' user, said in every message about a missing one.
CREATE_HINT = ("create it (`useradd --system --no-create-home --shell /usr/sbin/nologin {name}`; "
               "`llmgw agent join` does) or name another in agent.yaml engine_user")


class EngineUserError(Exception):
    """The engines' user cannot be used; the message says why and what to do."""


@attrs.frozen
class EngineUser:
    """Who an engine runs as: ``uid``/``gid`` and supplementary ``groups``; ``name`` for messages."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def wanted_user(configured: str | None, *, euid: int | None = None) -> str:
    """Returns the user engines should run as: ``configured`` (agent.yaml ``engine_user``), or
    where that is None the default, :data:`DEFAULT_ENGINE_USER` for an agent running as root and
    "" (the agent's own user) for one that is not (it could not switch)."""
    if configured is not None:
        return configured
    return DEFAULT_ENGINE_USER if (os.geteuid() if euid is None else euid) == 0 else ""


def resolve(name: str, *, dev: Path = Path("/dev")) -> EngineUser | None:
    """Returns the :class:`EngineUser` called ``name``, or None for "" (engines run as the agent).

    Raises :class:`EngineUserError` when the user does not exist, is root, or the agent (not
    root) cannot switch to it. Reads the user and group databases (NSS): call it off the trio
    loop where those may be remote.
    """
    if not name:
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise EngineUserError(f"the engines' user {name!r} does not exist on this node: "
                              + CREATE_HINT.format(name=name)) from None
    if entry.pw_uid == 0:
        raise EngineUserError(f"the engines' user {name!r} is root: engines never run as root through it; "
                              "name an unprivileged user in agent.yaml engine_user")
    if os.geteuid() != 0 and os.geteuid() != entry.pw_uid:
        raise EngineUserError(f"the agent runs as uid {os.geteuid()}, not root, so it cannot start engines as "
                              f"{name!r}: run the agent as root (its unit does), or set engine_user: \"\" in "
                              "agent.yaml to run them as the agent's own user")
    groups = set(os.getgrouplist(name, entry.pw_gid)) | set(gpu_groups(dev))
    return EngineUser(name, entry.pw_uid, entry.pw_gid, tuple(sorted(groups - {0})))


def popen_identity(user: EngineUser | None) -> dict[str, Any]:
    """Returns the keyword arguments that make a subprocess (``subprocess.Popen``, trio's
    ``open_process``) run as ``user``: its uid, gid and exactly its groups ({} for None: as the agent)."""
    if user is None:
        return {}
    return {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}


def gpu_groups(dev: Path = Path("/dev")) -> list[int]:
    """Returns the groups (other than root's) owning the NVIDIA device files under ``dev``
    ([] where there are none, or they belong to root's group: then their mode decides)."""
    gids = set()
    for path in dev.glob(GPU_DEVICE_GLOB):
        try:
            gids.add(path.stat().st_gid)
        except OSError:
            continue
    return sorted(gids - {0})


def describe(user: EngineUser | None) -> str:
    """Returns who engines run as, in words: "llmgw-engine (uid 998, groups 998,44)" or "the agent's own user"."""
    if user is None:
        return "the agent's own user"
    return f"{user.name} (uid {user.uid}, groups {','.join(str(g) for g in user.groups) or '-'})"


def group_name(gid: int) -> str:
    """Returns group ``gid``'s name, or the number where it has none."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def hand_over(directory: Path, user: EngineUser) -> Path:
    """Creates ``directory`` where missing (its parents as root's) and gives it, and everything
    in it, to ``user``; returns it. Walks the tree only when ``directory`` itself is not the
    user's yet, so calling it before every install costs one stat. Links are handed over as
    links (never followed). Raises OSError where a path cannot be created or handed over."""
    directory.mkdir(parents=True, exist_ok=True)
    stat = directory.stat()
    if (stat.st_uid, stat.st_gid) != (user.uid, user.gid):
        for path in [directory, *directory.rglob("*")]:
            os.lchown(path, user.uid, user.gid)
    return directory


def prepare_home(home: Path, user: EngineUser) -> Path:
    """Creates (or keeps) the engines' home ``home`` and returns it: owned by ``user``, mode
    0700. Its shards share it (they share a user, so nothing between them is private anyway):
    their caches (Hugging Face, vLLM, Triton, torch compile) outlive each replica. Raises
    OSError where it cannot be created or handed over."""
    hand_over(home, user)
    os.chmod(home, HOME_MODE)
    (home / "tmp").mkdir(exist_ok=True)
    os.lchown(home / "tmp", user.uid, user.gid)
    return home


def home_env(home: Path) -> dict[str, str]:
    """Returns the variables of an engine run as the engines' user with ``home``: its files there
    (HOME, the XDG cache that Hugging Face, vLLM, Triton and torch follow, TMPDIR) and
    :data:`UNDUMPABLE_ENV`, so it keeps its environment (its secret) from the others."""
    return {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "TMPDIR": str(home / "tmp"),
            UNDUMPABLE_ENV: "1"}


#: Where llmgw notes the users it created on this machine, one name per line (`llmgw wipe` removes them).
CREATED_USERS_FILE = Path("/etc/llmgw/created-users")
#: Seconds useradd may take (it locks /etc/passwd; a stuck NSS backend must not hang a join).
USERADD_TIMEOUT_S = 60.0


def user_exists(name: str) -> bool:
    """Returns whether user ``name`` exists (in the user database NSS reads)."""
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def create_user(name: str, *, record: Path = CREATED_USERS_FILE) -> bool:
    """Creates the system user ``name`` (and its group) for engines unless it exists; returns
    True when it created it, having noted it in ``record`` for ``llmgw wipe``.

    The user has no home (each shard gets one of its own) and no login shell. Raises
    OSError when useradd is missing, fails (its words) or takes longer than :data:`USERADD_TIMEOUT_S`.
    """
    if user_exists(name):
        return False
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    argv = [useradd, "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
            "--shell", "/usr/sbin/nologin", "--comment", "llmgw engines", name]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=USERADD_TIMEOUT_S)
    except FileNotFoundError:
        raise OSError(f"cannot create the engines' user {name!r}: useradd is not installed") from None
    except subprocess.TimeoutExpired:
        raise OSError(f"useradd {name} took longer than {USERADD_TIMEOUT_S:g}s") from None
    if done.returncode != 0:
        raise OSError(f"useradd {name} failed: {(done.stderr or done.stdout).strip()}")
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(record, "a", encoding="utf-8") as f:
        f.write(name + "\n")
    return True


def created_users(record: Path = CREATED_USERS_FILE) -> list[str]:
    """Returns the users llmgw noted as created in ``record`` (none when it is missing)."""
    try:
        lines = record.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    return sorted({line.strip() for line in lines if line.strip()})
