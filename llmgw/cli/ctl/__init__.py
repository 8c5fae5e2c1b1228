"""``llmgw ctl``: operate a cluster over the Cap'n Proto client library (``llmgw.client``).

One module per command family, each importing only :mod:`llmgw.cli.ctl.common` (where
to connect, ``--json``), :mod:`llmgw.cli.output` and what its commands use: the client,
the catalog's validation, the CA. Nothing here loads the gateway, the control plane or
the agent (tests/unit/test_cli_imports.py checks it), so ``llmgw ctl`` starts quickly
and patches nothing.
"""

from __future__ import annotations

import click

from llmgw.cli.ctl.certs import certs
from llmgw.cli.ctl.cluster import engine_check, logs, nodes, replicas, status
from llmgw.cli.ctl.common import CTL_META_KEY
from llmgw.cli.ctl.config import config
from llmgw.cli.ctl.jobs import jobs
from llmgw.cli.ctl.keys import admin_tokens, keys, tenants, usage
from llmgw.cli.ctl.models import models
from llmgw.cli.ctl.servers import nodes_add, nodes_remove, servers
from llmgw.cli.ctl.serving import restart, start, stop
from llmgw.cli.ctl.upgrade import upgrade

__all__ = ["ctl"]


@click.group()
@click.option("--server", "-s", envvar="LLMGW_SERVER", help="Control plane RPC address(es), host:port[,host:port].")
@click.option("--tls-dir", envvar="LLMGW_TLS_DIR", help="Admin certificate directory (ca.pem, cert.pem, key.pem).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.pass_context
def ctl(ctx: click.Context, server: str | None, tls_dir: str | None, as_json: bool) -> None:
    """Operate a cluster: nodes, replicas, models, logs."""
    ctx.meta[CTL_META_KEY] = (server, tls_dir, as_json)


for _command in (status, nodes, replicas, engine_check, logs, models, tenants, keys, usage, stop, start, restart,
                 config, certs, servers, admin_tokens, upgrade, jobs):
    ctl.add_command(_command)
nodes.add_command(nodes_add)
nodes.add_command(nodes_remove)
