"""llmgw.router.http.drain: the relayed streams' read deadlines kept by one task, and the cut."""

from __future__ import annotations

import math

import trio
import trio.testing

from llmgw.router.http.drain import CUT, DEADLINE, StreamCuts

DEADLINE_S = 10


async def test_a_read_past_its_deadline_is_aborted_and_one_not_reading_is_left_alone() -> None:
    cuts = StreamCuts()
    assert not cuts.watching
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(cuts.watch)
            assert cuts.watching
            aborted = trio.Event()
            late = cuts.open(aborted.set)
            idle = cuts.open(lambda: None)
            idle.deadline = math.inf  # between reads: sending a chunk to a slow client
            late.deadline = trio.current_time()
            await aborted.wait()
            assert (late.ended, idle.ended) == (DEADLINE, None)
            cuts.close(late)
            # The cut ends every open stream, and aborts each only once.
            scope = trio.CancelScope()
            cuts.reading.add(scope)  # a read without the watch task: its own scope
            assert cuts.cut_all() == 2
            assert cuts.cut and idle.ended == CUT and scope.cancel_called
            cuts.stop_watching()
    assert not cuts.watching


async def test_a_deadline_fires_once_the_watch_is_idle_and_a_stream_opens_again() -> None:
    cuts = StreamCuts()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(cuts.watch)
            for _ in range(2):  # the watch sleeps while nothing is open, wakes for the next stream
                aborted = trio.Event()
                read = cuts.open(aborted.set)
                read.deadline = trio.current_time()
                await aborted.wait()
                cuts.close(read)
                await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    assert not cuts.watching
