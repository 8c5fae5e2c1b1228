"""One-time join tokens as operators copy them: ``llmgwj1.<id>.<secret>.<ca-sha256>``.

A token names the row in the store (``id``), proves its bearer was given it (``secret``,
of which the store keeps only the SHA-256) and pins the cluster CA (``ca-sha256``, the
SHA-256 of the CA certificate): the joining machine checks the server against the pin
before it sends the token, so a token cannot be phished by something answering in the
cluster's place.
"""

from __future__ import annotations

import hashlib
import re
import secrets

import attrs

PREFIX = "llmgwj1"
#: Default time a join token stays valid: long enough to provision a machine, short
#: enough that a token pasted into a ticket is dead by the time anyone reads it.
DEFAULT_TTL_S = 3600.0
#: Longest a join token may stay valid (a week): tokens are for the next join, not a standing credential.
MAX_TTL_S = 7 * 24 * 3600.0

_ID_BYTES = 6
_SECRET_BYTES = 24
_FORM = re.compile(rf"^{PREFIX}\.([0-9a-f]{{12}})\.([A-Za-z0-9_-]{{32}})\.([0-9a-f]{{64}})$")


@attrs.frozen
class JoinToken:
    """A parsed join token."""

    id: str
    secret: str = attrs.field(repr=False)
    ca_sha256: str

    def __str__(self) -> str:
        return f"{PREFIX}.{self.id}.{self.secret}.{self.ca_sha256}"

    @property
    def secret_sha256(self) -> str:
        """The SHA-256 of the secret, hex: what the store keeps."""
        return hashlib.sha256(self.secret.encode("ascii")).hexdigest()


def new_token(ca_sha256: str) -> JoinToken:
    """Return a fresh random token pinning the CA whose certificate hashes to ``ca_sha256``."""
    return JoinToken(secrets.token_hex(_ID_BYTES), secrets.token_urlsafe(_SECRET_BYTES), ca_sha256.lower())


def parse_token(text: str) -> JoinToken:
    """Return the token ``text`` spells (surrounding white space ignored). Raises
    :class:`ValueError` saying what a token looks like, without repeating the input."""
    match = _FORM.match(text.strip())
    if match is None:
        raise ValueError(f"this is not an llmgw join token (expected {PREFIX}.<12 hex>.<32 characters>.<64 hex>, "
                         "as `llmgw ctl servers add` prints it): copy it again, whole")
    return JoinToken(*match.groups())
