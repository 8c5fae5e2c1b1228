"""Refused calls on the RPC port: who tried what, in the log and in the audit log.

A certificate whose role does not fit the call (a node certificate asking for ``admin``,
an admin one joining as a node) or whose name does not (a node joining as another node)
is refused with :class:`PermissionError` as before; :func:`require` also writes the
refusal, with the certificate's role and name, to the log and to the store's audit log
(action ``refused.<call>``). A caller retrying in a loop writes one line and one audit
record per kind, then one per interval with a count (:class:`~llmgw.logthrottle.LogThrottle`),
so refusals cannot flood either.
"""

from __future__ import annotations

import logging
from typing import Collection

import trio

from llmgw.control.store import Store
from llmgw.logthrottle import LogThrottle
from llmgw.rpc.tls import Identity, Role, require_role

__all__ = ["AUDIT_TIMEOUT_S", "actor_of", "refuse", "require"]

log = logging.getLogger(__name__)

#: Seconds a refused call waits for its audit record; a slow store must not hold the
#: refusal (the log line is written first, and a failed write is logged).
AUDIT_TIMEOUT_S = 2.0

# Shared by every connection: the kinds are (certificate, call, name claimed), wherever they come from.
_refusals = LogThrottle(log)


def actor_of(identity: Identity) -> str:
    """Returns how ``identity`` is named in the audit log: ``<role>:<name>``, e.g. ``node:gpu-7``."""
    return f"{identity.role.value}:{identity.name}"


async def require(
    store: Store | None,
    identity: Identity,
    role: Role | str | Collection[Role | str],
    *,
    call: str,
    name: str | None = None,
    target: str = "",
) -> None:
    """Check that ``identity`` may make ``call`` as ``role`` (and, with ``name``, as that
    holder): :func:`~llmgw.rpc.tls.require_role`. Returns None.

    On refusal, logs it (throttled per certificate and call) and, when a line was written
    and ``store`` is given, appends an audit record ``refused.<call>`` on ``target`` (the
    name claimed, if any), then raises the :class:`PermissionError`. A store that fails or
    takes over :data:`AUDIT_TIMEOUT_S` is logged and does not change the answer.
    """
    try:
        require_role(identity, role, name=name)
    except PermissionError as exc:
        await _record(store, identity, call, name, target or (name or ""), exc)
        raise


async def refuse(store: Store | None, identity: Identity, *, call: str, target: str, reason: str) -> None:
    """Refuse ``call`` from ``identity`` for ``reason`` (a check beyond the certificate's
    role): logged and audited as :func:`require` does; raises PermissionError."""
    exc = PermissionError(f"{identity} may not make this call ({call}): {reason}")
    await _record(store, identity, call, None, target, exc)
    raise exc


async def _record(
    store: Store | None, identity: Identity, call: str, name: str | None, target: str, exc: PermissionError,
) -> None:
    key = (identity.role, identity.name, call, name)  # joining as node-b and as node-c are two kinds
    repeated = _refusals.suppressed(key)
    if _refusals.failure(key, logging.WARNING, "refused %s from %s: %s", call, identity, exc) and store is not None:
        await _audit(store, identity, call, target, str(exc), repeated)


async def _audit(store: Store, identity: Identity, call: str, target: str, reason: str, repeated: int) -> None:
    detail = {"reason": reason, "role": identity.role.value, "name": identity.name, "repeated": repeated}
    try:
        with trio.fail_after(AUDIT_TIMEOUT_S):
            await store.audit(actor_of(identity), f"refused.{call}", target, detail)
    except Exception as exc:  # noqa: BLE001 - the refusal stands whatever the store does
        log.warning("could not audit the refused %s from %s: %s", call, identity, exc)
