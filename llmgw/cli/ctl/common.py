"""What every ``llmgw ctl`` command shares: finding the cluster, running a client call, ``--json``.

Where to connect: ``--server`` / ``$LLMGW_SERVER`` (host:port of a control plane's RPC
port, several comma-separated for failover) and ``--tls-dir`` / ``$LLMGW_TLS_DIR``
(an admin certificate: ca.pem, cert.pem, key.pem). Without either, the cluster
of a local ``llmgw up`` is used (its ``up.json`` under :func:`default_up_dir`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Awaitable, Callable

import click

from llmgw.cli.common import UP_FILE, default_up_dir, run_trio
from llmgw.cli.output import fail, print_json
from llmgw.client import ClientError, ClusterClient, connect

#: Where the ``ctl`` group leaves its options for its commands (``click.Context.meta``).
CTL_META_KEY = "llmgw.ctl"

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


class Target:
    """The cluster a command talks to, and whether it prints JSON."""

    def __init__(self, servers: list[str], tls_dir: Path, as_json: bool, up_file: Path | None = None) -> None:
        self.servers = servers
        self.tls_dir = tls_dir
        self.json = as_json
        #: The ``up.json`` the cluster was found in (None: named by --server/--tls-dir).
        self.up_file = up_file

    def run(self, action: Callable[[ClusterClient], Awaitable[Any]]) -> Any:
        """Connect, await ``action(client)`` under trio and return its result.

        The connection is closed before this returns. A :class:`ClientError` (no control
        plane reachable, a refused call) exits with its message and status 1.
        """

        async def main() -> Any:
            async with connect(self.servers, tls_dir=self.tls_dir) as client:
                return await action(client)

        try:
            return run_trio(main)
        except ClientError as exc:
            if self.up_file is not None and "cannot reach" in str(exc):
                fail(f"{exc}\n(the local cluster {self.up_file} names is not running: start it with `llmgw up`, "
                     "or name another with --server and --tls-dir)")
            fail(str(exc))


def resolve_target(server: str | None, tls_dir: str | None) -> tuple[list[str], Path, Path | None]:
    """Returns ``(servers, tls_dir, up_file)``: the options given, else the local ``llmgw up``
    cluster's (``up_file`` its up.json; None when the options named the cluster).

    Exits with a message saying what to pass when neither names a cluster.
    """
    up_file = default_up_dir() / UP_FILE
    up: dict[str, Any] = {}
    if (server is None or tls_dir is None) and up_file.exists():
        try:
            up = json.loads(up_file.read_text())
        except (OSError, ValueError):
            up = {}
    from_up = up_file if (not server or not tls_dir) and up else None
    server = server or up.get("rpc")
    tls = tls_dir or up.get("tls_dir")
    if not server or not tls:
        fail("which cluster? pass --server HOST:PORT and --tls-dir DIR (an admin certificate), "
             "set LLMGW_SERVER and LLMGW_TLS_DIR, or start a local cluster with `llmgw up`")
    return [s.strip() for s in server.split(",") if s.strip()], Path(tls), from_up


def target_of(ctx: click.Context, as_json: bool = False) -> Target:
    """Returns the :class:`Target` of the ``ctl`` group's options; JSON when either ``--json`` was given."""
    server, tls_dir, group_json = ctx.meta.get(CTL_META_KEY, (None, None, False))
    servers, tls, up_file = resolve_target(server, tls_dir)
    return Target(servers, tls, group_json or as_json, up_file)


def call(ctx: click.Context, as_json: bool, action: Callable[[ClusterClient], Awaitable[Any]], *,
         as_data: Callable[[Any], Any] | None = None) -> Any:
    """Returns what ``action(client)`` returned from the cluster, for a command to print for people.

    With ``--json`` (the group's or the command's) it prints ``as_data(result)`` (the result
    itself when ``as_data`` is None) as JSON instead and ends the command with status 0, so
    the code after the call prints for people only. Errors exit as :meth:`Target.run` says.
    """
    target = target_of(ctx, as_json)
    result = target.run(action)
    if target.json:
        print_json(result if as_data is None else as_data(result))
        ctx.exit(0)
    return result


def remove(ctx: click.Context, as_json: bool, name: str, action: Callable[[ClusterClient], Awaitable[bool]], *,
           missing: str, done: str) -> None:
    """Remove ``name`` with ``action`` (True when it was there); print ``done``, or ``{"removed", "name"}`` as JSON.

    Exits with ``missing`` as the error when there was nothing to remove (status 0 with ``--json``).
    """
    removed = call(ctx, as_json, action, as_data=lambda removed: {"removed": removed, "name": name})
    if not removed:
        fail(missing)
    click.echo(done)


def mb(value: int) -> str:
    """Returns megabytes for a table: "512M", or "1.5G" from a gigabyte up."""
    return f"{value / 1024:.1f}G" if value >= 1024 else f"{value}M"
