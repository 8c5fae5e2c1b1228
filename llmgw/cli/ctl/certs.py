"""``llmgw ctl certs issue``: certificates of the cluster CA, issued on the host that holds its key."""

from __future__ import annotations

from pathlib import Path

import click

from llmgw.cli.common import default_up_dir
from llmgw.cli.output import fail
from llmgw.cli.pki import CA_DIR, issue_to
from llmgw.rpc.tls import ClusterCA, TLSFileError


@click.group()
def certs() -> None:
    """Certificates of the cluster CA (run on a control plane host: needs the CA key)."""


@certs.command("issue")
@click.option("--role", type=click.Choice(["node", "admin", "control"]), required=True)
@click.option("--name", required=True, help="Node id, admin name or control plane name.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Directory for ca.pem, cert.pem, key.pem.")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None,
              help="The control plane's state directory holding ca/ [the local `llmgw up` cluster].")
@click.option("--san", "sans", multiple=True, help="Address or DNS name (control certificates).")
def certs_issue(role: str, name: str, out: Path, state_dir: Path | None, sans: tuple[str, ...]) -> None:
    """Issue a certificate from the cluster CA into a directory."""
    state_dir = state_dir or default_up_dir()
    try:
        ca = ClusterCA.load(state_dir / CA_DIR)
        creds = issue_to(ca, role, name, out, sans)
    except (TLSFileError, ValueError, OSError) as exc:
        fail(str(exc))
    click.echo(f"issued {creds.identity} into {out} (ca.pem, cert.pem, key.pem)")
