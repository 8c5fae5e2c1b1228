"""Tenants, API keys and serving switches: from the store into the gateway, and usage back.

* :func:`tenant_record` is the stored form of a tenant :func:`llmgw.catalog.validate_tenant`
  accepted.
* :func:`new_api_key` makes a key; the store keeps only the SHA-256 of its secret.
* :class:`AccessSync` keeps the gateway's in-memory view fresh: the active keys with their
  tenants and the cluster settings ``serving.stopped`` and ``routing``
  (:meth:`~llmgw.router.interface.GatewayInterface.apply_access`). It reloads at start,
  right after every change made through this control plane's Admin API
  (:meth:`AccessSync.reload`), and every :data:`RELOAD_INTERVAL_S` for changes made
  through another control plane. It also flushes the gateway's usage counters into the store every ``usage_flush_interval``,
  and at start, before the gateway serves, stores what the gateway's usage journal holds
  beyond the store (:mod:`llmgw.control.usage_replay`): a crash loses no finished request.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import trio

from llmgw import usage_journal
from llmgw.catalog.access import TenantSpec, check_key_name, generate_key
from llmgw.config.defaults import DEFAULT_USAGE_FLUSH_INTERVAL
from llmgw.control.settings import ROUTING, SERVING_STOPPED, SettingError, routing_overrides
from llmgw.control.store import Store
from llmgw.control.store.base import ApiKeyRecord, TenantRecord, UsageRecord
from llmgw.control.usage_replay import replay_usage_journals
from llmgw.logthrottle import LogThrottle
from llmgw.router.interface import AccessState, GatewayInterface, KeyEntry, Tenant

log = logging.getLogger(__name__)

#: Seconds between reloads of keys, tenants and settings, for changes made through
#: another control plane (changes through this one apply at once).
RELOAD_INTERVAL_S = 5.0
#: Bound on one reload or flush: the store's own statement timeouts are shorter.
STORE_CALL_TIMEOUT_S = 30.0
#: A stored setting this release refuses is read at every reload: said once per interval.
_refused_settings = LogThrottle(log)


def tenant_record(spec: TenantSpec) -> TenantRecord:
    """Returns the store's record of a validated tenant (timestamps are the store's to set)."""
    return TenantRecord(spec.name, spec.models, spec.max_concurrency, spec.rpm, spec.tpm)


def new_api_key(tenant: str, name: str) -> tuple[ApiKeyRecord, str]:
    """Return a new key's record (to store) and the key itself (to show once, never stored).

    Raises :class:`llmgw.catalog.AccessError` if ``name`` is too long."""
    check_key_name(name)
    made = generate_key()
    return ApiKeyRecord(made.key_id, tenant, name, made.secret_hash), made.key


def gateway_tenant(record: TenantRecord) -> Tenant:
    """Return the gateway's view of a stored tenant."""
    models = frozenset(record.models) if record.models is not None else None
    return Tenant(record.name, models, record.max_concurrency, record.rpm, record.tpm)


def key_entries(tenants: Iterable[TenantRecord], keys: Iterable[ApiKeyRecord]) -> list[KeyEntry]:
    """Return the gateway entries of the active keys whose tenant exists."""
    by_name = {t.name: gateway_tenant(t) for t in tenants}
    return [
        KeyEntry(k.id, bytes.fromhex(k.secret_sha256), by_name[k.tenant])
        for k in keys
        if k.revoked_at is None and k.tenant in by_name
    ]


def _routing(stored: Any) -> dict[str, Any]:
    """Returns the stored ``routing`` setting's overrides; a value this release refuses (stored
    by another one) is logged (once per interval: every reload reads it) and left out, so the
    gateway keeps server.yaml's routing."""
    if stored is None:
        return {}
    try:
        return routing_overrides(stored)
    except SettingError as exc:
        _refused_settings.failure((ROUTING, str(exc)), logging.WARNING,
                                  "ignoring the cluster setting %s: %s (fix it with `llmgw ctl config set`)",
                                  ROUTING, exc)
        return {}


class AccessSync:
    """Keeps ``gateway``'s keys, tenants, ``serving.stopped`` and ``routing`` equal to the store's;
    flushes its usage counters into the store.

    ``usage_journal`` is the directory the gateway journals its usage in
    (:mod:`llmgw.usage_journal`; None: it keeps none): replayed into the store at start,
    and pruned after every flush."""

    def __init__(
        self, store: Store, gateway: GatewayInterface, *, usage_flush_interval: float = DEFAULT_USAGE_FLUSH_INTERVAL,
        usage_journal: Path | None = None,
    ) -> None:
        self.store = store
        self.gateway = gateway
        self.usage_flush_interval = usage_flush_interval
        self.usage_journal = usage_journal
        self._reload_lock = trio.Lock()
        #: Called by :meth:`changed` (the leader tells its standbys to reload at once).
        self.on_change: Callable[[], None] | None = None
        # Held while counts move from the gateway to the store, so a reader sees them in
        # exactly one of the two places (usage_totals).
        self._flush_lock = trio.Lock()

    async def reload(self) -> None:
        """Read tenants, keys, ``serving.stopped`` and ``routing`` and apply them to the gateway.

        Raises the store's error (the gateway keeps its previous view) or
        ``trio.TooSlowError`` after :data:`STORE_CALL_TIMEOUT_S`. Returns once the gateway
        has applied it (a worker pool: bounded, see its ``apply_access``).
        """
        async with self._reload_lock:
            with trio.fail_after(STORE_CALL_TIMEOUT_S):
                tenants = await self.store.list_tenants()
                keys = await self.store.list_api_keys()
                stopped = await self.store.get_setting(SERVING_STOPPED)
                routing = await self.store.get_setting(ROUTING)
            access = AccessState(tuple(key_entries(tenants, keys)),
                                 bool(stopped.value) if stopped is not None else False,
                                 _routing(routing.value if routing is not None else None))
            await self.gateway.apply_access(access)

    def changed(self) -> None:
        """An admin call changed keys, tenants, ``serving.stopped`` or ``routing`` (and :meth:`reload`
        applied it here): tell whoever listens (the standbys, on a leader). Never raises."""
        if self.on_change is not None:
            self.on_change()

    async def flush_usage(self) -> None:
        """Write the usage counted since the last flush to the store.

        The counts carry their usage journals' marks into the same transaction, and the
        journal segments the store now holds are deleted. On failure the counts are kept
        for the next flush and the error is raised.
        """
        async with self._flush_lock:
            drained = self.gateway.drain_usage()
            if not drained:
                return
            rows = [UsageRecord(tenant, model, c.requests, c.prompt_tokens, c.completion_tokens)
                    for (tenant, model), c in drained.counts.items()]
            try:
                with trio.fail_after(STORE_CALL_TIMEOUT_S):
                    await self.store.add_usage(rows, marks=drained.marks)
            except BaseException:
                self.gateway.restore_usage(drained)
                raise
            if self.usage_journal is not None and drained.marks:
                # The store holds them now: their journal segments may go.
                await trio.to_thread.run_sync(usage_journal.release, self.usage_journal, drained.marks)

    async def usage_totals(self) -> list[UsageRecord]:
        """Return the stored usage plus what this gateway counted since the last flush,
        ordered by tenant and model (each count in exactly one of the two)."""
        async with self._flush_lock:
            with trio.fail_after(STORE_CALL_TIMEOUT_S):
                stored = await self.store.list_usage()
            pending = await self.gateway.pending_usage()
        totals = {(u.tenant, u.model): [u.requests, u.prompt_tokens, u.completion_tokens] for u in stored}
        for key, counts in pending.items():
            row = totals.setdefault(key, [0, 0, 0])
            row[0] += counts.requests
            row[1] += counts.prompt_tokens
            row[2] += counts.completion_tokens
        return [UsageRecord(tenant, model, *row) for (tenant, model), row in sorted(totals.items())]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load once and replay the usage journals left by the last run (errors propagate,
        so a broken store stops start-up), report started (the gateway may serve now), then
        reload and flush periodically until cancelled; later errors are logged and retried.
        On cancellation the pending usage gets one last, shielded flush."""
        await self.reload()
        if self.usage_journal is not None:
            with trio.fail_after(STORE_CALL_TIMEOUT_S):
                await replay_usage_journals(self.store, self.usage_journal)
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._every, RELOAD_INTERVAL_S, self.reload, "reload API keys and settings")
                nursery.start_soon(self._every, self.usage_flush_interval, self.flush_usage, "store usage")
        finally:
            await self._last_flush("the last usage counts")

    async def serve(self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the gateway (its ``serve``: reports the bound port, raises ``OSError`` if it
        cannot bind); once it has stopped, store the usage it counted until then (a worker
        pool's workers hand over their last counts as they stop)."""
        try:
            await self.gateway.serve(host, port, task_status=task_status)
        finally:
            await self._last_flush("the gateway's last usage counts")

    async def _last_flush(self, what: str) -> None:
        """Flush once more, shielded from cancellation and bounded; log what was lost on failure."""
        with trio.CancelScope(shield=True), trio.move_on_after(STORE_CALL_TIMEOUT_S):
            try:
                await self.flush_usage()
            except Exception as exc:  # noqa: BLE001 - shutting down; say what was lost
                log.warning("could not store %s: %s", what, exc)

    @staticmethod
    async def _every(interval: float, action: Any, what: str) -> None:
        while True:
            await trio.sleep(interval)
            try:
                await action()
            except Exception as exc:  # noqa: BLE001 - keep serving with the last good view
                log.warning("could not %s: %s (retrying in %gs)", what, exc, interval)
