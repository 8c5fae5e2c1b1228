"""Per-model queues through the real gateway: FIFO hand-over, a full queue shed, the deadline.

Time is trio's MockClock running at real speed and jumped by hand past the deadline
(never autojump: real sockets are in play), by less than any socket timeout involved.
"""

from __future__ import annotations

import httpx
import trio
import trio.testing

from llmgw.router.admission import AdmissionLimits
from tests.component.test_gateway_auth import DEADLINE_S, MODEL, assert_error, chat_body, gateway

#: Seconds a request may wait in the queue in these tests: shorter than Hypercorn's
#: keep-alive (5 s) and the clients' timeouts, so jumping past it fires nothing else.
QUEUE_TIMEOUT_S = 2.0
LIMITS = AdmissionLimits(max_inflight_per_replica=1, queue_size=1, queue_timeout=QUEUE_TIMEOUT_S)


async def test_a_queued_request_runs_when_a_slot_frees_and_a_full_queue_sheds() -> None:
    async with gateway(limits=LIMITS) as env:
        acme = env.headers("acme")
        admission = env.gateway.admission
        hold = trio.Event()
        env.upstream.hold = hold
        served: list[str] = []

        async def request(tag: str) -> None:
            response = await env.client.post("/v1/chat/completions", json=chat_body(), headers=acme)
            assert response.status_code == 200, response.text
            served.append(tag)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request, "first")
            with trio.fail_after(DEADLINE_S):
                await env.load.wait_until(lambda load: load.total() == 1)
            nursery.start_soon(request, "queued")
            with trio.fail_after(DEADLINE_S):
                while admission.queue_depth(MODEL) != 1:
                    await trio.sleep(0.01)  # polling admission state, not timing
            assert len(env.upstream.requests) == 1  # the queued one has not reached the engine

            full = await env.client.post("/v1/chat/completions", json=chat_body(), headers=acme)
            assert_error(full, 429, "queue_full")
            hold.set()
        assert served == ["first", "queued"]
        counters = admission.snapshot()["acme"]
        assert (counters.admitted, counters.queued, counters.shed) == (2, 1, 1)
        await env.wait_idle()


async def test_a_queued_request_gets_503_at_its_deadline(mock_clock: trio.testing.MockClock) -> None:
    mock_clock.rate = 1.0  # time flows (sockets, polling) and the test jumps it past the deadline
    async with gateway(limits=LIMITS) as env:
        acme = env.headers("acme")
        admission = env.gateway.admission
        hold = trio.Event()
        env.upstream.hold = hold
        results: dict[str, httpx.Response] = {}

        async def request(tag: str) -> None:
            results[tag] = await env.client.post("/v1/chat/completions", json=chat_body(), headers=acme)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request, "held")
            with trio.fail_after(DEADLINE_S):
                await env.load.wait_until(lambda load: load.total() == 1)
            nursery.start_soon(request, "late")
            with trio.fail_after(DEADLINE_S):
                while admission.queue_depth(MODEL) != 1:
                    await trio.sleep(0.01)
            mock_clock.jump(QUEUE_TIMEOUT_S + 0.5)
            with trio.fail_after(DEADLINE_S):
                while "late" not in results:
                    await trio.sleep(0.01)
            assert "held" not in results
            hold.set()
        assert_error(results["late"], 503, "queue_timeout")
        assert results["held"].status_code == 200
        assert admission.queue_depth(MODEL) == 0
        assert admission.snapshot()["acme"].shed == 1
        assert len(env.upstream.requests) == 1
        await env.wait_idle()
