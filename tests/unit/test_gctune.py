"""llmgw.gctune: the server's garbage-collector settings (in a child process: they are process-wide)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import gc, weakref
    from llmgw.gctune import GEN0_THRESHOLD, tune_for_serving

    class Node:
        pass

    before = gc.get_threshold()
    tune_for_serving()
    assert gc.get_freeze_count() > 1000, gc.get_freeze_count()  # the imported modules and the like
    assert gc.get_threshold() == (GEN0_THRESHOLD, before[1], before[2]), gc.get_threshold()
    # A reference cycle made after the tuning is still garbage the collector finds.
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
    print("ok")
""")


def test_freezes_what_is_alive_raises_the_young_threshold_and_still_collects_cycles() -> None:
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
