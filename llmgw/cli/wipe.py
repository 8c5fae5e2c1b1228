"""``llmgw wipe``: remove llmgw from this machine, after listing exactly what goes.

The plan (:func:`plan_wipe`) is made from what is there, under ``--root`` (``/``; a scratch
root for a test or a mounted disk): llmgw's systemd units, the engines the agent supervises
(from its shard records: pid, start time and command line, so nothing else is signalled),
llmgw's nft table, ``/etc/llmgw``, the control plane's and the agent's state directories,
the cluster CA in the system trust store if llmgw put it there, keepalived's configuration
if ``llmgw server join --vip`` wrote it, the users ``llmgw agent join`` created (noted in
``/etc/llmgw/created-users``). The control plane's SQLite store (``--store``) and
the agent's model weights (``--models``) stay unless asked for (``--all``: both). It prints
the plan, asks the operator to type the machine's name (``--yes``: scripts), then carries
it out, saying each step. Nothing outside the plan is touched: a directory is removed whole
only when nothing in it is kept, else entry by entry.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Callable

import attrs
import click
import yaml

from llmgw.cli.keepalived import WRITTEN_BY
from llmgw.cli.output import fail
from llmgw.cli.service import systemctl_or_fail
from llmgw.config.defaults import DEFAULT_AGENT_STATE_DIR, DEFAULT_SQLITE_NAME
from llmgw.node.engine_user import CREATED_USERS_FILE, created_users

#: Paths as on a machine set up by llmgw's own commands, relative to the root.
CONFIG_DIR = Path("etc/llmgw")
SERVER_STATE_DIR = Path("var/lib/llmgw")
AGENT_STATE_DIR = DEFAULT_AGENT_STATE_DIR.relative_to("/")
UNIT_DIR = Path("etc/systemd/system")
UNIT_GLOB = "llmgw-*"
KEEPALIVED_CONFIG = Path("etc/keepalived/keepalived.conf")
TRUST_DIR = Path("usr/local/share/ca-certificates")
TRUST_GLOB = "llmgw*.crt"
#: The agent keeps downloaded model weights here (agent.yaml weights_dir's default).
WEIGHTS_SUBDIR = "weights"
NFT_TABLE = ("inet", "llmgw")
#: Seconds an engine gets to exit on SIGTERM before SIGKILL.
ENGINE_STOP_GRACE_S = 10.0
#: Seconds userdel may take (it locks /etc/passwd).
USERDEL_TIMEOUT_S = 60.0
#: userdel's exit status for a user that does not exist (gone already: nothing to do).
USERDEL_NO_SUCH_USER = 6


@attrs.frozen
class Step:
    """One thing the wipe does: what it says, and the action doing it."""

    what: str
    action: Callable[[], None] = attrs.field(eq=False)


@attrs.define
class WipePlan:
    steps: list[Step] = attrs.field(factory=list)
    kept: list[str] = attrs.field(factory=list)


def plan_wipe(root: Path, *, models: bool, store: bool) -> WipePlan:
    """Returns what wiping the machine at ``root`` would do (nothing is done here)."""
    plan = WipePlan()
    live = root == Path("/")
    units = sorted((root / UNIT_DIR).glob(UNIT_GLOB)) if (root / UNIT_DIR).is_dir() else []
    if units and live and shutil.which("systemctl"):
        names = [u.name for u in units]
        plan.steps.append(Step(f"stop and disable {', '.join(names)}",
                               lambda: systemctl_or_fail("disable", "--now", *names)))
    for unit in units:
        plan.steps.append(Step(f"remove {unit}", _remover(unit)))
    server_state = _configured(root, "server.yaml", "state_dir", SERVER_STATE_DIR)
    agent_state = _configured(root, "agent.yaml", "state_dir", AGENT_STATE_DIR)
    for pid, describe, stop in _engines(agent_state):
        plan.steps.append(Step(f"stop engine {describe} (pid {pid}, its process group)", stop))
    if live and shutil.which("nft") and _run(["nft", "list", "table", *NFT_TABLE], check=False):
        plan.steps.append(Step(f"delete nft table {' '.join(NFT_TABLE)}",
                               lambda: _run(["nft", "delete", "table", *NFT_TABLE])))
    weights = _configured(root, "agent.yaml", "weights_dir", agent_state.relative_to(root) / WEIGHTS_SUBDIR)
    for user in created_users(root / CONFIG_DIR / CREATED_USERS_FILE.name):
        plan.steps.append(Step(f"remove user {user} (created by llmgw agent join)", _user_remover(root, user)))
    _plan_tree(plan, root / CONFIG_DIR, keep=set())
    store_file = server_state / DEFAULT_SQLITE_NAME
    _plan_tree(plan, server_state,
               keep=set() if store else {store_file, store_file.with_name(store_file.name + "-wal"),
                                         store_file.with_name(store_file.name + "-shm")},
               kept_why="the store (--store removes it)")
    _plan_tree(plan, agent_state, keep=set() if models else {weights},
               kept_why="model weights (--models removes them)")
    trusted = sorted((root / TRUST_DIR).glob(TRUST_GLOB)) if (root / TRUST_DIR).is_dir() else []
    for cert in trusted:
        plan.steps.append(Step(f"remove {cert} from the trust store", _remover(cert)))
    if trusted and live and shutil.which("update-ca-certificates"):
        plan.steps.append(Step("update-ca-certificates --fresh",
                               lambda: _run(["update-ca-certificates", "--fresh"])))
    keepalived = root / KEEPALIVED_CONFIG
    if keepalived.is_file():
        if _first_line(keepalived).startswith(WRITTEN_BY):  # only what `server join --vip` wrote goes
            plan.steps.append(Step(f"remove {keepalived} (written by llmgw server join --vip)", _remover(keepalived)))
        else:
            plan.kept.append(f"{keepalived}: not written by llmgw")
    return plan


def _configured(root: Path, config: str, key: str, default: Path) -> Path:
    """Returns ``key`` of ``/etc/llmgw/CONFIG`` under ``root`` (a path, re-rooted), else ``root/default``:
    a state directory the operator moved is wiped where it is."""
    try:
        data = yaml.safe_load((root / CONFIG_DIR / config).read_text())
        value = data.get(key) if isinstance(data, dict) else None
    except (OSError, yaml.YAMLError):
        value = None
    if not isinstance(value, str) or not value:
        return root / default
    path = Path(value)
    return root / (path.relative_to("/") if path.is_absolute() else path)


def _plan_tree(plan: WipePlan, top: Path, *, keep: set[Path], kept_why: str = "") -> None:
    """Adds the removal of ``top`` to ``plan``: whole, or every entry but those in ``keep``
    (and the directories holding them)."""
    if not top.exists() and not top.is_symlink():
        return
    held = {k for k in keep if k.exists()}
    if not held:
        plan.steps.append(Step(f"remove {top}", _remover(top)))
        return
    for path in sorted(held):
        plan.kept.append(f"{path}: {kept_why}")
    for entry in sorted(top.iterdir()):
        if entry in held:
            continue
        if any(entry in k.parents for k in held):
            _plan_tree(plan, entry, keep=held, kept_why=kept_why)
        else:
            plan.steps.append(Step(f"remove {entry}", _remover(entry)))


def _remover(path: Path) -> Callable[[], None]:
    def remove() -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    return remove


def _user_remover(root: Path, user: str) -> Callable[[], None]:
    """Returns the action removing ``user`` from the machine at ``root`` (userdel; ``--root`` for
    a scratch root, whose own etc/passwd it edits). A user already gone is fine."""
    def remove() -> None:
        argv = [shutil.which("userdel") or "/usr/sbin/userdel"]
        if root != Path("/"):
            argv += ["--root", str(root.resolve())]
        argv.append(user)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=USERDEL_TIMEOUT_S)
        if done.returncode not in (0, USERDEL_NO_SUCH_USER):
            raise OSError(f"userdel {user} failed: {(done.stderr or done.stdout).strip()}")

    return remove


def _engines(agent_state: Path) -> list[tuple[int, str, Callable[[], None]]]:
    """Returns the engines the agent at ``agent_state`` supervises that still run, each with
    a way to stop it and its process group (SIGTERM, a grace, SIGKILL)."""
    from llmgw.node import process, shard_state

    found = []
    for record in shard_state.load_all(agent_state / "shards"):
        identity = record.identity
        if identity is None or not process.matches(identity):
            continue

        def stop(identity: process.ProcessIdentity = identity) -> None:
            from llmgw.cli.common import run_trio

            async def terminate() -> None:
                engine = process.adopt(identity)
                if engine is not None:
                    await process.terminate(engine, ENGINE_STOP_GRACE_S)

            run_trio(terminate)

        found.append((identity.pid, f"{record.spec.id} ({record.spec.engine})", stop))
    return found


def _first_line(path: Path) -> str:
    try:
        with path.open(errors="replace") as f:
            return f.readline()
    except OSError:
        return ""


def _run(argv: list[str], *, check: bool = True) -> bool:
    """Runs ``argv``; returns whether it succeeded (``check``: exits with its error otherwise)."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and check:
        fail(f"{' '.join(argv)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.returncode == 0


@click.command()
@click.option("--root", type=click.Path(path_type=Path, file_okay=False), default=Path("/"), show_default=True,
              help="The machine's root: another directory is a scratch root (or a mounted disk).")
@click.option("--models", is_flag=True, help="Also remove the model weights the agent downloaded.")
@click.option("--store", is_flag=True, help="Also remove the control plane's local store (SQLite).")
@click.option("--all", "everything", is_flag=True, help="--models and --store.")
@click.option("--yes", is_flag=True, help="Do not ask (scripts).")
def wipe(root: Path, models: bool, store: bool, everything: bool, yes: bool) -> None:
    """Remove llmgw from this machine, after listing exactly what goes and asking for the machine's name."""
    plan = plan_wipe(root.resolve(), models=models or everything, store=store or everything)
    if not plan.steps:
        click.echo(f"nothing of llmgw under {root}")
        return
    click.echo("llmgw wipe will:")
    for step in plan.steps:
        click.echo(f"  - {step.what}")
    for kept in plan.kept:
        click.echo(f"  (keeps {kept})")
    if not yes:
        machine = socket.gethostname()
        answer = click.prompt(f"Type this machine's name ({machine}) to go on", default="", show_default=False)
        if answer.strip() != machine:
            fail("not the machine's name: nothing was removed")
    failed = 0
    for step in plan.steps:
        try:
            step.action()
        except OSError as exc:
            failed += 1
            click.echo(f"FAILED: {step.what}: {exc}", err=True)
            continue
        click.echo(f"done: {step.what}")
    if failed:
        hint = " (run it as root)" if os.geteuid() != 0 else ""
        fail(f"{failed} step(s) failed{hint}; run `llmgw wipe` again to finish: it lists only what is left")
