"""SIGTERM and SIGINT for the long-running commands: the first drains, a second exits at once.

A service manager stops a daemon with SIGTERM (``systemctl stop``/``restart``), a terminal
with SIGINT (Ctrl-C). Both mean the same: stop accepting work, finish what is in flight
within its bounds (the gateway's ``gateway.shutdown_grace``, the last usage flush, `up`
stopping its engines), close sessions, exit 0. The signals are received by trio
(:func:`trio.open_signal_receiver`) for the whole run, so SIGINT never arrives as a
``KeyboardInterrupt`` raised wherever the program happens to be (inside a Cap'n Proto
callback it would become an RPC error sent to the peer, and the process would keep
running).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Awaitable, Callable

import click
import trio

from llmgw.cli.common import run_trio
from llmgw.trioutil import unwrap_single_group

#: The signals that stop a daemon gracefully.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Exit status when a second signal cut the drain short (the first one ends in status 0).
FORCED_EXIT_STATUS = 1


def run_daemon(
    main: Callable[[], Awaitable[Any]], name: str, *, on_stop: Callable[[], object] | None = None
) -> None:
    """Run ``main`` under trio until it returns or a stop signal drains it (then return).

    As :func:`until_stop_signal`; errors of ``main`` propagate as
    :func:`~llmgw.cli.common.run_trio` lets them.
    """
    run_trio(lambda: until_stop_signal(main, name, on_stop=on_stop))


async def until_stop_signal(
    main: Callable[[], Awaitable[Any]], name: str, *, on_stop: Callable[[], object] | None = None
) -> None:
    """Run ``main`` until it returns, or until SIGTERM or SIGINT stops it.

    The first signal cancels ``main`` as a whole, or, given ``on_stop``, calls that
    instead (``main`` then ends itself, in the order it needs: `up` must keep its agent
    running until its engines are stopped). What ``main`` shields from cancellation (its
    graceful shutdown steps, each bounded) still runs, and this returns once ``main`` has
    unwound, normally. A second signal while that runs exits the process at once with
    :data:`FORCED_EXIT_STATUS` (no traceback; shielded steps are abandoned). ``name``
    prefixes the lines printed when a signal arrives. Errors of ``main`` propagate (a
    lone one unwrapped from its exception group).
    """
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals, unwrap_single_group():
        async with trio.open_nursery() as nursery:
            main_scope = trio.CancelScope()
            nursery.start_soon(_watch, signals, on_stop or main_scope.cancel, name)
            with main_scope:
                await main()
            nursery.cancel_scope.cancel()


async def _watch(signals: Any, stop: Callable[[], object], name: str) -> None:
    """Call ``stop`` on the first signal; exit the process on the second."""
    draining = False
    async for signum in signals:
        what = signal.Signals(signum).name
        if not draining:
            draining = True
            click.echo(f"\n{name}: {what}: stopping gracefully ({what} again stops at once)", err=True)
            stop()
            continue
        click.echo(f"{name}: {what} again: stopping now", err=True)
        logging.shutdown()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(FORCED_EXIT_STATUS)
