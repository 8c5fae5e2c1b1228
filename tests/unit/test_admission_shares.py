"""Tenant limits shared by several gateways: the share computation, the leader's book, a
gateway's fallback, and admission enforcing a share (llmgw/control/admission_shares.py,
llmgw/router/admission.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
import trio.testing

from llmgw.control.admission_shares import (
    ADMISSION_SYNC_S, FALLBACK_AFTER_S, FLOOR_PART, SHARE_STEP, STALE_AFTER_S, LocalShares, ShareBook,
    compute_shares, demand_rows, demand_from, share_rows, shares_from,
)
from llmgw.router.admission import (
    Admission, AdmissionLimits, AdmissionShares, TenantCounters, TenantDemand, TenantShare, demand_since,
    tenant_limit,
)
from llmgw.router.auth import Tenant
from llmgw.router.errors import GatewayError

BUSY = TenantDemand(in_flight=4, admitted=10, shed=5, tokens=1000)


def kinds(share: TenantShare) -> tuple[float, float, float]:
    return (share.concurrency, share.rpm, share.tpm)


# -- compute_shares ----------------------------------------------------------------------------


def test_each_gateway_gets_a_floor_and_the_rest_by_demand() -> None:
    shares = compute_shares({"a": {"acme": (3.0, 1.0, 0.0)}, "b": {"acme": (1.0, 1.0, 0.0)}}, 2)
    floor = 1 / (FLOOR_PART * 2)
    a, b = shares["a"]["acme"], shares["b"]["acme"]
    assert a.concurrency == pytest.approx(floor + 0.75 * 3 / 4, abs=1 / 4096)
    assert b.concurrency == pytest.approx(floor + 0.75 * 1 / 4, abs=1 / 4096)
    assert a.rpm == b.rpm == 0.5  # equal demand: equal shares
    assert a.tpm == b.tpm == 0.5  # no demand anywhere: 1/N each
    for kind in range(3):
        assert kinds(a)[kind] + kinds(b)[kind] <= 1.0


def test_all_demand_on_one_gateway_leaves_the_others_their_floor() -> None:
    weights: dict[str, dict[str, tuple[float, float, float]]] = {"a": {"acme": (5.0, 5.0, 5.0)}, "b": {}, "c": {}}
    shares = compute_shares(weights, 3)
    floor = 1 / (FLOOR_PART * 3)
    assert shares["b"]["acme"] == shares["c"]["acme"]
    assert shares["b"]["acme"].concurrency == pytest.approx(floor, abs=1 / 4096)
    assert shares["a"]["acme"].concurrency == pytest.approx(1 - 2 * floor, abs=1 / 4096)
    assert sum(s["acme"].concurrency for s in shares.values()) <= 1.0


def test_gateways_not_heard_from_keep_their_equal_share_out_of_the_pool() -> None:
    # Three control planes, only "a" and "b" live: "c" may be enforcing 1/3 on its own.
    shares = compute_shares({"a": {"acme": (1.0, 0.0, 0.0)}, "b": {"acme": (0.0, 0.0, 0.0)}}, 3)
    total = shares["a"]["acme"].concurrency + shares["b"]["acme"].concurrency
    assert total <= 2 / 3
    assert shares["b"]["acme"].concurrency == pytest.approx(1 / 12, abs=1 / 4096)
    assert compute_shares({}, 3) == {}


@pytest.mark.parametrize("gateways", [1, 2, 3, 5, 7])
def test_shares_of_a_tenant_never_add_up_to_more_than_one(gateways: int) -> None:
    names = [f"g{i}" for i in range(gateways)]
    for seed in range(50):
        weights = {g: {"t": ((seed * 7 + i * 13) % 11 * 1.3, (seed + i) % 3 * 0.7, float(i == seed % gateways))}
                   for i, g in enumerate(names)}
        shares = compute_shares(weights, gateways)
        for kind in range(3):
            values = [kinds(shares[g]["t"])[kind] for g in names]
            assert sum(values) <= 1.0
            assert all(v >= 1 / (FLOOR_PART * gateways) - 1 / 4096 for v in values)
    assert compute_shares({"only": {"t": (2.0, 0.0, 1.0)}}, 1)["only"]["t"] == TenantShare(1.0, 1.0, 1.0)


# -- the leader's book -------------------------------------------------------------------------


def check_bounds(book: ShareBook, tenant: str, gateways: list[str], live: list[str]) -> None:
    """The shares the gateways may be enforcing add up to at most 1 for each limit."""
    for kind in range(3):
        total = sum(kinds(book.bound(g, tenant, g in live))[kind] for g in gateways)
        assert total <= 1.0 + 1e-9, (kind, total)


def deliver(book: ShareBook, publications: Any, enforced: dict[str, AdmissionShares]) -> None:
    for p in publications:
        enforced[p.gateway] = p.shares
        book.applied(p.gateway, p.version)


def test_the_book_shrinks_before_it_grows_and_converges_to_the_demand() -> None:
    book = ShareBook("cp-1", AdmissionShares(0.5))
    book.set_planes(["cp-1", "cp-2"])
    enforced = {"cp-1": AdmissionShares(0.5), "cp-2": AdmissionShares(0.5)}
    session = object()
    now = 0.0
    # Nothing heard from cp-2 yet: it is counted at 1/2, and cp-1 keeps 1/2 (no chatter).
    book.report("cp-1", {}, now)
    assert book.tick(now, {"cp-2"}) == []
    # All of acme's traffic goes through cp-2.
    book.report("cp-2", {"acme": BUSY}, now, session=session)
    book.report("cp-1", {}, now)
    first = book.tick(now, {"cp-2"})
    assert {p.gateway for p in first} == {"cp-1", "cp-2"}  # cp-2: a new session gets its table
    by_name = {p.gateway: p.shares for p in first}
    assert by_name["cp-1"].of("acme").concurrency == pytest.approx(1 / 8)  # the shrink goes out at once
    assert by_name["cp-2"].of("acme").concurrency == 0.5  # the grow waits for it to be applied
    check_bounds(book, "acme", ["cp-1", "cp-2"], ["cp-1", "cp-2"])
    deliver(book, first, enforced)
    for _ in range(3):
        now += ADMISSION_SYNC_S
        book.report("cp-2", {"acme": BUSY}, now, session=session)
        book.report("cp-1", {}, now)
        deliver(book, book.tick(now, {"cp-2"}), enforced)
        check_bounds(book, "acme", ["cp-1", "cp-2"], ["cp-1", "cp-2"])
    assert enforced["cp-2"].of("acme").concurrency == pytest.approx(7 / 8)
    assert enforced["cp-1"].of("acme").concurrency == pytest.approx(1 / 8)
    assert enforced["cp-2"].of("other") == TenantShare(0.5, 0.5, 0.5)  # every other tenant: 1/N
    # Steady demand: nothing more is sent.
    now += ADMISSION_SYNC_S
    book.report("cp-2", {"acme": BUSY}, now, session=session)
    assert book.tick(now, {"cp-2"}) == []


def test_an_unacknowledged_shrink_blocks_the_grow_it_pays_for() -> None:
    book = ShareBook("cp-1", AdmissionShares(0.5))
    book.set_planes(["cp-1", "cp-2"])
    session = object()
    book.report("cp-2", {}, 0.0, session=session)
    book.report("cp-1", {"acme": BUSY}, 0.0)
    sent = {p.gateway: p.shares for p in book.tick(0.0, {"cp-2"})}
    assert sent["cp-2"].of("acme").concurrency == pytest.approx(1 / 8)
    # cp-1 (the leader) wants 7/8 but cp-2 has not applied its shrink to 1/8 yet.
    for step in range(1, 4):
        book.report("cp-2", {}, step, session=session)
        book.report("cp-1", {"acme": BUSY}, step)
        for p in book.tick(step, {"cp-2"}):
            if p.gateway == "cp-1":
                book.applied("cp-1", p.version)
        check_bounds(book, "acme", ["cp-1", "cp-2"], ["cp-1", "cp-2"])
        assert book.bound("cp-1", "acme").concurrency <= 0.5


def test_a_silent_standby_is_counted_at_its_fallback_then_its_share_is_reused() -> None:
    book = ShareBook("cp-1", AdmissionShares(0.5))
    book.set_planes(["cp-1", "cp-2"])
    enforced: dict[str, AdmissionShares] = {}
    session = object()
    now = 0.0
    for _ in range(4):  # cp-2 converges to 7/8 of acme
        book.report("cp-2", {"acme": BUSY}, now, session=session)
        book.report("cp-1", {}, now)
        deliver(book, book.tick(now, {"cp-2"}), enforced)
        now += ADMISSION_SYNC_S
    assert enforced["cp-2"].of("acme").concurrency == pytest.approx(7 / 8)
    last_report = now - ADMISSION_SYNC_S
    # cp-2 goes silent (dead or cut off); acme's traffic moves to cp-1.
    while now - last_report <= FALLBACK_AFTER_S + ADMISSION_SYNC_S:
        book.report("cp-1", {"acme": BUSY}, now)
        deliver(book, [p for p in book.tick(now, {"cp-2"}) if p.gateway == "cp-1"], enforced)  # cp-2 is cut off
        live = ["cp-1", "cp-2"] if now - last_report <= STALE_AFTER_S else ["cp-1"]
        check_bounds(book, "acme", ["cp-1", "cp-2"], live)
        if now - last_report < FALLBACK_AFTER_S:  # it may still hold 7/8 until it must have fallen back
            assert enforced["cp-1"].of("acme").concurrency <= 1 / 8 + 1e-9
        now += ADMISSION_SYNC_S
    # Past the fallback delay cp-2 holds 1/2 at most: cp-1 gets the other half.
    assert enforced["cp-1"].of("acme").concurrency == pytest.approx(0.5)
    # cp-2 is removed from the store: cp-1 alone has all of it.
    book.set_planes(["cp-1"])
    book.report("cp-1", {"acme": BUSY}, now)
    deliver(book, book.tick(now, set()), enforced)
    assert book.gateways == 1
    assert enforced["cp-1"].of("acme") == TenantShare(1.0, 1.0, 1.0)


def test_an_idle_tenant_goes_back_to_the_default_and_leaves_the_table() -> None:
    book = ShareBook("cp-1", AdmissionShares(0.5))
    book.set_planes(["cp-1", "cp-2"])
    enforced: dict[str, AdmissionShares] = {}
    session = object()
    now = 0.0
    for _ in range(4):
        book.report("cp-2", {"acme": BUSY}, now, session=session)
        book.report("cp-1", {}, now)
        deliver(book, book.tick(now, {"cp-2"}), enforced)
        now += ADMISSION_SYNC_S
    assert "acme" in enforced["cp-2"].tenants
    for _ in range(30):  # no demand any more: it decays away
        book.report("cp-2", {}, now, session=session)
        book.report("cp-1", {}, now)
        deliver(book, book.tick(now, {"cp-2"}), enforced)
        check_bounds(book, "acme", ["cp-1", "cp-2"], ["cp-1", "cp-2"])
        now += ADMISSION_SYNC_S
    assert enforced["cp-1"] == enforced["cp-2"] == AdmissionShares(0.5)


def test_a_small_change_of_demand_is_not_sent() -> None:
    book = ShareBook("cp-1", AdmissionShares(0.5))
    book.set_planes(["cp-1", "cp-2"])
    session = object()
    enforced: dict[str, AdmissionShares] = {}
    now = 0.0
    for i in range(12):
        # 10 vs 11 requests a second, alternating: the shares move by less than SHARE_STEP.
        a, b = (10, 11) if i % 2 else (11, 10)
        book.report("cp-2", {"acme": TenantDemand(admitted=a)}, now, session=session)
        book.report("cp-1", {"acme": TenantDemand(admitted=b)}, now)
        published = book.tick(now, {"cp-2"})
        deliver(book, published, enforced)
        if i >= 2:
            assert published == [], i
        now += ADMISSION_SYNC_S
    assert SHARE_STEP > 0


@pytest.mark.parametrize("away", [2.0, FALLBACK_AFTER_S])
def test_a_reconnected_standby_is_counted_at_what_it_may_hold_until_it_applies_again(away: float) -> None:
    book = ShareBook("cp-1", AdmissionShares(0.5))
    book.set_planes(["cp-1", "cp-2"])
    enforced: dict[str, AdmissionShares] = {}
    first, second = object(), object()
    for now in range(4):
        book.report("cp-2", {}, now, session=first)
        book.report("cp-1", {"acme": BUSY}, now)
        deliver(book, book.tick(now, {"cp-2"}), enforced)
    assert enforced["cp-2"].of("acme").concurrency == pytest.approx(1 / 8)
    assert enforced["cp-1"].of("acme").concurrency == pytest.approx(7 / 8)
    # It left the session: at most what it had, or 1/2 once it has been away long enough to fall back.
    now = 3
    while now < 3 + away:
        now += 1
        book.report("cp-1", {"acme": BUSY}, now)
        deliver(book, book.tick(now, set()), enforced)  # cp-2 is not attached
        check_bounds(book, "acme", ["cp-1", "cp-2"], ["cp-1"])
    book.report("cp-2", {}, now, session=second)
    held = 0.5 if away >= FALLBACK_AFTER_S else 1 / 8
    assert book.bound("cp-2", "acme").concurrency == pytest.approx(held)
    if away >= FALLBACK_AFTER_S:  # cp-1 was shrunk to make room for cp-2's fallback
        assert enforced["cp-1"].of("acme").concurrency <= 0.5
    published = book.tick(now, {"cp-2"})
    assert "cp-2" in [p.gateway for p in published]  # its table again, whatever it holds now
    deliver(book, published, enforced)
    for now in range(now + 1, now + 4):
        book.report("cp-2", {}, now, session=second)
        book.report("cp-1", {"acme": BUSY}, now)
        deliver(book, book.tick(now, {"cp-2"}), enforced)
        check_bounds(book, "acme", ["cp-1", "cp-2"], ["cp-1", "cp-2"])
    assert enforced["cp-1"].of("acme").concurrency == pytest.approx(7 / 8)


# -- a gateway's own shares: the fallback without a leader ------------------------------------


class SharesGateway:
    """Just what LocalShares uses of a gateway."""

    def __init__(self) -> None:
        self.applied: list[AdmissionShares] = []
        self.demand: dict[str, TenantDemand] = {}

    async def apply_admission_shares(self, shares: AdmissionShares) -> None:
        self.applied.append(shares)

    def admission_demand(self) -> dict[str, TenantDemand]:
        demand, self.demand = self.demand, {}
        return demand


async def test_without_a_leader_large_shares_drop_at_once_small_ones_rise_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gateway = SharesGateway()
    local = LocalShares(gateway, 2)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(local.run)
        assert gateway.applied == [AdmissionShares(0.5)]  # before serving: 1/N
        local.led()
        local.contact()
        mixed = AdmissionShares(0.5, {"big": TenantShare(0.875, 0.875, 0.5), "small": TenantShare(0.125, 0.5, 0.5)})
        await local.apply_from_leader(mixed)
        lost = trio.current_time()
        local.unled()
        await trio.testing.wait_all_tasks_blocked()
        assert local.current == AdmissionShares(0.5, {"big": TenantShare(0.5, 0.5, 0.5),
                                                      "small": TenantShare(0.125, 0.5, 0.5)})
        while local.current != AdmissionShares(0.5):
            await trio.sleep(1)
        assert trio.current_time() - lost >= FALLBACK_AFTER_S
        # A leader again before the delay is over: no fallback.
        local.led()
        local.contact()
        await local.apply_from_leader(mixed)
        local.unled()
        await trio.sleep(1)
        local.led()
        await trio.sleep(FALLBACK_AFTER_S * 2)
        assert local.current.of("small").concurrency == 0.125
        nursery.cancel_scope.cancel()


async def test_shares_that_arrive_right_after_a_new_leader_are_not_cut_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gateway = SharesGateway()
    local = LocalShares(gateway, 2)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(local.run)
        local.led()
        local.unled()  # the session ended, and a new one came up before the shrink ran
        local.led()
        grown = AdmissionShares(0.5, {"acme": TenantShare(0.875, 0.875, 0.875)})
        await local.apply_from_leader(grown)
        await trio.testing.wait_all_tasks_blocked()
        assert local.current == grown
        nursery.cancel_scope.cancel()


class FakePeer:
    def __init__(self) -> None:
        self.rows: list[Any] = []

    async def reportDemand(self, rows: Any) -> None:  # noqa: N802 - the capnp method's name
        self.rows.append(rows)


async def test_a_report_carries_the_demand_and_counts_as_contact(autojump_clock: trio.testing.MockClock) -> None:
    gateway = SharesGateway()
    gateway.demand = {"acme": BUSY}
    local = LocalShares(gateway, 2)  # type: ignore[arg-type]
    peer = FakePeer()
    await local.report(peer, 3.0)
    assert peer.rows == [[{"tenant": "acme", "inFlight": 4, "admitted": 10, "shed": 5, "tokens": 1000}]]
    assert local._last_contact == trio.current_time()


def test_wire_values_round_trip() -> None:
    class Row:
        def __init__(self, **fields: Any) -> None:
            self.__dict__.update(fields)

    demand = {"acme": BUSY, "b": TenantDemand(1, 2, 3, 4)}
    assert demand_from(Row(**r) for r in demand_rows(demand)) == demand
    shares = AdmissionShares(1 / 3, {"acme": TenantShare(0.875, 0.125, 1 / 3)})
    assert shares_from((Row(**r) for r in share_rows(shares)), 1 / 3) == shares
    assert shares_from([Row(tenant="x", concurrency=2.0, rpm=-1.0, tpm=0.5)], 0.0).of("x").concurrency == 1.0


# -- admission enforcing a share ---------------------------------------------------------------


def test_tenant_limit_rounds_up_and_keeps_unlimited() -> None:
    assert tenant_limit(0, 0.5) == 0
    assert tenant_limit(4, 0.5) == 2
    assert tenant_limit(4, 0.1 + 0.2 + 0.2) == 2  # float noise above 0.5 does not give a third
    assert tenant_limit(4, 7 / 8) == 4
    assert tenant_limit(4, 1 / 8) == 1
    assert tenant_limit(1, 1 / 1000) == 1  # every gateway can admit one
    assert tenant_limit(100, 0.5, 3) == 17  # ceil(ceil(50) / 3)
    assert tenant_limit(100, 1.0, 1) == 100


@pytest.mark.parametrize("limit", [1, 4, 7, 100, 999])
@pytest.mark.parametrize("gateways, workers", [(2, 1), (3, 2), (2, 4)])
def test_the_parts_add_up_to_the_limit_plus_rounding(limit: int, gateways: int, workers: int) -> None:
    for split in range(1, 20):
        fractions = [split / 20] + [(1 - split / 20) / (gateways - 1)] * (gateways - 1)
        total = sum(workers * tenant_limit(limit, f, workers) for f in fractions)
        assert total <= limit + gateways * workers - 1


async def test_admission_enforces_its_share_of_the_concurrency_limit() -> None:
    admission = Admission(AdmissionLimits(max_inflight_per_replica=100))
    acme = Tenant("acme", max_concurrency=4)
    admission.set_shares(AdmissionShares(0.5))
    tickets = [await admission.admit(acme, "m", 1, lambda: 1) for _ in range(2)]
    with pytest.raises(GatewayError) as refused:
        await admission.admit(acme, "m", 1, lambda: 1)
    assert refused.value.code == "concurrency_limit_exceeded"
    assert "this gateway's share of its concurrency limit of 4" in refused.value.message
    admission.set_shares(AdmissionShares(0.5, {"acme": TenantShare(7 / 8, 1.0, 1.0)}))
    tickets += [await admission.admit(acme, "m", 1, lambda: 1) for _ in range(2)]
    assert admission.tenant_limits(acme) == (4, 0, 0)
    with pytest.raises(GatewayError):
        await admission.admit(acme, "m", 1, lambda: 1)
    for ticket in tickets:
        ticket.release()


async def test_a_worker_enforces_its_part_of_the_share(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission(AdmissionLimits(tenant_parts=2))
    acme = Tenant("acme", rpm=60, tpm=1000)
    assert admission.tenant_limits(acme) == (0, 30, 500)
    admission.set_shares(AdmissionShares(0.5))
    assert admission.tenant_limits(acme) == (0, 15, 250)
    for _ in range(15):
        (await admission.admit(acme, "m", 1, lambda: 10)).release()
    with pytest.raises(GatewayError) as refused:
        await admission.admit(acme, "m", 1, lambda: 10)
    assert refused.value.code == "rate_limit_exceeded"
    counters = admission.snapshot()["acme"]
    assert (counters.admitted, counters.shed, counters.tokens) == (15, 1, 150)


def test_demand_since_leaves_out_tenants_with_none() -> None:
    before = {"a": TenantCounters(admitted=5, shed=1, tokens=10), "b": TenantCounters(admitted=2)}
    now = {"a": TenantCounters(admitted=8, shed=1, in_flight=2, tokens=40), "b": TenantCounters(admitted=2),
           "c": TenantCounters(shed=1)}
    assert demand_since(before, now) == {"a": TenantDemand(2, 3, 0, 30), "c": TenantDemand(0, 0, 1, 0)}
    assert math.isclose(1 / (FLOOR_PART * 2), 0.125)


def test_a_leader_that_cannot_read_the_store_yet_counts_the_control_planes_it_knew() -> None:
    book = ShareBook("cp-1", AdmissionShares(1 / 3))
    book.expect(3)  # the store did not answer: two others, unnamed, at 1/3 each
    book.report("cp-1", {"acme": BUSY}, 0.0)
    assert book.tick(0.0, set()) == []  # no room to grow into
    assert book.gateways == 3
    book.set_planes(["cp-1"])  # the others were removed
    book.report("cp-1", {"acme": BUSY}, 1.0)
    [mine] = book.tick(1.0, set())
    assert mine.shares.of("acme") == TenantShare(1.0, 1.0, 1.0)
