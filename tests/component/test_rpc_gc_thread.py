"""Cyclic garbage holding capnp objects is collected on the capnp runtime's thread only
(llmgw.rpc.gcthread), even when a trio worker thread is the one that allocates.

In a child process: the collector's settings are process-wide, and without the guarantee
a capnp object released in a worker thread aborts the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import gc, sys, threading
    import trio
    sys.path.insert(0, sys.argv[1])
    from rpc_echo import EchoImpl, load_schema
    from llmgw.rpc import gcthread, kjtrio

    CYCLES = 300
    gc.set_threshold(100, 10, 10)  # a few hundred cycles cross it
    threads = []

    class Sentinel:
        def __del__(self):
            threads.append(threading.current_thread() is threading.main_thread())
            if len(threads) == CYCLES:
                token.run_sync_soon(all_gone.set)

    async def main():
        global token, all_gone
        token, all_gone = trio.lowlevel.current_trio_token(), trio.Event()
        schema = load_schema()
        async with kjtrio.capnp_runtime():
            assert not gc.isenabled()
            cap = schema.Echo._new_client(EchoImpl(schema))
            assert (await cap.echo("hi")).text == "HI"
            for i in range(CYCLES):
                cycle = [Sentinel(), cap if i == 0 else None]
                cycle.append(cycle)
            del cap, cycle
            # A worker thread allocates past the young generation's threshold, as the
            # agent's thread starting an engine subprocess did.
            await trio.to_thread.run_sync(lambda: len([[] for _ in range(50 * gc.get_threshold()[0])]))
            with trio.fail_after(30):
                await all_gone.wait()
        assert gc.isenabled()
        print("on the runtime's thread:", all(threads), len(threads))

    trio.run(main)
""")


def test_cycles_are_collected_on_the_runtime_thread_not_in_worker_threads() -> None:
    tests = Path(__file__).resolve().parent
    result = subprocess.run([sys.executable, "-c", CHILD, str(tests)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "on the runtime's thread: True 300"
