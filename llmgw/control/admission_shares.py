"""Tenant limits shared by the gateways of several control planes (docs/ha.md).

Every control plane serves ``/v1/*``, and each tenant's ``max_concurrency``, ``rpm`` and
``tpm`` hold for the whole cluster: each gateway enforces a *share* of every limit
(:class:`~llmgw.router.interface.AdmissionShares`: ``ceil(limit x fraction)``, then divided
among its worker processes), and the shares of one tenant's limit add up to at most 1.

* **Demand up.** Every :data:`ADMISSION_SYNC_S` each standby reports its gateway's demand
  per tenant to the leader (``ControlPeer.reportDemand``: in flight, admitted, shed and
  tokens asked for since its last report); the leader reads its own gateway's.
* **Shares down.** The leader's :class:`ShareBook` smooths the demand and computes each
  gateway's share of each limit (:func:`compute_shares`): a floor of ``1/(4N)`` each, so an
  idle gateway still admits a first request, and the rest in proportion to demand. It
  sends a gateway its shares (``GatewayFeed.admissionShares``; its own gateway directly)
  only when they change, shrinks before it grows: a share grows only into room that no
  other gateway can be enforcing any more (what it was sent and has not acknowledged yet
  counts), so the shares a tenant's gateways enforce add up to at most 1 at every moment.
* **Without a leader** (start, leader lost, partitioned standby) a gateway enforces the
  equal share ``1/N`` (N: the control planes the store lists): at once where its share was
  larger, and where it was smaller only :data:`FALLBACK_AFTER_S` after its last report
  reached the leader, by which time the leader has counted it at ``1/N`` and shrunk the
  others (:class:`LocalShares`). The leader counts a gateway it has not heard from within
  :data:`STALE_AFTER_S` (or ever) at ``1/N``.

Each gateway's admission stays synchronous and in-process; only the reports and the shares
cross processes, once per interval.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

import attrs
import capnp
import trio

from llmgw.router.interface import AdmissionShares, GatewayInterface, TenantDemand, TenantShare

log = logging.getLogger(__name__)

#: Seconds between demand reports and share computations. One small call per standby per
#: second is nothing next to the KV stream, and shares follow a shift of demand within a
#: couple of seconds: about as fast as a client backs off after a 429 (Retry-After: 1).
ADMISSION_SYNC_S = 1.0
#: Each gateway's floor is ``1 / (FLOOR_PART x N)`` of a limit: an idle gateway admits a
#: first request at once, and a tenant whose traffic all goes through one gateway gets
#: ``1 - (N - 1) / (4N)`` of its limit there (7/8 with two control planes, 5/6 with three).
FLOOR_PART = 4
#: Weight of the past in the smoothed demand, per interval (a half-life of one interval):
#: one quiet second does not hand a busy gateway's share away, a real shift is followed
#: within about three intervals.
DEMAND_DECAY = 0.5
#: Smoothed demand below this counts as none (it decays geometrically, never to zero).
DEMAND_MIN = 0.01
#: A tenant's shares are sent again only when one of them moves by at least this (or one
#: must shrink for the sum to stay within 1): noise in the demand causes no chatter.
SHARE_STEP = 1 / 32
#: Shares are rounded down to multiples of ``1 / SHARE_QUANTUM`` (exact in binary: sums of
#: rounded shares never exceed the unrounded sum).
SHARE_QUANTUM = 4096
#: A standby whose last report is older than this is counted at its fallback share ``1/N``
#: (it may have lost the session and fallen back) and is sent nothing.
STALE_AFTER_S = 3 * ADMISSION_SYNC_S
#: Seconds after its last report reached the leader before a gateway without a leader
#: grows to ``1/N``: longer than the leader takes to count it stale
#: (:data:`STALE_AFTER_S` and an interval) plus the deadline of the shrinks that make
#: room for it (:data:`~llmgw.control.peers.PEER_CALL_TIMEOUT`, 10 s: a standby that does
#: not take one in time loses its session and falls back itself). The leader, in turn,
#: counts a standby it has not heard from for this long at exactly ``1/N``: by then the
#: standby's ping or report has failed (3 s each, an interval apart), it has left the
#: session and shrunk to at most ``1/N`` (a pool's workers take up to 5 s), or it is dead.
FALLBACK_AFTER_S = 15.0
#: Seconds between the leader's reads of the control planes the store lists (N).
PLANES_REFRESH_S = 5.0
#: Float slack of share sums and comparisons.
EPS = 1e-9

#: Demand weights of one tenant at one gateway: (concurrency, rpm, tpm).
Weights = tuple[float, float, float]
_NO_WEIGHTS: Weights = (0.0, 0.0, 0.0)


def fallback_share(gateways: int) -> float:
    """Return the equal share ``1/N`` a gateway enforces without a leader."""
    return 1.0 / max(1, gateways)


def demand_weights(demand: TenantDemand) -> Weights:
    """Return the weights of one window's demand for each limit: slots wanted (in flight and
    shed), requests wanted (admitted and shed), tokens asked for."""
    return (float(demand.in_flight + demand.shed), float(demand.admitted + demand.shed), float(demand.tokens))


def _quantize(value: float) -> float:
    return math.floor(value * SHARE_QUANTUM) / SHARE_QUANTUM


def _kinds(share: TenantShare) -> Weights:
    return (share.concurrency, share.rpm, share.tpm)


def compute_shares(
    weights: Mapping[str, Mapping[str, Weights]], gateways: int
) -> dict[str, dict[str, TenantShare]]:
    """Return each live gateway's share of each tenant's limits, by gateway and tenant.

    ``weights`` holds the live gateways (those the leader hears from), each with its
    tenants' demand weights; ``gateways`` is N, every control plane (at least the live
    ones), the others counted at their fallback ``1/N``. Per tenant and limit, each live
    gateway gets ``1/(FLOOR_PART x N)`` plus the rest of the live gateways' part (``live/N``)
    in proportion to its weight, rounded down to :data:`SHARE_QUANTUM`; with no weight
    anywhere, ``1/N`` each. So one tenant's shares add up to at most ``live/N``. Every
    tenant with a weight anywhere is in every live gateway's result.
    """
    live = sorted(weights)
    if not live:
        return {}
    n = max(gateways, len(live))
    floor = 1.0 / (FLOOR_PART * n)
    rest = len(live) / n - len(live) * floor
    equal = fallback_share(n)
    tenants = sorted({t for w in weights.values() for t in w})
    out: dict[str, dict[str, TenantShare]] = {g: {} for g in live}
    for tenant in tenants:
        columns = []
        for kind in range(3):
            row = [max(0.0, weights[g].get(tenant, _NO_WEIGHTS)[kind]) for g in live]
            total = sum(row)
            if total <= 0:
                columns.append([equal] * len(live))
            else:
                columns.append([_quantize(floor + rest * w / total) for w in row])
        for i, g in enumerate(live):
            out[g][tenant] = TenantShare(columns[0][i], columns[1][i], columns[2][i])
    return out


@attrs.frozen
class Publication:
    """Shares the leader sends one gateway: acknowledge with :meth:`ShareBook.applied`."""

    gateway: str
    version: int
    shares: AdmissionShares


class _Gateway:
    """What the leader knows of one gateway."""

    def __init__(self) -> None:
        self.acked: AdmissionShares | None = None  # what it applied last (None: unknown, at most 1/N)
        self.pending: list[tuple[int, AdmissionShares]] = []  # sent, not acknowledged yet
        self.latest: AdmissionShares | None = None  # the last sent (None: unknown, taken as 1/N)
        self.weights: dict[str, Weights] = {}
        self.reported_at: float | None = None
        self.session: object = None
        self.force = False  # send it its shares at the next tick even if unchanged

    def tables(self) -> Iterable[AdmissionShares]:
        if self.acked is not None:
            yield self.acked
        for _, shares in self.pending:
            yield shares
        if self.latest is not None:
            yield self.latest


class ShareBook:
    """The leader's view of every gateway's shares (see the module docstring).

    ``me`` is the leader's own control plane, whose gateway enforces ``current`` now. The
    leader feeds it the control planes the store lists (:meth:`set_planes`), every
    gateway's demand (:meth:`report`), and acknowledgements (:meth:`applied`); :meth:`tick`
    returns what to send. Synchronous, no I/O; time is passed in.
    """

    def __init__(self, me: str, current: AdmissionShares = AdmissionShares()) -> None:
        self.me = me
        self._listed: set[str] = {me}
        self._known: dict[str, _Gateway] = {me: _Gateway()}
        self._versions = 0
        self._expected = 0
        self._now = -math.inf
        #: N: the control planes counted (listed in the store, attached, and this one).
        self.gateways = 1
        self.mine(current)

    def mine(self, current: AdmissionShares) -> None:
        """Say that the leader's own gateway enforces ``current`` now."""
        known = self._known[self.me]
        known.acked = known.latest = current
        known.pending = []

    def set_planes(self, names: Iterable[str]) -> None:
        """Make ``names`` the control planes the store lists (this one is always counted)."""
        self._listed = set(names) | {self.me}
        self._expected = 0

    def expect(self, gateways: int) -> None:
        """Count at least ``gateways`` control planes until :meth:`set_planes` names them
        (a new leader whose store does not answer yet: the others are at their fallback)."""
        self._expected = gateways

    def report(self, gateway: str, demand: Mapping[str, TenantDemand], now: float, session: object = None) -> None:
        """Take one window of ``gateway``'s demand, reported at ``now``.

        ``session`` identifies the standby's peer session: a new one means the standby
        may hold anything up to its fallback, and is sent its shares at the next tick.
        """
        known = self._known.get(gateway)
        if known is None:
            known = self._known[gateway] = _Gateway()
        if session is not None and session is not known.session:
            # A new session: the standby left the last one and shrank to at most 1/N; it has
            # grown to 1/N only if FALLBACK_AFTER_S passed since its last report.
            known.session = session
            if known.reported_at is None or now - known.reported_at >= FALLBACK_AFTER_S:
                known.acked = None
                known.pending = []
            known.latest = None
            known.force = True
            known.weights = {}
        weights = {}
        for tenant in set(known.weights) | set(demand):
            old = known.weights.get(tenant, _NO_WEIGHTS)
            new = demand_weights(demand[tenant]) if tenant in demand else _NO_WEIGHTS
            smoothed = tuple(o * DEMAND_DECAY + w for o, w in zip(old, new))
            if max(smoothed) >= DEMAND_MIN:
                weights[tenant] = smoothed
        known.weights = weights  # type: ignore[assignment]
        known.reported_at = now

    def applied(self, gateway: str, version: int) -> None:
        """Note that ``gateway`` applied the shares of ``version`` (and every earlier one)."""
        known = self._known.get(gateway)
        if known is None:
            return
        for sent_version, shares in known.pending:
            if sent_version == version:
                known.acked = shares
        known.pending = [(v, s) for v, s in known.pending if v > version]

    def live(self, now: float, attached: Iterable[str]) -> list[str]:
        """Return the gateways heard from: this one, and each standby attached now that
        reported within :data:`STALE_AFTER_S`."""
        attached = set(attached)
        return sorted(
            g for g, k in self._known.items()
            if g == self.me or (g in attached and k.reported_at is not None and now - k.reported_at <= STALE_AFTER_S)
        )

    def bound(self, gateway: str, tenant: str, live: bool = True) -> TenantShare:
        """Return the most of ``tenant``'s limits ``gateway`` may be enforcing as of the
        last :meth:`tick`: the largest of what it acknowledged and what it was sent since,
        and of its fallback where that is unknown or it is not ``live``; exactly its
        fallback once it has not been heard from for :data:`FALLBACK_AFTER_S`."""
        known = self._known.get(gateway)
        if known is None:
            fallback = fallback_share(self.gateways)
            return TenantShare(fallback, fallback, fallback)
        return TenantShare(*(self._bound(known, tenant, kind, live) for kind in range(3)))

    def _bound(self, known: _Gateway, tenant: str, kind: int, live: bool) -> float:
        fallback = fallback_share(self.gateways)
        if not live and (known.reported_at is None or self._now - known.reported_at >= FALLBACK_AFTER_S):
            return fallback  # it has fallen back (or is gone): what it was sent no longer holds
        value = fallback if known.acked is None else _kinds(known.acked.of(tenant))[kind]
        if not live:  # it may have lost its session and fallen back
            value = max(value, fallback)
        for _, shares in known.pending:
            value = max(value, _kinds(shares.of(tenant))[kind])
        return value

    def tick(self, now: float, attached: Iterable[str]) -> list[Publication]:
        """Compute the shares from the demand so far; return what to send to whom.

        ``attached``: the standbys whose stream is up now. Every publication is counted
        as sent (its shares bound the gateway until acknowledged): deliver each, in
        order per gateway, and call :meth:`applied` once it is applied.
        """
        attached = set(attached)
        self._now = now
        names = self._listed | attached | {self.me}
        for gone in [g for g in self._known if g not in names]:
            del self._known[gone]
        for name in names:
            self._known.setdefault(name, _Gateway())
        self.gateways = n = max(len(names), self._expected)
        fallback = fallback_share(n)
        unnamed = {f"\0unnamed {i}": fallback for i in range(n - len(names))}  # each at its fallback
        live = self.live(now, attached)
        live_set = set(live)
        targets = compute_shares({g: self._known[g].weights for g in live}, n)
        tenants: set[str] = set()
        for known in self._known.values():
            for table in known.tables():
                tenants.update(table.tenants)
        for g in live:
            tenants.update(targets[g])
        decided: dict[str, dict[str, list[float]]] = {g: {} for g in live}
        for tenant in sorted(tenants):
            for g in live:
                decided[g][tenant] = [fallback, fallback, fallback]
            for kind in range(3):
                latest = {g: _kinds(self._latest(g, fallback).of(tenant))[kind] for g in live}
                target = {g: _kinds(targets[g][tenant])[kind] if tenant in targets[g] else fallback for g in live}
                bounds = {g: self._bound(k, tenant, kind, g in live_set) for g, k in self._known.items()}
                bounds.update(unnamed)
                chosen = _choose(live, latest, target, bounds, fallback)
                for g in live:
                    decided[g][tenant][kind] = chosen[g]
        out = []
        for g in live:
            known = self._known[g]
            table = {t: TenantShare(*v) for t, v in decided[g].items() if any(abs(x - fallback) >= EPS for x in v)}
            shares = AdmissionShares(fallback, table)
            if known.force or known.latest != shares:
                self._versions += 1
                known.pending.append((self._versions, shares))
                known.latest = shares
                known.force = False
                out.append(Publication(g, self._versions, shares))
        return out

    def _latest(self, gateway: str, fallback: float) -> AdmissionShares:
        known = self._known[gateway]
        return known.latest if known.latest is not None else AdmissionShares(fallback)


def _choose(
    live: Sequence[str], latest: Mapping[str, float], target: Mapping[str, float], bounds: Mapping[str, float],
    fallback: float,
) -> dict[str, float]:
    """Return the share of one tenant's limit to send each live gateway: ``latest`` while no
    ``target`` moved by :data:`SHARE_STEP` (and the sum is within 1, and an idle tenant is
    back at ``fallback``); otherwise each shrink at once, and each grow only into the room
    left by every gateway's ``bounds``."""
    over = sum(bounds.values()) > 1.0 + EPS
    moved = any(abs(target[g] - latest[g]) >= SHARE_STEP for g in live)
    back = all(abs(target[g] - fallback) < EPS for g in live) and any(abs(latest[g] - fallback) >= EPS for g in live)
    if not (over or moved or back):
        return dict(latest)
    chosen = {g: min(target[g], latest[g]) for g in live}
    held = dict(bounds)
    for g in live:
        if target[g] > latest[g]:
            room = 1.0 - sum(v for h, v in held.items() if h != g)
            grown = min(target[g], _quantize(room + EPS))
            if grown > latest[g]:
                chosen[g] = grown
                held[g] = max(held[g], grown)
            else:
                chosen[g] = latest[g]
    return chosen


def clamp_shares(shares: AdmissionShares, ceiling: float) -> AdmissionShares:
    """Return ``shares`` with every fraction at most ``ceiling`` (the default included)."""
    return AdmissionShares(min(shares.default, ceiling), {
        name: TenantShare(*(min(x, ceiling) for x in _kinds(share))) for name, share in shares.tenants.items()})


class LocalShares:
    """This control plane's gateway's shares: from the leader while it has one, else the
    fallback ``1/N`` (see the module docstring).

    :meth:`led` while a leader's shares apply (this one leads, or a standby's peer session
    is up), :meth:`unled` when that ends; :meth:`contact` whenever a report reached the
    leader. :meth:`run` keeps the fallback.
    """

    def __init__(self, gateway: GatewayInterface, gateways: int = 1) -> None:
        self.gateway = gateway
        #: N as last learnt (from the store at start, then from the leader).
        self.gateways = max(1, gateways)
        #: What the gateway enforces (the last shares handed to it).
        self.current = AdmissionShares()
        self._led = False
        self._last_contact = -math.inf
        self._changed = trio.Event()
        self._reports_refused = False
        self._from_leader = 0  # leader's shares applied so far
        self._shrink_after: int | None = None  # unled when this many were: shrink unless more came

    @property
    def fallback(self) -> AdmissionShares:
        """The equal share every gateway enforces without a leader."""
        return AdmissionShares(fallback_share(self.gateways))

    async def apply(self, shares: AdmissionShares) -> None:
        """Hand ``shares`` to the gateway; returns once applied (see
        :meth:`~llmgw.router.interface.GatewayInterface.apply_admission_shares`)."""
        self.current = shares
        await self.gateway.apply_admission_shares(shares)

    async def apply_from_leader(self, shares: AdmissionShares) -> None:
        """Apply the leader's ``shares`` (their default is ``1/N``: N is learnt from it)."""
        if shares.default > 0:
            self.gateways = max(1, round(1.0 / shares.default))
        self._from_leader += 1
        await self.apply(shares)

    def led(self) -> None:
        """A leader's shares apply from now on: no fallback."""
        self._led = True
        self._reports_refused = False
        self._wake()

    def unled(self) -> None:
        """The leader is gone (or this one stopped leading): fall back (:meth:`run`; the
        shrink to ``1/N`` happens even if a new leader leads this gateway before it runs,
        unless that leader's shares came first)."""
        self._led = False
        self._shrink_after = self._from_leader
        self._wake()

    def contact(self) -> None:
        """A report reached the leader (or this one, leading, computed the shares) now."""
        self._last_contact = trio.current_time()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply the fallback ``1/N`` now (before the gateway serves: ``task_status``), and
        again whenever the leader is lost: fractions above ``1/N`` drop to it at once, the
        others rise to it :data:`FALLBACK_AFTER_S` after the last :meth:`contact`. Runs
        until cancelled."""
        if self.gateways > 1:
            await self.apply(self.fallback)
        task_status.started()
        while True:
            if self._shrink_after is not None:
                due, self._shrink_after = self._shrink_after == self._from_leader, None
                shrunk = clamp_shares(self.current, fallback_share(self.gateways))
                if due and shrunk != self.current:
                    await self.apply(shrunk)
                continue
            if self._led:
                await self._changed.wait()
                continue
            with trio.move_on_at(self._last_contact + FALLBACK_AFTER_S):
                while not self._led and self._shrink_after is None:
                    await self._changed.wait()
            if self._led or self._shrink_after is not None:
                continue
            if self.current != self.fallback:  # no await between the checks above and the apply
                log.info("no leader for %gs: this gateway enforces 1/%d of every tenant limit",
                         FALLBACK_AFTER_S, self.gateways)
                await self.apply(self.fallback)
            while not self._led and self._shrink_after is None:
                await self._changed.wait()

    async def report(self, peer: Any, timeout: float) -> None:
        """Report the gateway's demand since the last report to the leader's ``peer``
        (``ControlPeer``) within ``timeout``; :meth:`contact` once it arrived.

        Raises ``trio.TooSlowError`` or ``capnp.KjException`` as the call does, except
        from a leader too old to take reports (logged once per session; nothing sent).
        """
        if self._reports_refused:
            return
        rows = demand_rows(self.gateway.admission_demand())
        try:
            with trio.fail_after(timeout):
                await peer.reportDemand(rows)
        except capnp.KjException as exc:
            if getattr(exc, "type", None) != "UNIMPLEMENTED":
                raise
            self._reports_refused = True
            log.warning("the leader does not take demand reports (an older llmgw): tenant limits are not shared")
            return
        self.contact()


async def lead_shares(
    book: ShareBook, local: LocalShares, standbys: Callable[[], set[str]],
    send: Callable[[Publication, Callable[[], None]], None], planes: Callable[[], Awaitable[list[str]]],
    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the leader's side until cancelled (``book`` is new, for this term): every :data:`ADMISSION_SYNC_S` read the
    leader's own gateway's demand, compute the shares (``book``), apply this gateway's
    and ``send`` each standby's (with the callback to call once applied). ``standbys()``
    names the standbys attached now, ``planes()`` the control planes the store lists
    (read every :data:`PLANES_REFRESH_S`; a failure keeps the last list). ``local`` is led
    from the start until this returns or is cancelled."""
    local.led()  # no fallback from now on: what it enforces now is what the book starts from
    book.mine(local.current)
    book.expect(local.gateways)
    refreshed = -math.inf
    try:
        task_status.started()
        while True:
            now = trio.current_time()
            if now - refreshed >= PLANES_REFRESH_S:
                refreshed = now
                try:
                    book.set_planes(await planes())
                except Exception as exc:  # noqa: BLE001 - the store may be failing over; keep the last list
                    log.warning("could not read the control planes for the admission shares: %s", exc)
            book.report(book.me, local.gateway.admission_demand(), now)
            for publication in book.tick(trio.current_time(), standbys()):
                if publication.gateway == book.me:
                    await local.apply(publication.shares)
                    book.applied(book.me, publication.version)
                else:
                    send(publication, _acknowledge(book, publication))
            local.gateways = book.gateways
            local.contact()
            await trio.sleep(ADMISSION_SYNC_S)
    finally:
        local.unled()


def _acknowledge(book: ShareBook, publication: Publication) -> Callable[[], None]:
    return lambda: book.applied(publication.gateway, publication.version)


# -- wire values (schema/llmgw.capnp: TenantDemand, TenantShare) ------------------------------


def demand_rows(demand: Mapping[str, TenantDemand]) -> list[dict[str, Any]]:
    """Return ``demand`` as capnp ``TenantDemand`` dicts."""
    return [{"tenant": name, "inFlight": d.in_flight, "admitted": d.admitted, "shed": d.shed, "tokens": d.tokens}
            for name, d in sorted(demand.items())]


def demand_from(rows: Iterable[Any]) -> dict[str, TenantDemand]:
    """Return the demand of capnp ``TenantDemand`` values, by tenant."""
    return {str(r.tenant): TenantDemand(int(r.inFlight), int(r.admitted), int(r.shed), int(r.tokens)) for r in rows}


def share_rows(shares: AdmissionShares) -> list[dict[str, Any]]:
    """Return the tenants of ``shares`` as capnp ``TenantShare`` dicts."""
    return [{"tenant": name, "concurrency": s.concurrency, "rpm": s.rpm, "tpm": s.tpm}
            for name, s in sorted(shares.tenants.items())]


def shares_from(rows: Iterable[Any], default: float) -> AdmissionShares:
    """Return the :class:`AdmissionShares` of capnp ``TenantShare`` values and their default;
    fractions outside (0, 1] are clamped into it."""
    def fraction(value: float) -> float:
        return min(1.0, max(EPS, float(value)))

    return AdmissionShares(fraction(default), {
        str(r.tenant): TenantShare(fraction(r.concurrency), fraction(r.rpm), fraction(r.tpm)) for r in rows})
