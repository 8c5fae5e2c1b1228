"""The cluster CA on a control plane's disk: layout of the state directory and issuing.

Layout under a control plane's ``state_dir``::

    ca/       ca.pem, ca-key.pem (0600)         the cluster CA
    server/   ca.pem, cert.pem, key.pem          this control plane (role control)
    admin/    ca.pem, cert.pem, key.pem          a local admin for `llmgw ctl`
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Iterable

from llmgw.rpc.tls import CA_CERT_FILE, CERT_FILE, ClusterCA, Credentials, Role, read_credentials, write_credentials

CA_DIR = "ca"
SERVER_DIR = "server"
ADMIN_DIR = "admin"
#: Names a local control plane is always reachable by.
LOCAL_SANS = ("127.0.0.1", "::1", "localhost")


def ensure_cluster_pki(state_dir: Path, *, server_name: str | None = None, sans: Iterable[str] = (),
                       admin_name: str = "admin") -> tuple[ClusterCA, bool]:
    """Create the CA, the server's and a local admin's certificates where missing.

    Returns ``(ca, created)``; ``created`` is True when a new CA was made.
    Existing files are left alone (re-run safe).
    """
    ca_dir = state_dir / CA_DIR
    created = not (ca_dir / CA_CERT_FILE).exists()
    ca = ClusterCA.create(ca_dir) if created else ClusterCA.load(ca_dir)
    if not (state_dir / SERVER_DIR / CERT_FILE).exists():
        names = list(dict.fromkeys([*LOCAL_SANS, *sans]))
        issued = ca.issue(Role.CONTROL, server_name or socket.gethostname(), sans=names)
        write_credentials(state_dir / SERVER_DIR, ca.cert_pem, issued)
    if not (state_dir / ADMIN_DIR / CERT_FILE).exists():
        write_credentials(state_dir / ADMIN_DIR, ca.cert_pem, ca.issue(Role.ADMIN, admin_name))
    return ca, created


def issue_to(ca: ClusterCA, role: str, name: str, out: Path, sans: Iterable[str] = ()) -> Credentials:
    """Issue a certificate for ``role``/``name`` into the credentials directory ``out``."""
    write_credentials(out, ca.cert_pem, ca.issue(role, name, sans=list(sans)))
    return read_credentials(out)
