"""Python's garbage collector tuned for a long-running server process.

CPython runs a young-generation collection every 700 net allocations of container
objects, and now and then a full one over every object alive, the imported modules,
configuration and caches included. A gateway allocates a few hundred such objects per
request (coroutines, cancel scopes, dicts) and frees nearly all of them by reference
counting at once, so those collections find little garbage, yet under load they took 15%
of the gateway's CPU, a full collection (40-55 ms here) stalling every request in
flight (bench/README.md has the figures).

:func:`tune_for_serving` freezes what is alive once the process is set up (it is never
garbage, and is then never scanned again) and collects the young generation every
:data:`GEN0_THRESHOLD` net allocations. Reference cycles are still collected, later.
"""

from __future__ import annotations

import gc

#: Net container allocations between two young-generation collections (CPython: 700). A
#: request leaves few objects behind, so this is a collection every few thousand requests
#: at most; the objects waiting for it are a few MB.
GEN0_THRESHOLD = 50_000


def tune_for_serving() -> None:
    """Collect once, freeze every object alive now into the permanent generation, and set
    the young-generation threshold to :data:`GEN0_THRESHOLD` (the older generations keep
    CPython's ratios). Call once the process has imported and set up what it serves with,
    before it serves: objects created later are collected as usual. Process-wide; calling
    it again freezes what was created since."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
