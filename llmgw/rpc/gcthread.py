"""Cyclic garbage collected on the capnp runtime's thread only.

CPython runs a cyclic collection in whichever thread happens to allocate when a
generation's threshold is crossed, ``trio.to_thread`` workers included. A capnp
object (a capability, a promise, a call context) held in a reference cycle (an
exception's traceback is the usual one) is then released in that thread, where no
KJ event loop runs, and the process aborts: ``kj/async.c++:170: ... No event loop is
running on this thread`` (seen in the agent: the collector ran in the worker thread
starting an engine's subprocess, after a start had failed for want of disk space).

:func:`collecting_on_this_thread` turns the automatic collector off while the capnp
runtime runs and collects from a trio task of its own instead: every
:data:`GC_TICK_S` it runs the collection CPython would have run, by the same
thresholds (``gc.get_threshold()``, as :mod:`llmgw.gctune` may have set them) and
generation counts, at most one per tick. Objects are only ever finalized by that task
or by reference counting wherever the last reference goes, as before.
"""

from __future__ import annotations

import gc
import threading

import trio

#: Seconds between two checks of the collector's counts. Garbage waits at most this much
#: longer than CPython would let it; 10 checks a second cost nothing measurable.
GC_TICK_S = 0.1

_lock = threading.Lock()
_owners = 0  # runtimes collecting now; the automatic collector is off while any does
_was_enabled = True  # the collector's state before the first of them


def collect_due() -> int | None:
    """Run the collection CPython's thresholds call for now, the oldest generation due
    first; return its generation, or None when none is due."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    for generation in (2, 1, 0):
        limit = thresholds[generation]
        if limit and counts[generation] > limit:
            gc.collect(generation)
            return generation
    return None


async def collecting_on_this_thread(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Turn the automatic collector off and run its collections from this task until
    cancelled; then turn it back on (once no other runtime collects, and if it was on).

    Reports started once the automatic collector is off.
    """
    global _owners, _was_enabled
    with _lock:
        if _owners == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _owners += 1
    try:
        task_status.started()
        while True:
            await trio.sleep(GC_TICK_S)
            if _was_enabled:  # a process that turned collection off keeps it off
                collect_due()
    finally:
        with _lock:
            _owners -= 1
            if _owners == 0 and _was_enabled:
                gc.enable()
