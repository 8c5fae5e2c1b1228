"""Leader election among the control planes of one store: who runs the cluster's decisions.

:class:`LeaderElection` campaigns until cancelled. While it leads it runs the caller's
``lead(epoch)`` in a nursery of its own (the reconciler, node sessions, the stream to the
standbys) and renews its lease; the moment a renewal fails, is refused or is late, that
nursery is cancelled, before any standby may take over. The blocking half (the lock,
the lease row, deposing a frozen leader) is :mod:`llmgw.control.store.election`.

Timing, with the default lease of :data:`LEADER_LEASE_S` seconds: the leader renews every
fifth of the lease and stops leading by its own clock when no renewal sent in the last
:data:`STEP_DOWN_SHARE` of the lease has succeeded; a standby deposes a leader whose row
is older than the whole lease (the database's clock). A leader that died (its PostgreSQL
session closed with its process) is replaced within :data:`CAMPAIGN_POLL_S`; a frozen one
within a lease.

While it does not lead, :attr:`LeaderElection.leader` is the store's view of who does.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Awaitable, Callable, TypeVar

import trio

from llmgw.config.defaults import DEFAULT_LEADER_LEASE
from llmgw.control.store import Store, StoreError
from llmgw.control.store.election import Election, LeaderRecord, open_election

log = logging.getLogger(__name__)
T = TypeVar("T")
#: ``lead(epoch, task_status=...)``: what a leader runs, started with ``nursery.start``.
LeadFunction = Callable[..., Awaitable[None]]

#: Seconds a leader's lease lasts without renewal (the reason is beside the default).
LEADER_LEASE_S = DEFAULT_LEADER_LEASE
#: Renewals per lease: a lost one or two still leave time before stepping down.
RENEWALS_PER_LEASE = 5
#: A leader stops leading when no renewal sent within this share of the lease has come
#: back: well before a standby may depose it (the whole lease, counted from the same or a
#: later moment by the database), so two leaders never act at once.
STEP_DOWN_SHARE = 0.6
#: How often a standby tries to take the lead, and reads who holds it: a leader that died
#: (its database session closed with it) is replaced within about this long.
CAMPAIGN_POLL_S = 1.0
#: Pause after the store failed before campaigning again (a lead that was lost while the
#: store answers is campaigned for again at once).
STORE_RETRY_S = 2.0


class LeaderElection:
    """One control plane's campaign (see the module docstring).

    ``name`` is this control plane's (its certificate's), ``rpc_address`` and
    ``http_address`` where peers, agents and clients reach it; ``store`` is fenced with the
    epoch while leading (:meth:`~llmgw.control.store.Store.set_fence`).
    """

    def __init__(
        self, store_url: str | os.PathLike[str], store: Store, *, name: str, rpc_address: str,
        http_address: str, lease: float = LEADER_LEASE_S, poll: float = CAMPAIGN_POLL_S,
    ) -> None:
        self._store_url = store_url
        self._store = store
        self.name = name
        self.rpc_address = rpc_address
        self.http_address = http_address
        self.lease = lease
        self.poll = poll
        #: The epoch this control plane leads at, or None while it does not lead.
        self.epoch: int | None = None
        #: Who leads as last read from the store (this control plane while it leads).
        self.leader: LeaderRecord | None = None
        #: Unix seconds (this machine's clock) since this control plane leads.
        self.leading_since: float | None = None
        self._changed = trio.Event()

    @property
    def leading(self) -> bool:
        return self.epoch is not None

    async def wait_changed(self) -> None:
        """Returns after the next change of :attr:`epoch` or :attr:`leader`."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run(
        self, lead: LeadFunction, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Campaign until cancelled; while leading, run ``lead(epoch)`` (started with
        ``nursery.start``; cancelled when the lead is lost).

        Reports started after the first attempt: when it won, once ``lead`` has reported
        started (so a lone control plane leads by then). Store errors are logged and
        retried; an exception out of ``lead`` propagates. Cancellation closes the
        election's connection, which gives up the lead.
        """
        started = False
        while True:
            election: Election | None = None
            pause = 0.0
            try:
                election = await self._call(lambda: open_election(self._store_url, max(1.0, self.lease / 4)))
                while True:
                    epoch = await self._call(lambda: election.try_lead(  # type: ignore[union-attr]
                        self.name, self.rpc_address, self.http_address))
                    if epoch is not None:
                        def leading() -> None:
                            nonlocal started
                            if not started:
                                task_status.started()
                                started = True

                        await self._lead(election, epoch, lead, leading)
                        # Campaign again at once, on a new connection: the lead is often
                        # lost with the old one (the lock went with its session), and the
                        # store answers; waiting would leave the cluster without a leader.
                        break
                    await self._observe(election)
                    if not started:
                        task_status.started()
                        started = True
                    await trio.sleep(self.poll)
            except (StoreError, trio.TooSlowError) as exc:
                log.warning("leader election on the store: %s; trying again in %gs", exc, STORE_RETRY_S)
                pause = STORE_RETRY_S
                if not started:
                    task_status.started()
                    started = True
            finally:
                if election is not None:
                    _close_later(election)
            await trio.sleep(pause)

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run blocking ``fn`` in a thread, for at most half a lease (TooSlowError: the
        thread is left to finish on its own; its connection is closed after it)."""
        with trio.fail_after(self.lease / 2):
            return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)

    async def _observe(self, election: Election) -> None:
        """Read who leads; depose a leader whose lease ran out."""
        record = await self._call(election.read)
        if record is not None and record.renewed_age > self.lease:
            deposed = await self._call(lambda: election.depose_expired(self.lease))
            if deposed is not None:
                log.warning("deposed control plane %s: it had not renewed its lead for %.1fs (lease %gs)",
                            deposed, record.renewed_age, self.lease)
        if record != self.leader:
            if record is not None and (self.leader is None or record.epoch != self.leader.epoch):
                log.info("control plane %s leads (epoch %d)", record.name, record.epoch)
            self.leader = record
            self._notify()

    async def _lead(
        self, election: Election, epoch: int, lead: LeadFunction, leading: Callable[[], None],
    ) -> None:
        """Lead at ``epoch`` until the lead is lost, then return (fenced: the store refuses
        this epoch's writes from then on, whoever leads next). Calls ``leading()`` once
        ``lead`` has reported started."""
        self._store.set_fence(epoch)
        self.epoch = epoch
        self.leading_since = time.time()
        log.info("this control plane (%s) leads now, epoch %d", self.name, epoch)
        reason = "its work ended"
        try:
            self.leader = await self._call(election.read)
            self._notify()
            async with trio.open_nursery() as nursery:
                await nursery.start(lead, epoch)
                leading()
                every = self.lease / RENEWALS_PER_LEASE
                step_down_at = trio.current_time() + self.lease * STEP_DOWN_SHARE
                while True:
                    await trio.sleep(every)
                    sent = trio.current_time()
                    try:
                        with trio.move_on_at(step_down_at):
                            renewed = await trio.to_thread.run_sync(lambda: election.renew(epoch), abandon_on_cancel=True)
                            if not renewed:
                                reason = "the store says another control plane leads now"
                                break
                            step_down_at = sent + self.lease * STEP_DOWN_SHARE
                            continue
                        reason = f"no renewal succeeded for {self.lease * STEP_DOWN_SHARE:g}s"
                        break
                    except StoreError as exc:
                        if trio.current_time() >= step_down_at:
                            reason = f"the store failed: {exc}"
                            break
                        log.warning("renewing the lead failed (%s); retrying", exc)
                nursery.cancel_scope.cancel()
        finally:
            self.epoch = None
            self.leading_since = None
            self._notify()
        log.warning("this control plane (%s) stopped leading (epoch %d): %s", self.name, epoch, reason)


def _close_later(election: Election) -> None:
    """Close ``election`` in a thread of its own: a call of it may still run in an
    abandoned thread, and closing waits for that (bounded by the statement timeout)."""
    def close() -> None:
        try:
            election.close()
        except Exception as exc:  # noqa: BLE001 - nothing is left to do with it
            log.debug("closing the election's connection: %s", exc)

    trio.lowlevel.start_thread_soon(close, lambda _outcome: None)
