"""Gateway worker processes: N gateways on one HTTP port, fed by the control plane.

With ``gateway.workers: N`` above 1, :func:`~llmgw.router.build.build_gateway` returns a
:class:`GatewayPool`: the control plane does not serve HTTP itself; the pool starts N
worker processes (``python -m llmgw.router.workers.worker``), each a complete gateway
listening on the same port with SO_REUSEPORT (the kernel spreads connections over
them). The pool keeps the *master* :class:`~llmgw.router.app.Gateway` (never served):
its replica table, keys, ``serving.stopped`` and the ``routing`` setting (fed through the
:class:`~llmgw.router.interface.GatewayInterface` methods), usage meter and admission
counters. It mirrors that state into every worker and brings the workers' usage,
in-flight counts, admission counters, KV hash alarms and metrics back. The messages are
in :mod:`llmgw.router.workers.protocol`; docs/gateway.md has the design and its
trade-offs.

KV-cache deltas (:meth:`GatewayPool.kv_update`, :meth:`GatewayPool.kv_forget`) are applied
to the master, then reach every worker in order: each worker slot has a queue and a feed
task. A worker's feed first sends a full copy of the master's KV index (taken
synchronously, so it holds exactly the deltas queued before it and none after), then the
queued deltas. A queue that outgrows :data:`KV_QUEUE_MAX` (the worker is not reading) is
dropped and replaced by a fresh full copy.

Nursery tree::

    GatewayPool.serve
    ├── pusher (state changed -> one snapshot to every worker)
    ├── reporter wake-ups (scrapes: merge every worker's samples)
    ├── per worker slot: supervise (start, wait for "ready", read reports, restart with backoff)
    └── per worker slot: KV feed (full copy, then queued deltas; ends with its worker)
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import subprocess
import sys
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import attrs
import trio

from llmgw.spec import KvDelta, split_delta
from llmgw.trioutil import unwrap_single_group

from ..admin_api import NO_ADMIN_API, ApiRequest, api_error
from ..admission import Admission, AdmissionLimits, AdmissionShares, TenantCounters
from ..app import Gateway, describe_routing, leader_state
from ..auth import AuthTable, KeyEntry
from ..http.serve import CUT_SLACK_S, SHUTDOWN_SLACK_S
from ..interface import AccessState, GatewayStatus, UsageCounts
from ..local import GatewayState
from ..replicas import ModelInfo, Replica, ReplicaTable
from ..settings import GatewaySettings
from .channel import Channel, ChannelClosed, Message
from .protocol import (
    decode_admission, decode_usage, encode_keys, encode_kv_delta, encode_shares, encode_table, merge_metrics,
    worker_config,
)

log = logging.getLogger(__name__)

#: Seconds a worker gets from spawn to listening (importing the gateway takes ~1 s on a
#: busy 2-core machine; a real failure reports itself long before).
START_TIMEOUT_S = 60.0
#: Restart backoff after a worker dies: doubles from the first to the last value, and
#: starts again from the first once a worker has run for STABLE_S.
RESTART_BACKOFF_S = (0.2, 10.0)
STABLE_S = 30.0
#: Seconds a stopped worker gets, beyond its shutdown grace (``gateway.shutdown_grace``)
#: and its own shutdown slack, to hand over its last usage before it is killed.
STOP_SLACK_S = CUT_SLACK_S + SHUTDOWN_SLACK_S + 2.0
#: Seconds to push one state snapshot into one worker's socket; a worker that does not
#: read for that long is stuck and is killed (then restarted).
PUSH_TIMEOUT_S = 10.0
#: Seconds an admin change waits for every worker to apply it (then it logs and returns:
#: the workers apply it when they catch up).
SYNC_TIMEOUT_S = 5.0
#: Seconds to collect every worker's report for a scrape or `ctl usage`.
COLLECT_TIMEOUT_S = 3.0
#: KV messages queued for one worker before the queue is dropped and the worker gets a
#: fresh full copy of the KV index instead. Live deltas are small (a few blocks each) and
#: come at a few per second per busy replica, so 10,000 is many seconds of a large
#: fleet's traffic: a worker that far behind is not reading, and one full copy (the
#: index's size, which is bounded) is cheaper than an ever-growing backlog.
KV_QUEUE_MAX = 10_000

WORKER_MODULE = "llmgw.router.workers.worker"


class WorkerStartError(OSError):
    """A gateway worker could not start (the message says why, e.g. the port is taken)."""


class ObservedTable(ReplicaTable):
    """A :class:`ReplicaTable` that calls ``on_change()`` after every update."""

    def __init__(self) -> None:
        super().__init__()
        self.on_change: Callable[[], None] | None = None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def set_model_replicas(self, model: str, replicas: Sequence[Replica]) -> None:
        super().set_model_replicas(model, replicas)
        self._changed()

    def replace_all(
        self, mapping: Mapping[str, Sequence[Replica]], infos: Mapping[str, ModelInfo] | None = None
    ) -> None:
        super().replace_all(mapping, infos)
        self._changed()

    def remove_model(self, model: str) -> None:
        super().remove_model(model)
        self._changed()


class ObservedAuthTable(AuthTable):
    """An :class:`AuthTable` that keeps its entries (to mirror them) and calls ``on_change()``."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.on_change: Callable[[], None] | None = None
        self.entries: tuple[KeyEntry, ...] = ()
        super().__init__(enabled=enabled)

    def replace(self, keys: Iterable[KeyEntry]) -> None:
        """Replace the keys (as :meth:`AuthTable.replace`); ``on_change()`` only if they differ."""
        entries = tuple(keys)
        changed = entries != self.entries
        self.entries = entries
        super().replace(entries)
        if changed and self.on_change is not None:
            self.on_change()


class PooledAdmission(Admission):
    """The master gateway's admission view: the counters are the sum of every worker's
    (a dead worker's admitted/queued/shed counts are kept; its in-flight ends with it)."""

    def __init__(self, limits: AdmissionLimits) -> None:
        super().__init__(limits)
        self.by_worker: dict[int, dict[str, TenantCounters]] = {}
        self.retired: dict[str, TenantCounters] = {}

    def retire(self, slot: int) -> None:
        """Fold a gone worker's counters into the kept totals (its in-flight requests are over)."""
        for name, c in self.by_worker.pop(slot, {}).items():
            kept = self.retired.setdefault(name, TenantCounters())
            kept.admitted += c.admitted
            kept.queued += c.queued
            kept.shed += c.shed
            kept.tokens += c.tokens

    def snapshot(self) -> dict[str, TenantCounters]:
        """Return every tenant's counters summed over the workers (and retired ones)."""
        total = {name: attrs.evolve(c) for name, c in self.retired.items()}
        for counters in self.by_worker.values():
            for name, c in counters.items():
                row = total.setdefault(name, TenantCounters())
                row.admitted += c.admitted
                row.queued += c.queued
                row.shed += c.shed
                row.in_flight += c.in_flight
                row.tokens += c.tokens
        return total


class _Slot:
    """One running worker process and its channel."""

    def __init__(self, index: int, generation: int, process: trio.Process, channel: Channel) -> None:
        self.index = index
        self.generation = generation
        self.process = process
        self.channel = channel
        self.sent = -1  # state version last sent
        self.applied = -1  # state version the worker says it applied
        self.shares_sent = -1  # admission shares version last sent
        self.shares_applied = -1  # and the one the worker says it applied
        self.ready = False
        self.state_lock = trio.Lock()
        self.copied = False  # its first full KV copy is sent (until then it gets no state)
        # KV feed: messages queued after the last full copy, in order; kv_resync: the next
        # thing to send is a full copy (queue nothing until it is taken).
        self.kv_queue: collections.deque[Message] = collections.deque()
        self.kv_resync = True
        self.kv_wake = trio.Event()
        self.kv_scope = trio.CancelScope()


class GatewayPool(GatewayState):
    """N gateway worker processes on one port mirroring ``master``'s state (``gateway.workers`` > 1).

    ``master`` is a gateway that is never served (:func:`~llmgw.router.build.build_gateway`
    makes it): its ``table`` must be an :class:`ObservedTable` and its ``auth`` an
    :class:`ObservedAuthTable` (or call :meth:`state_changed` after changing them), worker
    usage is added to its ``usage`` meter, and its ``admission`` should be a
    :class:`PooledAdmission`. Every worker is configured with ``settings``, its admission
    limits and each tenant's limits divided among the workers.
    """

    def __init__(self, master: Gateway, settings: GatewaySettings) -> None:
        workers = settings.gateway.workers
        if workers < 2:
            raise ValueError("a gateway pool needs at least 2 workers (1 is the in-process gateway)")
        super().__init__(master)
        self.master = master
        self.host = ""
        self.workers = workers
        self.settings = settings
        self.port = 0
        self.slots: dict[int, _Slot] = {}
        self.pids: dict[int, int] = {}
        self.load: dict[int, dict[str, int]] = {}
        self.alarms: dict[int, list[str]] = {}  # KV hash-agreement alarms per worker, as last reported
        #: The cluster setting ``routing`` the workers route by (over ``settings.routing``).
        self.routing: dict[str, Any] = {}
        self._version = 0
        self._shares_version = 0
        self._changed = trio.Event()
        self._progress = trio.Event()  # set (and replaced) on every ack, report and slot change
        self._ids = itertools.count()
        self._collects: dict[int, dict[int, Message]] = {}
        self._generations = itertools.count()
        self._nursery: trio.Nursery | None = None
        for observed in (master.table, master.auth):
            if isinstance(observed, (ObservedTable, ObservedAuthTable)):
                observed.on_change = self.state_changed

    # -- the gateway interface, beyond the master's own state (GatewayState) ------------

    async def apply_access(self, access: AccessState) -> None:
        """Apply ``access`` to the master, then wait (bounded by :data:`SYNC_TIMEOUT_S`)
        until every worker has applied it."""
        stopped = self.master.stopped
        await super().apply_access(access)  # changed keys are seen through ObservedAuthTable
        if self.master.stopped != stopped:  # a plain attribute: say so here
            self.state_changed()
        await self.synced()

    def apply_routing(self, overrides: Mapping[str, Any]) -> None:
        """Send ``overrides`` to every worker (each routes by them; the master routes nothing)."""
        if dict(overrides) != self.routing:
            self.routing = dict(overrides)
            self.state_changed()

    def set_readiness(self, not_ready: str | None) -> None:
        """Set the master's readiness; the pusher sends it to every worker (each answers ``/readyz``)."""
        if self.master.not_ready != not_ready:
            super().set_readiness(not_ready)
            self.state_changed()

    def set_leader(self, leading: bool, leader: str, epoch: int) -> None:
        """Set the master's leader state; the pusher sends it to every worker (each answers ``/leader``)."""
        state = leader_state(leading, leader, epoch)
        if self.master.leader != state:
            self.master.leader = state
            self.state_changed()

    async def apply_admission_shares(self, shares: AdmissionShares) -> None:
        """Apply ``shares`` to the master (its status), then send them to every worker and
        wait (bounded by :data:`SYNC_TIMEOUT_S`) until each has applied them; a worker that
        starts later gets them before it listens."""
        await super().apply_admission_shares(shares)
        self._shares_version += 1
        self._changed.set()
        target = self._shares_version
        with trio.move_on_after(SYNC_TIMEOUT_S):
            while any(s.shares_applied < target for s in self.slots.values()):
                await self._progress.wait()
            return
        log.warning("gateway workers did not all apply new admission shares within %gs; they will when they "
                    "catch up", SYNC_TIMEOUT_S)

    async def pending_usage(self) -> dict[tuple[str, str], UsageCounts]:
        """Collect every worker's counts first (:meth:`collect`), then return the master's."""
        await self.collect()
        return await super().pending_usage()

    def status(self) -> GatewayStatus:
        """Return the master's status: admission counters summed over the workers, KV alarms
        as the workers last reported them."""
        alarms = set(self.master.policy.alarms()) | set(self.kv_alarms())
        routing = attrs.evolve(self.settings.routing, **self.routing)
        return attrs.evolve(super().status(), kv_alarms=tuple(sorted(alarms)), routing=describe_routing(routing))

    # -- state down ---------------------------------------------------------------------

    def state_changed(self) -> None:
        """Note that the master's table, keys or ``stopped`` changed; the pusher sends a snapshot."""
        self._version += 1
        self._changed.set()

    def _state(self) -> Message:
        m = self.master
        return {
            "t": "state", "version": self._version, "table": encode_table(m.table),
            "keys": encode_keys(m.auth.entries if isinstance(m.auth, ObservedAuthTable) else ()),
            "stopped": m.stopped, "not_ready": m.not_ready, "leader": m.leader, "routing": self.routing,
        }

    async def _sync(self, slot: _Slot) -> None:
        """Send ``slot`` the current admission shares and state where it has older ones (the
        shares first: a starting worker enforces them from its first request); kill it if
        it does not take them."""
        async with slot.state_lock:
            if slot.shares_sent < self._shares_version:
                message = encode_shares(self._shares_version, self.master.admission.shares)
                if not await self._push(slot, message):
                    return
                slot.shares_sent = message["version"]
            if slot.sent < self._version:
                message = self._state()
                if not await self._push(slot, message):
                    return
                slot.sent = message["version"]

    async def _push(self, slot: _Slot, message: Message) -> bool:
        """Send ``message`` to ``slot``; return False if its worker is gone, or did not read it
        within :data:`PUSH_TIMEOUT_S` (it is killed then)."""
        try:
            with trio.fail_after(PUSH_TIMEOUT_S):
                await slot.channel.send(message)
        except trio.TooSlowError:
            log.error("gateway worker %d does not read its channel; killing it", slot.index)
            slot.process.kill()
            return False
        except ChannelClosed:
            return False
        return True

    async def _pusher(self) -> None:
        while True:
            await self._changed.wait()
            self._changed = trio.Event()
            async with trio.open_nursery() as nursery:
                for slot in list(self.slots.values()):
                    if slot.copied:  # a starting one is synced by _run_one after its copy
                        nursery.start_soon(self._sync, slot)

    async def synced(self, timeout: float = SYNC_TIMEOUT_S) -> bool:
        """Return True once every worker applied the state as of now; False after ``timeout``."""
        target = self._version
        with trio.move_on_after(timeout):
            while any(s.applied < target for s in self.slots.values()):
                await self._progress.wait()
            return True
        log.warning("gateway workers did not all apply a change within %gs; they will when they catch up", timeout)
        return False

    def _notify(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    # -- KV-cache deltas down -----------------------------------------------------------

    def kv_update(self, replica_id: str, delta: KvDelta) -> None:
        """Apply ``delta`` of ``replica_id`` to the master, then queue it for every worker,
        behind the ones before it (no await in between: a full copy taken later already
        contains it). Synchronous; never raises."""
        super().kv_update(replica_id, delta)
        self._kv_queue({"t": "kv", "replica": replica_id, "delta": encode_kv_delta(delta)})

    def kv_forget(self, replica_id: str) -> None:
        """Forget ``replica_id``'s KV state in the master, then queue the same for every
        worker (as :meth:`kv_update`). Synchronous; never raises."""
        super().kv_forget(replica_id)
        self._kv_queue({"t": "kvforget", "replica": replica_id})

    def _kv_queue(self, message: Message) -> None:
        """Append ``message`` to every worker's KV queue; an overflowing queue is dropped
        and its worker marked for a fresh full copy."""
        for slot in self.slots.values():
            if slot.kv_resync:
                continue  # the full copy it is waiting for will include this
            slot.kv_queue.append(message)
            if len(slot.kv_queue) > KV_QUEUE_MAX:
                log.warning("gateway worker %d is %d KV deltas behind; it gets a full copy instead",
                            slot.index, len(slot.kv_queue))
                slot.kv_queue.clear()
                slot.kv_resync = True
            slot.kv_wake.set()

    def _kv_copy(self, slot: _Slot) -> Iterator[Message]:
        """Return ``slot``'s full copy of the master's KV index as now, and start queueing
        for it anew: a "kvcopy" header naming every replica (the worker forgets the others),
        then one reset delta per replica, split as the agent splits large ones.

        The index is read here, synchronously; the messages are built as they are iterated.
        """
        slot.kv_resync = False
        slot.kv_queue.clear()
        index = self.master.kv_index
        copies = [(replica_id, index.full_copy(replica_id)) for replica_id in index.replica_ids()]
        return _copy_messages([(replica_id, delta) for replica_id, delta in copies if delta is not None])

    async def _kv_send(self, slot: _Slot, message: Message, timeout: float) -> None:
        """Send one KV message to ``slot`` within ``timeout`` seconds.

        Raises :class:`ChannelClosed` if the worker is gone, ``trio.TooSlowError`` if it
        did not take the message in time (the channel may then hold half a message: the
        caller kills the worker). Cancellation is seen before the message starts, never
        in its middle (a cut message would garble the "stop" that follows it).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        with trio.CancelScope(shield=True), trio.fail_after(timeout):
            await slot.channel.send(message)

    async def _kv_feed(self, slot: _Slot, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Send ``slot``'s worker its KV messages, in order, until ``slot.kv_scope`` is cancelled.

        First a full copy of the master's index (reported started once it is sent, or
        once the worker turned out to be gone), then the queued messages as they come;
        a full copy again whenever the queue overflowed. A worker that does not take a
        message within :data:`PUSH_TIMEOUT_S` (:data:`START_TIMEOUT_S` for the first copy:
        it may still be importing) is killed, and the supervisor restarts it. Never raises
        but for cancellation from outside its scope.
        """
        started = False
        with slot.kv_scope:
            try:
                while True:
                    if slot.kv_resync:
                        timeout = PUSH_TIMEOUT_S if started else START_TIMEOUT_S
                        for message in self._kv_copy(slot):
                            if slot.kv_resync:
                                break  # overflowed again while copying: start over
                            await self._kv_send(slot, message, timeout)
                    if not started:
                        started = True
                        task_status.started()
                    while slot.kv_queue and not slot.kv_resync:
                        await self._kv_send(slot, slot.kv_queue.popleft(), PUSH_TIMEOUT_S)
                    if not slot.kv_queue and not slot.kv_resync:
                        slot.kv_wake = trio.Event()
                        await slot.kv_wake.wait()
            except ChannelClosed:
                pass
            except trio.TooSlowError:
                log.error("gateway worker %d does not read its KV deltas; killing it", slot.index)
                slot.process.kill()
        if not started:
            task_status.started()

    async def _start_kv_feed(self, slot: _Slot) -> None:
        """Register ``slot`` (it gets KV deltas and states from now on) and start its KV feed;
        return once the feed has sent the full KV copy (or found the worker gone).

        The first state waits for the copy (the slot's state lock is held, taken before
        the pusher can see the slot, and the pusher leaves the slot to :meth:`_run_one`
        until then), so the worker, which listens after its first state, routes by the KV
        index from its first request. The feed then runs in the pool's nursery until
        :meth:`_stop` cancels it.
        """
        assert self._nursery is not None, "workers run inside GatewayPool.run"
        slot.state_lock.acquire_nowait()  # no checkpoint between this and registering
        self.slots[slot.index] = slot
        try:
            await self._nursery.start(self._kv_feed, slot)
        finally:
            slot.copied = True
            slot.state_lock.release()

    # -- alarms up ----------------------------------------------------------------------

    def kv_alarms(self) -> list[str]:
        """Return the KV hash-agreement alarms any running worker last reported, sorted, once each."""
        return sorted({alarm for alarms in self.alarms.values() for alarm in alarms})

    # -- reports up ---------------------------------------------------------------------

    def _on_report(self, slot: _Slot, message: Message) -> None:
        usage = decode_usage(message.get("usage") or {})
        if usage:
            self.master.usage.restore(usage)
        self.load[slot.index] = {str(k): int(v) for k, v in (message.get("load") or {}).items()}
        self.alarms[slot.index] = [str(a) for a in message.get("kv_alarms") or ()]
        admission = self.master.admission
        if isinstance(admission, PooledAdmission):
            admission.by_worker[slot.index] = decode_admission(message.get("admission") or {})
        request_id = message.get("id")
        if request_id is not None and request_id in self._collects:
            self._collects[request_id][slot.generation] = message

    async def collect(self, *, metrics: bool = False, timeout: float = COLLECT_TIMEOUT_S) -> list[Message]:
        """Ask every ready worker for a report now; return the reports that came in time.

        Usage in them is already added to the master's meter when this returns.
        """
        request_id = next(self._ids)
        got: dict[int, Message] = {}
        self._collects[request_id] = got
        try:
            asked = [s for s in self.slots.values() if s.ready]
            for slot in asked:
                try:
                    await slot.channel.send({"t": "collect", "id": request_id, "metrics": metrics})
                except ChannelClosed:
                    pass
            with trio.move_on_after(timeout):
                while any(s.generation not in got and self.slots.get(s.index) is s for s in asked):
                    await self._progress.wait()
            return list(got.values())
        finally:
            del self._collects[request_id]

    async def scrape(self) -> bytes | None:
        """Returns every worker's metrics merged into one exposition (a worker that did not
        report within :data:`COLLECT_TIMEOUT_S` is missing from it)."""
        reports = await self.collect(metrics=True)
        merged = merge_metrics(r["metrics"] for r in reports if r.get("metrics") is not None)
        return merged + await self.master.extra_metrics_body()

    async def _serve_scrape(self, slot: _Slot, scrape_id: Any) -> None:
        body = await self.scrape()
        try:
            await slot.channel.send({"t": "scraped", "id": scrape_id, "body": body})
        except ChannelClosed:
            pass

    async def _serve_api(self, slot: _Slot, message: Message) -> None:
        """Answer one /api/v1/* call a worker forwarded with the master's handler (a malformed one: 400)."""
        try:
            request = ApiRequest(**message["request"])
        except (KeyError, TypeError) as exc:
            answer = api_error(400, f"malformed forwarded request: {exc}", "invalid_request")
        else:
            handler = self.master.admin_api
            answer = await handler(request) if handler is not None else NO_ADMIN_API
        try:
            await slot.channel.send({"t": "api_reply", "id": message.get("id"), "status": answer.status,
                                     "payload": answer.payload})
        except ChannelClosed:
            pass

    def in_flight(self) -> dict[str, int]:
        """Return requests in flight per replica, summed over the workers (as of their last report)."""
        total: dict[str, int] = {}
        for counts in self.load.values():
            for replica, n in counts.items():
                total[replica] = total.get(replica, 0) + n
        return total

    # -- processes ----------------------------------------------------------------------

    async def _spawn(self, index: int) -> _Slot:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            env = {**os.environ, "LLMGW_WORKER_LOG_LEVEL": logging.getLevelName(logging.getLogger().getEffectiveLevel())}
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", WORKER_MODULE, str(child.fileno())],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        return _Slot(index, next(self._generations), process, Channel.from_socket(parent))

    async def _run_one(self, index: int, on_ready: Callable[[int], None]) -> None:
        """Run one worker process until it exits; call ``on_ready(port)`` once it listens.

        Raises :class:`WorkerStartError` if it fails before listening. Cancellation
        stops it gracefully (its requests get ``gateway.shutdown_grace``, then its last
        usage is collected) and kills it :data:`STOP_SLACK_S` past that grace.
        """
        slot = await self._spawn(index)
        try:
            await slot.channel.send(worker_config(index, self.host, self.port, self.settings))
            await self._start_kv_feed(slot)
            await self._sync(slot)
            with trio.fail_after(START_TIMEOUT_S):
                while not slot.ready:
                    try:
                        message = await slot.channel.receive()
                    except ChannelClosed:
                        raise WorkerStartError(f"gateway worker {index} exited before listening "
                                               f"(its output is in the server log)") from None
                    if message.get("t") == "failed":
                        raise WorkerStartError(f"gateway worker {index}: {message.get('error')}")
                    self._handle(slot, message)
            self.pids[index] = slot.process.pid
            log.info("gateway worker %d listening on %s:%d (pid %d)", index, self.host, self.port, slot.process.pid)
            on_ready(self.port)
            await self._sync(slot)  # anything that changed while it started
            while True:
                try:
                    message = await slot.channel.receive()
                except ChannelClosed:
                    return
                self._handle(slot, message)
        finally:
            with trio.CancelScope(shield=True):
                await self._stop(slot)

    def _handle(self, slot: _Slot, message: Message) -> None:
        kind = message.get("t")
        if kind == "applied":
            slot.applied = max(slot.applied, int(message["version"]))
        elif kind == "shares_applied":
            slot.shares_applied = max(slot.shares_applied, int(message["version"]))
        elif kind == "ready":
            if not self.port:
                self.port = int(message["port"])
            slot.ready = True
        elif kind == "report":
            self._on_report(slot, message)
        elif kind == "scrape" and self._nursery is not None:
            self._nursery.start_soon(self._serve_scrape, slot, message.get("id"))
        elif kind == "api" and self._nursery is not None:
            self._nursery.start_soon(self._serve_api, slot, message)
        self._notify()

    async def _stop(self, slot: _Slot) -> None:
        """Stop ``slot``'s process (gracefully if it still runs), keep its last report, reap it."""
        slot.kv_scope.cancel()  # its feed ends after the message it is sending, if any
        slot.kv_resync = True  # and nothing more is queued for it
        slot.kv_queue.clear()
        if slot.process.returncode is None:
            stop_timeout = self.settings.gateway.shutdown_grace + STOP_SLACK_S
            with trio.move_on_after(stop_timeout):
                try:
                    await slot.channel.send({"t": "stop"})
                    while True:
                        self._handle(slot, await slot.channel.receive())
                except (ChannelClosed, ValueError):
                    pass
                await slot.process.wait()
            if slot.process.returncode is None:
                log.warning("gateway worker %d did not stop in %gs; killing it", slot.index, stop_timeout)
                slot.process.kill()
        await slot.process.wait()
        await slot.channel.aclose()
        if self.slots.get(slot.index) is slot:
            del self.slots[slot.index]
            self.load.pop(slot.index, None)
            self.alarms.pop(slot.index, None)
            if isinstance(self.master.admission, PooledAdmission):
                self.master.admission.retire(slot.index)
        self._notify()

    async def _supervise(self, index: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep worker ``index`` running: start it, restart it with backoff whenever it exits.

        The first start's failure is raised (a server that cannot serve should say so);
        later ones are logged and retried.
        """
        first = True
        backoff = RESTART_BACKOFF_S[0]
        while True:
            started = trio.current_time()

            def ready(port: int) -> None:
                nonlocal first
                if first:
                    first = False
                    task_status.started(port)

            try:
                await self._run_one(index, ready)
                what = "exited"
            except (WorkerStartError, OSError, ChannelClosed, trio.TooSlowError) as error:
                if first:
                    raise
                what = f"failed: {error}"
            if trio.current_time() - started > STABLE_S:
                backoff = RESTART_BACKOFF_S[0]
            log.warning("gateway worker %d %s; restarting in %gs", index, what, backoff)
            await trio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    async def serve(self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the workers on ``host``:``port`` (0: a free one) until cancelled.

        Reports the bound port once every worker is listening. Raises
        :class:`WorkerStartError` (an ``OSError``) if one cannot start. Cancellation stops
        every worker gracefully (their last usage reaches the master's meter, hence
        :meth:`drain_usage`) before returning.
        """
        self.host = host
        self.port = port
        with unwrap_single_group():
            await self._run(port, task_status)

    async def _run(self, port: int, task_status: trio.TaskStatus[int]) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._pusher)
            # The first worker binds (port 0 picks one); the others join its port.
            self.port = await nursery.start(self._supervise, 0)
            for index in range(1, self.workers):
                await nursery.start(self._supervise, index)
            task_status.started(self.port)


def _copy_messages(copies: Sequence[tuple[str, KvDelta]]) -> Iterator[Message]:
    """Yield a full KV copy's messages: the "kvcopy" header, then each replica's reset
    delta in parts of at most the agent's message size."""
    yield {"t": "kvcopy", "replicas": [replica_id for replica_id, _ in copies]}
    for replica_id, delta in copies:
        for part in split_delta(delta):
            yield {"t": "kv", "replica": replica_id, "delta": encode_kv_delta(part)}
