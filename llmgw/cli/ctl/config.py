"""``llmgw ctl config get|set|unset|history|diff``: cluster settings, versioned, in the store.

Keys (llmgw/control/settings.py): ``serving.stopped``, ``routing``, ``agents.default`` and
``agents.nodes.<node id>``, or a dotted key below one of the mappings (``routing.policy``,
``agents.default.log_level``). Values are YAML (``true``, ``debug``, ``{level: 2}``). A key or
value the cluster refuses is answered with its key path and the reason; nothing is stored then.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

import click
import yaml

from llmgw.cli.ctl.common import call, json_option, target_of
from llmgw.cli.output import fail, local_time, print_json, print_table
from llmgw.client import SettingRow


@click.group()
def config() -> None:
    """Cluster settings: serving.stopped, routing, agents.default, agents.nodes.NODE (versioned, audited)."""


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=False, sort_keys=True).rstrip("\n").removesuffix("\n...")


def _print_setting(s: SettingRow) -> None:
    click.echo(f"{s.key} (version {s.version}, {local_time(s.updated_at)}, by {s.actor}):")
    for line in _yaml(s.value).splitlines():
        click.echo(f"  {line}")


@config.command("get")
@click.argument("key", required=False, default="")
@json_option
@click.pass_context
def config_get(ctx: click.Context, key: str, as_json: bool) -> None:
    """Show every setting, or the one KEY belongs to."""
    rows = call(ctx, as_json, lambda c: c.settings(key))
    if not rows:
        click.echo(f"{key} is not set" if key else "no cluster settings are set")
    for row in rows:
        _print_setting(row)


@config.command("set")
@click.argument("key")
@click.argument("value")
@json_option
@click.pass_context
def config_set(ctx: click.Context, key: str, value: str, as_json: bool) -> None:
    """Set KEY to VALUE (YAML: true, 30s, debug, {a: 1}); the stored key gets a new version."""
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        fail(f"{key}: the value is not YAML: {exc}")
    row = call(ctx, as_json, lambda c: c.set_setting(key, parsed))
    click.echo(f"{key} set: {row.key} is at version {row.version}")


@config.command("unset")
@click.argument("key")
@json_option
@click.pass_context
def config_unset(ctx: click.Context, key: str, as_json: bool) -> None:
    """Remove KEY (a whole setting, or one entry of a mapping)."""
    row = call(ctx, as_json, lambda c: c.unset_setting(key))
    click.echo(f"{key} unset: {row.key} is at version {row.version}")


@config.command("history")
@click.argument("key")
@json_option
@click.pass_context
def config_history(ctx: click.Context, key: str, as_json: bool) -> None:
    """Every version of the setting KEY belongs to, oldest first."""
    rows = call(ctx, as_json, lambda c: c.setting_history(key))
    print_table(["VERSION", "WHEN", "BY", "VALUE"],
                [[r.version, local_time(r.updated_at), r.actor, json.dumps(r.value)[:80]] for r in rows],
                empty=f"{key} was never set")


@config.command("diff")
@click.argument("key")
@click.argument("versions", nargs=-1, type=int)
@json_option
@click.pass_context
def config_diff(ctx: click.Context, key: str, versions: tuple[int, ...], as_json: bool) -> None:
    """What changed in KEY's setting: between the last two versions, since version A, or from A to B."""
    if len(versions) > 2:
        fail("give at most two versions: diff KEY [A [B]]")

    target = target_of(ctx, as_json)
    history: list[SettingRow] = target.run(lambda c: c.setting_history(key))
    if not history:
        fail(f"{key} was never set")
    by_version = {r.version: r for r in history}
    last = history[-1].version
    a, b = (versions + (last,))[:2] if versions else (last - 1, last)
    for v in (a, b):
        if v != 0 and v not in by_version:
            fail(f"{history[-1].key} has no version {v} (versions 1 to {last})")
    diff = {"key": history[-1].key, "from": a, "to": b, "old": by_version[a].value if a else None,
            "new": by_version[b].value}
    if target.json:
        print_json(diff)
        return
    lines = difflib.unified_diff(
        _yaml(diff["old"]).splitlines() if diff["old"] is not None else [],
        _yaml(diff["new"]).splitlines() if diff["new"] is not None else [],
        f"{diff['key']} version {diff['from']}", f"{diff['key']} version {diff['to']}", lineterm="",
    )
    text = "\n".join(lines)
    click.echo(text or f"{diff['key']}: versions {diff['from']} and {diff['to']} are the same")
