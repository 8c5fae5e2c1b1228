"""The Admin methods for machines joining and leaving (``llmgw ctl servers``, ``llmgw ctl
nodes add``), a mixin.

:func:`llmgw.control.admin.make_admin` calls :meth:`ServersAdminMixin.bind_servers`. A
token is minted only by a leader that holds the cluster CA's key (it answers the join
too); a control plane's only over a PostgreSQL store (SQLite cannot be shared by two
machines). Every change is audited.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable

from llmgw.config.agent import parse_engine_name
from llmgw.control.joining import JoinService, check_new_node_name
from llmgw.control.peers import FeedTee
from llmgw.control.store import Store, parse_target
from llmgw.control.store.base import JoinTokenRecord
from llmgw.credentials import check_name
from llmgw.jointoken import MAX_TTL_S, NodeOverrides, new_token
from llmgw.labels import parse_pairs, to_pairs
from llmgw.rpc.tls import Role, ca_sha256

log = logging.getLogger(__name__)

#: Roles a join token may be minted for: a control plane (`llmgw server join`), a node (`llmgw agent join`).
JOIN_ROLES = (Role.CONTROL.value, Role.NODE.value)


def token_view(record: JoinTokenRecord, now: float) -> dict[str, Any]:
    """Returns ``record`` as a capnp ``JoinTokenView``."""
    return {"id": record.id, "role": record.role, "name": record.name, "createdAt": record.created_at,
            "createdBy": record.created_by, "expiresAt": record.expires_at, "state": record.state(now),
            "usedBy": record.used_by or "", "labels": to_pairs(record.overrides.labels),
            "disabledEngines": list(record.overrides.disabled_engines)}


def _node_overrides(labels: list[str], disabled_engines: list[str]) -> NodeOverrides:
    """Returns a node token's overrides; raises ValueError saying which label or engine is wrong."""
    try:
        node_labels = parse_pairs(labels)
    except ValueError as exc:
        raise ValueError(f"--labels: {exc}") from None
    try:
        engines = [parse_engine_name(e) for e in disabled_engines]
    except ValueError as exc:
        raise ValueError(f"--disable-engine: {exc}") from None
    return NodeOverrides(node_labels, engines)


class ServersAdminMixin:
    """createJoinToken, listJoinTokens, removeControlPlane (see schema/llmgw.capnp)."""

    _servers_store: Store
    _servers_actor: str
    _servers_joins: JoinService | None
    _servers_tee: FeedTee
    _servers_leader: Callable[[], Awaitable[str]]

    def bind_servers(self, store: Store, actor: str, joins: JoinService | None, tee: FeedTee,
                     leader: Callable[[], Awaitable[str]]) -> None:
        """Act on ``store`` for ``actor``; ``joins`` is this leader's join desk (None: it holds
        no CA key), ``tee`` its stream to the standbys, ``leader()`` returns its own name."""
        self._servers_store = store
        self._servers_actor = actor
        self._servers_joins = joins
        self._servers_tee = tee
        self._servers_leader = leader

    async def createJoinToken(self, role: str, name: str, ttlSeconds: float, labels: Any, disabledEngines: Any,
                              _context: Any, **_: Any) -> None:
        role, name = str(role), str(name)
        if role not in JOIN_ROLES:
            raise ValueError(f"a join token is for one of: {', '.join(JOIN_ROLES)} (got {role!r})")
        overrides = _node_overrides([str(x) for x in labels], [str(x) for x in disabledEngines])
        if overrides and role != Role.NODE.value:
            raise ValueError("labels and disabled engines are for nodes (`ctl nodes add`), not control planes")
        if not 0 < ttlSeconds <= MAX_TTL_S:
            raise ValueError(f"a join token's lifetime must be above 0 and at most {MAX_TTL_S / 86400:g} days")
        joins = self._servers_joins
        if joins is None:
            raise RuntimeError("the leading control plane holds no cluster CA key, so nothing could sign the new "
                               "certificate: run `ctl servers add` while the control plane made by "
                               "`llmgw server init` (or one that joined with a token) leads")
        store = self._servers_store
        if role == Role.NODE.value:
            if name:  # none: the node's own host name, when it joins
                await check_new_node_name(store, name)
        else:
            check_name(name)
            if parse_target(joins.store_url)[0] == "sqlite":
                raise ValueError("a second control plane needs a PostgreSQL store (store.url in server.yaml): "
                                 "two machines cannot share a SQLite file; see docs/ha.md")
            if any(r.name == name for r in await store.list_control_planes()):
                raise ValueError(f"a control plane named {name!r} is in the cluster already: "
                                 f"`llmgw ctl servers remove {name}` first to replace it")
        token = new_token(ca_sha256(joins.ca.cert_pem))
        now = time.time()
        record = JoinTokenRecord(token.id, role, name, now, self._servers_actor, now + float(ttlSeconds),
                                 overrides=overrides)
        await store.create_join_token(record, token.secret_sha256)
        await store.audit(self._servers_actor, "join.token", name, {"role": role, "token": token.id,
                                                                   "expires_at": record.expires_at,
                                                                   **overrides.agent_yaml()})
        log.info("%s minted join token %s for %s %s", self._servers_actor, token.id, role, name)
        _context.results.token = str(token)
        _context.results.expiresAt = record.expires_at
        _context.results.controlPlanes = await joins.control_planes()

    async def listJoinTokens(self, _context: Any, **_: Any) -> None:
        now = time.time()
        _context.results.tokens = [token_view(t, now) for t in await self._servers_store.list_join_tokens()]

    async def removeControlPlane(self, name: str, _context: Any, **_: Any) -> None:
        name = str(name)
        if name == await self._servers_leader():
            raise ValueError(f"{name} leads: stop it first (`llmgw service stop` on it), let another take the "
                             "lead, then remove it")
        store = self._servers_store
        removal = await store.remove_control_plane(name, self._servers_actor)
        removed = removal.record
        if removed is not None or removal.tokens_revoked:
            await store.audit(self._servers_actor, "control_plane.remove", name,
                              {"serial": removed.serial if removed else "", "tokens_revoked": removal.tokens_revoked})
        if removed is not None:
            self._servers_tee.drop(name, "it was removed from the cluster (`llmgw ctl servers remove`)")
            log.info("%s removed control plane %s (certificate %s revoked)", self._servers_actor, name,
                     removed.serial or "unrecorded")
        _context.results.removed = removed is not None or removal.tokens_revoked > 0
