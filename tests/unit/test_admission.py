"""Admission logic without sockets: tenant budgets, per-model slots and queues, under MockClock."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from llmgw.router.admission import Admission, AdmissionLimits, estimate_tokens
from llmgw.router.auth import Tenant
from llmgw.router.errors import GatewayError

M = "m"


class RecordingMetrics:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def admitted(self, tenant: str, model: str) -> None:
        self.calls.append(("admitted", tenant, model))

    def queued(self, tenant: str, model: str, delta: int) -> None:
        self.calls.append(("queued", tenant, model, delta))

    def shed(self, tenant: str, model: str, reason: str) -> None:
        self.calls.append(("shed", tenant, model, reason))


def one() -> int:
    return 1


async def shed(admission: Admission, tenant: Tenant, estimate=one, replicas: int = 1) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        await admission.admit(tenant, M, replicas, estimate)
    return caught.value


async def test_rpm_budget_refills_over_time(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission()
    tenant = Tenant("t", rpm=3)
    for _ in range(3):
        (await admission.admit(tenant, M, 1, one)).release()
    error = await shed(admission, tenant)
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    assert error.headers["Retry-After"] == "20"  # 3/min: one request every 20 s
    await trio.sleep(19)
    assert (await shed(admission, tenant)).headers["Retry-After"] == "1"
    await trio.sleep(1)
    (await admission.admit(tenant, M, 1, one)).release()
    await shed(admission, tenant)
    # A new limit applies at once (the tenant object comes with each request).
    await trio.sleep(20)
    (await admission.admit(Tenant("t", rpm=600), M, 1, one)).release()


async def test_tpm_is_charged_the_estimate_and_corrected_by_usage(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission()
    tenant = Tenant("t", tpm=1000)
    ticket = await admission.admit(tenant, M, 1, lambda: 600)
    error = await shed(admission, tenant, lambda: 600)
    assert error.code == "tokens_limit_exceeded" and error.headers["Retry-After"] == "12"  # 200 short at 1000/min
    ticket.settle(100)  # it really used 100: 500 come back
    ticket.release()
    ticket = await admission.admit(tenant, M, 1, lambda: 600)
    ticket.settle(600)
    ticket.release()
    # An estimate above the whole budget is clamped to it, so it can pass once the budget is full.
    await trio.sleep(60)
    (await admission.admit(tenant, M, 1, lambda: 10**9)).release()


async def test_concurrency_limit_counts_in_flight_and_queued() -> None:
    metrics = RecordingMetrics()
    admission = Admission(AdmissionLimits(max_inflight_per_replica=1, queue_size=5), metrics=metrics)
    tenant = Tenant("t", max_concurrency=2)
    first = await admission.admit(tenant, M, 1, one)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(admission.admit, tenant, M, 1, one)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.queue_depth(M) == 1
        error = await shed(admission, tenant)
        assert error.code == "concurrency_limit_exceeded" and error.headers["Retry-After"] == "1"
        first.release()
        first.release()  # idempotent
    assert admission.snapshot()["t"].in_flight == 1
    assert admission.in_flight(M) == 1
    assert ("shed", "t", M, "concurrency") in metrics.calls
    assert metrics.calls.count(("admitted", "t", M)) == 2
    assert ("queued", "t", M, 1) in metrics.calls and ("queued", "t", M, -1) in metrics.calls


async def test_queue_is_fifo_and_capacity_follows_replicas() -> None:
    admission = Admission(AdmissionLimits(max_inflight_per_replica=2, queue_size=10))
    tenant = Tenant("t")
    held = [await admission.admit(tenant, M, 1, one) for _ in range(2)]
    order: list[int] = []

    async def waiter(i: int) -> None:
        ticket = await admission.admit(tenant, M, 1, one)
        order.append(i)
        ticket.release()

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(waiter, i)
            await trio.testing.wait_all_tasks_blocked()
        assert admission.queue_depth(M) == 3 and order == []
        held[0].release()
        await trio.testing.wait_all_tasks_blocked()
        assert order == [0, 1, 2]  # each hands its slot on when it finishes
        held[1].release()
    assert admission.in_flight(M) == 0
    # Two ready replicas double the slots.
    both = [await admission.admit(tenant, M, 2, one) for _ in range(4)]
    assert admission.in_flight(M) == 4 and admission.queue_depth(M) == 0
    for ticket in both:
        ticket.release()


async def test_cancelled_waiter_leaves_the_queue_and_deadline_is_503(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission(AdmissionLimits(max_inflight_per_replica=1, queue_size=1, queue_timeout=30))
    tenant = Tenant("t")
    held = await admission.admit(tenant, M, 1, one)
    with trio.move_on_after(5):
        await admission.admit(tenant, M, 1, one)
    assert admission.queue_depth(M) == 0 and admission.snapshot()["t"].in_flight == 1
    start = trio.current_time()
    error = await shed(admission, tenant)
    assert trio.current_time() - start == pytest.approx(30)
    assert error.status == 503 and error.code == "queue_timeout" and int(error.headers["Retry-After"]) >= 1
    held.release()
    assert admission.in_flight(M) == 0
    counters = admission.snapshot()["t"]
    assert (counters.admitted, counters.queued, counters.shed, counters.in_flight) == (1, 2, 1, 0)


async def test_slot_handed_to_a_waiter_cancelled_at_that_moment_is_passed_on() -> None:
    admission = Admission(AdmissionLimits(max_inflight_per_replica=1, queue_size=5))
    tenant = Tenant("t")
    held = await admission.admit(tenant, M, 1, one)
    got: list[str] = []

    async def second(scope: trio.CancelScope) -> None:
        with scope:
            (await admission.admit(tenant, M, 1, one)).release()
            got.append("second")

    async def third() -> None:
        (await admission.admit(tenant, M, 1, one)).release()
        got.append("third")

    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(second, scope)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(third)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()  # `second` is cancelled, and before it runs...
        held.release()  # ...it is handed the slot, which it must pass on to `third`
    assert got == ["third"]
    assert admission.in_flight(M) == 0 and admission.queue_depth(M) == 0


def test_estimate_tokens() -> None:
    chat = {"messages": [{"role": "user", "content": "x" * 400}, {"content": [{"type": "text", "text": "y" * 40}]}],
            "max_tokens": 50}
    assert estimate_tokens(chat) == 110 + 1 + 50
    assert estimate_tokens({"prompt": "abcd" * 10}) == 10 + 1 + 256
    assert estimate_tokens({"input": ["abcd", "efgh"]}) == 2 + 1
    assert estimate_tokens({"prompt": "a", "max_tokens": True}) == 1 + 256
    assert estimate_tokens(None) == 256
