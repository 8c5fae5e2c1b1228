"""``llmgw ctl tenants|keys|usage|admin-tokens``: who may use the gateway and its admin API, and how much.

Every command takes ``--json``; every change is audited by the control plane and applies to
its gateway before the command returns.
"""

from __future__ import annotations

from typing import Any

import click

from llmgw.catalog import AccessError, validate_tenant
from llmgw.cli.ctl.common import call, json_option, remove
from llmgw.cli.output import fail, local_time, print_table
from llmgw.client import AdminTokenRow, ClusterClient, KeyRow, TenantRow


def _limit(value: int) -> str:
    return str(value) if value else "unlimited"


def _models_option(value: str | None) -> list[str] | None:
    """``--models a,b`` -> ["a", "b"]; ``--models '*'`` or ``all`` -> None (every model)."""
    if value is None or value.strip() in ("*", "all"):
        return None
    return [m.strip() for m in value.split(",") if m.strip()]


def _checked(data: dict[str, Any]) -> TenantRow:
    try:
        record = validate_tenant(data)
    except AccessError as exc:
        fail(str(exc))
    return TenantRow(record.name, record.models, record.max_concurrency, record.rpm, record.tpm)


def _new_key(row: KeyRow, key: str) -> dict[str, Any]:
    """Returns the JSON ``keys create`` prints: the key itself (this once) and its record."""
    return {"key": key, "id": row.id, "tenant": row.tenant, "name": row.name, "created_at": row.created_at}


def _print_tenants(rows: list[TenantRow]) -> None:
    print_table(
        ["TENANT", "MODELS", "MAX CONCURRENCY", "RPM", "TPM", "UPDATED"],
        [[t.name, ",".join(t.models) if t.models is not None else "all", _limit(t.max_concurrency),
          _limit(t.rpm), _limit(t.tpm), local_time(t.updated_at)] for t in rows],
        empty="no tenants: add one with `llmgw ctl tenants add NAME`",
    )


# -- tenants ---------------------------------------------------------------------------------


@click.group()
def tenants() -> None:
    """Tenants: the models their API keys may use and their limits."""


def _limit_options(fn: Any) -> Any:
    fn = click.option("--tpm", type=click.IntRange(min=0), help="Tokens per minute (0: unlimited).")(fn)
    fn = click.option("--rpm", type=click.IntRange(min=0), help="Requests per minute (0: unlimited).")(fn)
    fn = click.option("--max-concurrency", type=click.IntRange(min=0),
                      help="Requests in flight at once (0: unlimited).")(fn)
    fn = click.option("--models", help="Comma-separated models its keys may use; '*' for all.")(fn)
    return fn


@tenants.command("add")
@click.argument("name")
@_limit_options
@json_option
@click.pass_context
def tenants_add(ctx: click.Context, name: str, models: str | None, max_concurrency: int | None,
                rpm: int | None, tpm: int | None, as_json: bool) -> None:
    """Add a tenant (every model and no limits unless given)."""
    row = _checked({"name": name, "models": _models_option(models), "max_concurrency": max_concurrency or 0,
                    "rpm": rpm or 0, "tpm": tpm or 0})
    saved = call(ctx, as_json, lambda c: c.put_tenant(row, create=True))
    click.echo(f"tenant {saved.name!r} added; give it a key with `llmgw ctl keys create --tenant {saved.name}`")


@tenants.command("update")
@click.argument("name")
@_limit_options
@json_option
@click.pass_context
def tenants_update(ctx: click.Context, name: str, models: str | None, max_concurrency: int | None,
                   rpm: int | None, tpm: int | None, as_json: bool) -> None:
    """Change a tenant's models or limits (options not given stay as they are)."""

    async def update(c: ClusterClient) -> TenantRow:
        current = {t.name: t for t in await c.tenants()}.get(name)
        if current is None:
            fail(f"no tenant {name!r} (see `llmgw ctl tenants list`)")
        row = _checked({
            "name": name,
            "models": _models_option(models) if models is not None else
            (list(current.models) if current.models is not None else None),
            "max_concurrency": current.max_concurrency if max_concurrency is None else max_concurrency,
            "rpm": current.rpm if rpm is None else rpm,
            "tpm": current.tpm if tpm is None else tpm,
        })
        return await c.put_tenant(row, create=False)

    saved = call(ctx, as_json, update)
    _print_tenants([saved])


@tenants.command("list")
@json_option
@click.pass_context
def tenants_list(ctx: click.Context, as_json: bool) -> None:
    """Tenants and their limits."""
    rows = call(ctx, as_json, lambda c: c.tenants())
    _print_tenants(rows)


@tenants.command("remove")
@click.argument("name")
@json_option
@click.pass_context
def tenants_remove(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove a tenant; its API keys are revoked."""
    remove(ctx, as_json, name, lambda c: c.remove_tenant(name),
           missing=f"no tenant {name!r} (see `llmgw ctl tenants list`)",
           done=f"tenant {name!r} removed; its API keys are revoked")


# -- keys ------------------------------------------------------------------------------------


@click.group()
def keys() -> None:
    """API keys for the gateway (Authorization: Bearer KEY)."""


@keys.command("create")
@click.option("--tenant", "-t", required=True, help="The tenant the key belongs to.")
@click.option("--name", "-n", default="", help="What the key is for (shown in `keys list`).")
@json_option
@click.pass_context
def keys_create(ctx: click.Context, tenant: str, name: str, as_json: bool) -> None:
    """Create a key; it is printed this once and only its hash is stored."""
    row, key = call(ctx, as_json, lambda c: c.create_key(tenant, name), as_data=lambda created: _new_key(*created))
    click.echo(key)
    click.echo(f"(key {row.id} for tenant {row.tenant!r}: store it now, it cannot be shown again; "
               f"revoke it with `llmgw ctl keys revoke {row.id}`)", err=True)


@keys.command("list")
@click.option("--all", "show_all", is_flag=True, help="Include revoked keys.")
@json_option
@click.pass_context
def keys_list(ctx: click.Context, show_all: bool, as_json: bool) -> None:
    """API keys (ids, never the keys themselves)."""

    async def listed(c: ClusterClient) -> list[KeyRow]:
        return [k for k in await c.keys() if show_all or k.revoked_at is None]

    rows = call(ctx, as_json, listed)
    print_table(["KEY ID", "TENANT", "NAME", "CREATED", "REVOKED"],
                [[k.id, k.tenant, k.name or "-", local_time(k.created_at), local_time(k.revoked_at)] for k in rows],
                empty="no API keys: create one with `llmgw ctl keys create --tenant NAME`")


@keys.command("revoke")
@click.argument("key_id")
@json_option
@click.pass_context
def keys_revoke(ctx: click.Context, key_id: str, as_json: bool) -> None:
    """Revoke a key (by its id, the part after `llmgw_`); refused from now on."""
    row = call(ctx, as_json, lambda c: c.revoke_key(key_id))
    click.echo(f"key {row.id} (tenant {row.tenant!r}) revoked")


# -- admin tokens ---------------------------------------------------------------------------


@click.group("admin-tokens")
def admin_tokens() -> None:
    """Bearer tokens of the HTTP admin API (/api/v1/* on any control plane's HTTP port)."""


@admin_tokens.command("create")
@click.argument("name")
@json_option
@click.pass_context
def admin_tokens_create(ctx: click.Context, name: str, as_json: bool) -> None:
    """Create a token named NAME (the actor in the audit log); printed this once, only its hash stored."""
    row, token = call(ctx, as_json, lambda c: c.create_admin_token(name),
                      as_data=lambda made: {"token": made[1], "id": made[0].id, "name": made[0].name})
    click.echo(token)
    click.echo(f"(admin token {row.id} {row.name!r}: store it now, it cannot be shown again; it can do anything "
               f"an admin certificate can; revoke it with `llmgw ctl admin-tokens revoke {row.id}`)", err=True)


@admin_tokens.command("list")
@click.option("--all", "show_all", is_flag=True, help="Include revoked tokens.")
@json_option
@click.pass_context
def admin_tokens_list(ctx: click.Context, show_all: bool, as_json: bool) -> None:
    """Admin tokens (ids and names, never the tokens themselves)."""

    async def listed(c: ClusterClient) -> list[AdminTokenRow]:
        return [t for t in await c.admin_tokens() if show_all or not t.revoked_at]

    rows = call(ctx, as_json, listed)
    print_table(["TOKEN ID", "NAME", "CREATED", "BY", "REVOKED"],
                [[t.id, t.name, local_time(t.created_at), t.created_by, local_time(t.revoked_at)] for t in rows],
                empty="no admin tokens: create one with `llmgw ctl admin-tokens create NAME`")


@admin_tokens.command("revoke")
@click.argument("token_id")
@json_option
@click.pass_context
def admin_tokens_revoke(ctx: click.Context, token_id: str, as_json: bool) -> None:
    """Revoke a token (by its id, the part after `llmgwadmin_`); refused from the next call on."""
    row = call(ctx, as_json, lambda c: c.revoke_admin_token(token_id))
    click.echo(f"admin token {row.id} ({row.name!r}) revoked")


# -- usage ----------------------------------------------------------------------------------


@click.command()
@json_option
@click.pass_context
def usage(ctx: click.Context, as_json: bool) -> None:
    """Requests and tokens per tenant and model, as the engines reported them."""
    rows = call(ctx, as_json, lambda c: c.usage())
    print_table(["TENANT", "MODEL", "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS"],
                [[u.tenant, u.model, u.requests, u.prompt_tokens, u.completion_tokens] for u in rows],
                empty="no usage yet")
