"""One-time join tokens as operators copy them: ``llmgwj1.<id>.<secret>.<ca-sha256>``.

A token names the row in the store (``id``), proves its bearer was given it (``secret``,
of which the store keeps only the SHA-256) and pins the cluster CA (``ca-sha256``, the
SHA-256 of the CA certificate): the joining machine checks the server against the pin
before it sends the token, so a token cannot be phished by something answering in the
cluster's place.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from typing import Any, Mapping

import attrs

from llmgw.labels import check_labels, describe

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
class NodeOverrides:
    """What a node's join token writes into its agent.yaml beside the control planes and TLS
    files (``llmgw ctl nodes add --labels ... --disable-engine ...``): its labels and the
    engines it never runs. Engine names are checked where they are given (the control plane)."""

    labels: Mapping[str, str] = attrs.field(factory=dict, converter=check_labels)
    disabled_engines: tuple[str, ...] = attrs.field(default=(), converter=lambda v: tuple(sorted(set(v))))

    def __bool__(self) -> bool:
        return bool(self.labels or self.disabled_engines)

    def to_json(self) -> str:
        """Returns these overrides as the store keeps them."""
        return json.dumps({"labels": dict(self.labels), "disabled_engines": list(self.disabled_engines)},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> NodeOverrides:
        """Returns the overrides the store kept as ``text`` ("" or "{}": none); raises ValueError for a damaged value."""
        data: Any = json.loads(text or "{}")
        if not isinstance(data, dict):
            raise ValueError(f"node overrides must be a JSON object, got {text!r}")
        return cls(data.get("labels") or {}, data.get("disabled_engines") or ())

    def agent_yaml(self) -> dict[str, Any]:
        """Returns the agent.yaml keys these overrides set (none for what is not set)."""
        keys: dict[str, Any] = {}
        if self.labels:
            keys["labels"] = dict(self.labels)
        if self.disabled_engines:
            keys["disabled_engines"] = list(self.disabled_engines)
        return keys

    def describe(self) -> str:
        """Returns the overrides in words ("labels gpu=a100; vllm disabled"), "" for none."""
        parts = []
        if self.labels:
            parts.append(f"labels {describe(self.labels)}")
        if self.disabled_engines:
            parts.append(f"{', '.join(self.disabled_engines)} disabled")
        return "; ".join(parts)


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
