"""A gateway worker process: ``python -m llmgw.router.workers.worker FD``.

Started by the :class:`~llmgw.router.workers.pool.GatewayPool` when ``gateway.workers``
is above 1; ``FD`` is its end of a Unix socketpair
(:mod:`llmgw.router.workers.channel`). The worker serves the same gateway as the
single-process server (:func:`~llmgw.router.build.assemble_gateway`) on the shared HTTP
port (SO_REUSEPORT: the kernel spreads connections over the workers). The messages are
in :mod:`llmgw.router.workers.protocol`.

The worker never listens before its first state, so it never answers with an empty
table (nor routes without the KV index's full copy, sent before that state). When the
control plane goes away (EOF, even after SIGKILL) the worker shuts down.
Every response carries ``x-llmgw-worker: <index>``.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import sys
from typing import Any, Awaitable, Callable, Mapping

import attrs
import trio

from ...gctune import tune_for_serving
from ..admin_api import ApiRequest, ApiResponse, api_error
from ..app import Gateway, leader_state
from ..build import assemble_gateway
from ..http.extensions import BODY_SINK_KEY
from ..http.forward import SinkWrapper
from ..http.serve import serve_gateway
from ..metrics_access import MetricsAccess, MetricsGate
from .channel import Channel, ChannelClosed, Message
from .protocol import (
    MirrorTable, decode_keys, decode_kv_delta, decode_settings, decode_shares, encode_admission, encode_metrics,
    encode_usage,
)

log = logging.getLogger(__name__)

#: Seconds between unsolicited reports (usage, in-flight, admission). Usage counted in
#: the last interval before a worker crash is lost; `ctl usage` asks for a fresh report.
REPORT_INTERVAL_S = 0.5
#: Seconds a GET /metrics waits for the control plane to merge every worker's samples.
SCRAPE_TIMEOUT_S = 5.0
#: Seconds an /api/v1/* call waits for the control plane's answer: beyond the admin call's
#: own deadline (llmgw.client.CALL_TIMEOUT, 30 s), so that one answers first with its reason.
ADMIN_API_TIMEOUT_S = 35.0
#: The control plane's answers to what a worker asked, matched by "id".
ANSWER_KINDS = ("scraped", "api_reply")
#: Header naming the worker that answered (tests and operators tell workers apart by it).
WORKER_HEADER = b"x-llmgw-worker"
#: Message kinds that carry the control plane's KV-cache state (:meth:`Worker.apply_kv`).
KV_KINDS = frozenset({"kv", "kvforget", "kvcopy"})


class WorkerFront:
    """ASGI wrapper: answers GET /metrics with every worker's merged samples and tags responses."""

    def __init__(self, app: Any, index: int, scrape: Callable[[], Awaitable[bytes | None]]) -> None:
        self._app = app
        self._tag = (WORKER_HEADER, str(index).encode())
        self._scrape = scrape

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        tag = self._tag
        if scope["path"] == "/metrics" and scope["method"] == "GET":
            body = await self._scrape()
            status = 200 if body is not None else 503
            if body is None:
                body = b"the control plane did not merge the workers' metrics in time; retry\n"
            await send({"type": "http.response.start", "status": status, "headers": [
                (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                (b"content-length", str(len(body)).encode()), tag]})
            await send({"type": "http.response.body", "body": body})
            return

        async def tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), tag]}
            await send(message)

        extensions = scope.get("extensions")
        sink = extensions.get(BODY_SINK_KEY) if extensions is not None else None
        if sink is not None:  # a response can start through the server's sink instead of send
            extensions[BODY_SINK_KEY] = _TaggedSink(sink, tag)
        await self._app(scope, receive, tagged)


class _TaggedSink(SinkWrapper):
    """The server's body sink, adding :data:`WORKER_HEADER` to a response it starts."""

    __slots__ = ("_name", "_value")

    def __init__(self, sink: Any, tag: tuple[bytes, bytes]) -> None:
        super().__init__(sink)
        self._name = tag[0].decode("latin-1")
        self._value = tag[1].decode("latin-1")

    def start(self, status: int, headers: Mapping[str, str]) -> Awaitable[None]:
        return self._sink.start(status, {**headers, self._name: self._value})

    def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> Awaitable[None]:
        return self._sink.respond(status, {**headers, self._name: self._value}, body)


class Worker:
    """One worker's gateway and its side of the channel."""

    def __init__(self, channel: Channel, config: Message) -> None:
        self.channel = channel
        self.index = int(config["index"])
        self.host = str(config["host"])
        self.port = int(config["port"])
        self.table = MirrorTable()
        # Routes like the single-process gateway: the KV index is the control plane's
        # (fed over the channel), load and routed-but-unconfirmed blocks are this worker's.
        settings = decode_settings(config)
        self.gateway: Gateway = assemble_gateway(settings, table=self.table)
        #: Seconds in-flight requests get when the control plane says "stop" (``gateway.shutdown_grace``).
        self.shutdown_grace = settings.gateway.shutdown_grace
        # /metrics is refused before the merge by the rule a single gateway applies.
        access = MetricsAccess.on_gateway(self.gateway.metrics_config, self.gateway.auth.enabled)
        self.front = MetricsGate(WorkerFront(self.gateway.app, self.index, self.scrape), access)
        self._ask_ids = itertools.count()
        self._asks: dict[int, tuple[trio.Event, list[Message]]] = {}
        self.gateway.admin_api = self.forward_api

    def apply(self, state: Message) -> None:
        """Make the gateway's table, keys, ``stopped``, readiness and routing equal to ``state``."""
        self.table.load_state(state["table"])
        self.gateway.auth.replace(decode_keys(state["keys"]))
        self.gateway.stopped = bool(state["stopped"])
        self.gateway.not_ready = state.get("not_ready")
        self.gateway.leader = state.get("leader") or leader_state(False, "", 0)
        self.gateway.apply_routing(state.get("routing") or {})

    async def apply_shares(self, message: Message) -> None:
        """Enforce the gateway's admission shares of a "shares" message (this worker's part
        of them: its admission divides by the worker count), then say so."""
        self.gateway.admission.set_shares(decode_shares(message))
        await self.channel.send({"t": "shares_applied", "version": message["version"]})

    def apply_kv(self, message: Message) -> None:
        """Apply one of the :data:`KV_KINDS` messages to the gateway's KV index (and policy).

        "kvcopy" forgets every replica it does not name (the reset deltas that follow
        replace the named ones). Raises ValueError for a malformed delta.
        """
        kind = message.get("t")
        g = self.gateway
        if kind == "kv":
            g.kv_update(str(message["replica"]), decode_kv_delta(message["delta"]))
        elif kind == "kvforget":
            g.kv_forget(str(message["replica"]))
        elif kind == "kvcopy":
            keep = set(map(str, message["replicas"]))
            for replica_id in g.kv_index.replica_ids():
                if replica_id not in keep:
                    g.kv_forget(replica_id)

    def report(self, request_id: Any = None, metrics: bool = False) -> Message:
        """Return a report (usage, in flight, admission counters, KV hash alarms, and with
        ``metrics`` every sample); drains the usage meter (the counts now belong to the
        control plane)."""
        g = self.gateway
        return {
            "t": "report", "id": request_id,
            "kv_alarms": list(g.policy.alarms()),
            "usage": encode_usage(g.usage.drain()),
            "load": g.load.snapshot(),
            "admission": encode_admission(g.admission.snapshot()),
            "metrics": encode_metrics(g.metrics.registry) if metrics else None,
        }

    async def _ask(self, message: Message, timeout: float) -> Message | None:
        """Send ``message`` to the control plane with a fresh "id" and return its answer (one
        of :data:`ANSWER_KINDS` with that id), or None after ``timeout`` seconds or when the
        channel closed."""
        ask_id = next(self._ask_ids)
        done, box = trio.Event(), []
        self._asks[ask_id] = (done, box)
        try:
            await self.channel.send({**message, "id": ask_id})
            with trio.move_on_after(timeout):
                await done.wait()
        except ChannelClosed:
            return None
        finally:
            del self._asks[ask_id]
        return box[0] if box else None

    async def scrape(self) -> bytes | None:
        """Return every worker's metrics merged by the control plane, or None after the deadline."""
        answer = await self._ask({"t": "scrape"}, SCRAPE_TIMEOUT_S)
        return bytes(answer["body"]) if answer is not None else None

    async def forward_api(self, request: ApiRequest) -> ApiResponse:
        """Answer an /api/v1/* call by the control plane's process (504 if it does not answer in time)."""
        answer = await self._ask({"t": "api", "request": attrs.asdict(request)}, ADMIN_API_TIMEOUT_S)
        if answer is None:
            return api_error(504, f"the control plane did not answer within {ADMIN_API_TIMEOUT_S:g}s", "timeout")
        return ApiResponse(int(answer["status"]), answer["payload"])

    async def read(self, stop: trio.CancelScope) -> None:
        """Handle messages from the control plane; cancel ``stop`` on "stop" or EOF."""
        try:
            while True:
                message = await self.channel.receive()
                kind = message.get("t")
                if kind == "state":
                    self.apply(message)
                    await self.channel.send({"t": "applied", "version": message["version"]})
                elif kind in KV_KINDS:
                    self.apply_kv(message)
                elif kind == "shares":
                    await self.apply_shares(message)
                elif kind == "collect":
                    await self.channel.send(self.report(message.get("id"), bool(message.get("metrics"))))
                elif kind in ANSWER_KINDS:
                    waiting = self._asks.get(message["id"])
                    if waiting is not None:
                        waiting[1].append(message)
                        waiting[0].set()
                elif kind == "stop":
                    break
        except ChannelClosed:
            log.warning("gateway worker %d: the control plane went away; stopping", self.index)
        stop.cancel()

    async def report_periodically(self) -> None:
        while True:
            await trio.sleep(REPORT_INTERVAL_S)
            await self.channel.send(self.report())


async def _main(fd: int) -> None:
    channel = Channel.from_socket(socket.socket(fileno=fd))
    try:
        config = await channel.receive()
        if config.get("t") != "config":
            raise ValueError(f"gateway worker: expected config first, got {config.get('t')!r}")
        try:
            worker = Worker(channel, config)
        except Exception as error:
            await channel.send({"t": "failed", "error": f"{type(error).__name__}: {error}"})
            raise
        while True:  # the first state before listening: never serve an empty table
            message = await channel.receive()
            if message.get("t") == "state":
                worker.apply(message)
                await channel.send({"t": "applied", "version": message["version"]})
                break
            if message.get("t") == "stop":
                return
            if message.get("t") in KV_KINDS:  # the full KV copy comes first
                worker.apply_kv(message)
            elif message.get("t") == "shares":  # and the admission shares
                await worker.apply_shares(message)
        tune_for_serving()  # set up: what is alive now is never garbage (llmgw/gctune.py)
        async with trio.open_nursery() as nursery:
            serving = trio.CancelScope()
            nursery.start_soon(worker.read, serving)
            with serving:
                async with trio.open_nursery() as inner:
                    try:
                        port = await inner.start(lambda task_status: serve_gateway(
                            worker.front, worker.host, worker.port, graceful_timeout=worker.shutdown_grace,
                            on_grace_over=worker.gateway.streams.cut_all, reuse_port=True,
                            task_status=task_status))
                    except OSError as error:
                        await channel.send({"t": "failed", "error": str(error)})
                        raise
                    await channel.send({"t": "ready", "port": port, "pid": os.getpid()})
                    inner.start_soon(worker.report_periodically)
            # Stopped: every request is finished (serve_gateway's graceful shutdown), so
            # this last report carries all of the usage (and the journal holds all of it).
            worker.gateway.usage.close()
            try:
                await channel.send(worker.report())
            except ChannelClosed:
                log.warning("gateway worker %d: could not hand over its last usage counts", worker.index)
            nursery.cancel_scope.cancel()
    except ChannelClosed:
        pass
    finally:
        with trio.CancelScope(shield=True):
            await channel.aclose()


def main(argv: list[str]) -> None:
    """Entry point: ``argv`` is ``[FD]``. SIGINT and SIGTERM are ignored: the control plane
    decides when to stop (Ctrl-C reaches the whole process group, and systemd's stop sends
    SIGTERM to every process of the service; the server then drains its workers itself)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    level = os.environ.get("LLMGW_WORKER_LOG_LEVEL", "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trio.run(_main, int(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
