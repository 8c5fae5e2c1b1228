"""Wires the simulated engine together: KV-event publisher, engine state, HTTP server; signals and exit codes."""

from __future__ import annotations

import errno
import importlib
import signal
import sys
from typing import Callable

import trio
import zmq

from llmgw.sim import api, httpserver
from llmgw.sim.config import SimConfig
from llmgw.sim.engine import Engine
from llmgw.sim.publisher import KvEventPublisher

#: Exit status for --fail-after (a simulated crash).
EXIT_SIMULATED_FAILURE = 1
#: Exit status when the engine cannot start (port taken, bad endpoint).
EXIT_CANNOT_START = 2


class StartError(Exception):
    """The engine cannot start (port taken, bad endpoint); the message tells the operator what to do."""


async def serve(
    cfg: SimConfig,
    *,
    handle_signals: bool = False,
    announce: Callable[[int], None] | None = None,
    task_status: trio.TaskStatus[tuple[Engine, int]] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Run the simulated engine until cancelled, ``--fail-after``, or (with ``handle_signals``) SIGTERM/SIGINT.

    Once listening, calls ``announce(port)`` and reports ``(engine, port)`` as
    started (``port`` is the real one when ``cfg.port`` is 0). Returns the exit
    status: 0 after a signal, :data:`EXIT_SIMULATED_FAILURE` after
    ``--fail-after``. Raises StartError, before reporting started, if the HTTP
    port or a ZMQ endpoint cannot be used. Closes every socket on return.
    """
    if cfg.startup_delay_s > 0:
        await trio.sleep(cfg.startup_delay_s)
    publisher = KvEventPublisher(cfg.kv_events_endpoint, cfg.kv_replay_endpoint, topic=cfg.kv_topic, data_parallel_rank=cfg.data_parallel_rank)
    try:
        publisher.open()
    except zmq.ZMQError as exc:
        raise StartError(
            f"cannot open KV event sockets (events {cfg.kv_events_endpoint}, replay {cfg.kv_replay_endpoint}): {exc}; choose free endpoints"
        ) from None
    try:
        try:
            listeners = await trio.open_tcp_listeners(cfg.port, host=cfg.host)
        except OSError as exc:
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else str(exc)
            raise StartError(f"cannot listen on {cfg.host}:{cfg.port}: {reason}; choose another --port (0 picks a free one)") from None
        port = listeners[0].socket.getsockname()[1]
        engine = Engine(cfg, publisher)
        status = 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.run)
            nursery.start_soon(httpserver.serve, api.make_handler(engine), listeners)
            if handle_signals:
                await nursery.start(_cancel_on_signal, nursery.cancel_scope)
            if announce is not None:
                announce(port)
            task_status.started((engine, port))
            await engine.fail_event.wait()
            print(f"llmgw-sim: --fail-after {cfg.fail_after} reached: exiting with status {EXIT_SIMULATED_FAILURE}", file=sys.stderr, flush=True)
            status = EXIT_SIMULATED_FAILURE
            nursery.cancel_scope.cancel()
        return status
    finally:
        publisher.close()


async def _cancel_on_signal(scope: trio.CancelScope, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Cancel ``scope`` on the first SIGTERM or SIGINT; reports started once the handlers are installed."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for _ in signals:
            scope.cancel()
            return


def _undumpable() -> None:
    """Keeps this engine's secret from other engines of its user when the agent asks for it (the
    engine path's ``llmgw_undumpable``, on PYTHONPATH where the agent started it)."""
    try:
        undumpable = importlib.import_module("llmgw_undumpable")
    except ImportError:  # run by hand: nothing to keep
        return
    undumpable.apply()


def main(cfg: SimConfig) -> int:
    """Run the simulated engine in a fresh trio loop (the CLI); return the process exit status."""
    _undumpable()

    def announce(port: int) -> None:
        print(f"llmgw-sim: serving {cfg.model} on http://{cfg.host}:{port}", file=sys.stderr, flush=True)

    try:
        return trio.run(lambda: serve(cfg, handle_signals=True, announce=announce))
    except StartError as exc:
        print(f"llmgw-sim: {exc}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_START

