"""Where TLS credentials live and whom a certificate may name: plain values.

:mod:`llmgw.rpc.tls` writes and checks the files; :mod:`llmgw.config` only points at
them (``agent.yaml``'s ``tls:`` and ``node_id``). Both take the file names and the name
rule from here, so reading a configuration does not load the TLS machinery.
Nothing here does I/O.
"""

from __future__ import annotations

import re

__all__ = ["CA_CERT_FILE", "CA_KEY_FILE", "CERT_FILE", "KEY_FILE", "check_name"]

#: File names in a CA directory (written by :meth:`llmgw.rpc.tls.ClusterCA.create`).
CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"
#: File names in a credentials directory (written by :func:`llmgw.rpc.tls.write_credentials`);
#: the CA certificate there has the same name as in the CA directory, but no key.
CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"

#: Names (node ids, admin names, control plane names) go into certificate subjects and
#: URIs, and are shown in logs: keep them to hostname-like characters, plus ``@`` so an
#: admin can be ``alice@example.org``.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")


def check_name(name: str) -> str:
    """Return ``name`` if it can name a certificate holder (node id, admin, control plane).

    Raises :class:`ValueError` saying which characters are allowed otherwise.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid name {name!r}: use 1-128 letters, digits, '.', '_', '-' or '@', "
            "starting with a letter or digit"
        )
    return name
