"""LoRA adapters in the gateway: what a request's ``model`` names, which replicas may
serve it, loading adapters on demand, and the body each engine needs.

Adapter names share the model namespace: a request's ``model`` is a catalog model or an
adapter of one (:meth:`Adapters.resolve`), and its replicas are the parent model's
replicas that list the adapter (:attr:`Replica.adapters <llmgw.router.replicas.Replica>`:
name and path on the node, as the engine loads it). How an adapter reaches the engine
depends on the engine and the model's ``max_loaded_adapters`` (N):

* vLLM and the simulator with N > 0 (*on demand*): the gateway loads an adapter on the
  replica it routes to with ``POST /v1/load_lora_adapter`` and keeps at most N loaded per
  replica. :meth:`Adapters.prefer` narrows the candidates before the routing policy
  picks: replicas that hold the adapter and are not saturated, else the replica already
  loading it, else the least-loaded replica with room. :meth:`Adapters.acquire` then
  makes sure the chosen replica holds it: one load per cold adapter and replica however
  many requests want it at once (the others wait for that load); when the replica holds
  N already, the least recently used adapter with no request in flight is unloaded first
  (``POST /v1/unload_lora_adapter``); if every one is busy the request waits, bounded, for
  one to become idle. What a replica holds is learnt from what the gateway loaded, and
  once per replica from its ``GET /v1/models`` (adapters loaded before this gateway
  started).
* vLLM and the simulator with N = 0: every adapter is registered at start; requests just
  go to the parent's replicas with their body unchanged.
* llama.cpp: every adapter is loaded at start, in the order of ``Replica.adapters`` (ids
  0, 1, ...). llama.cpp applies every loaded adapter to a request that has no ``lora``
  field, so :meth:`Adapters.body_for` gives every request to such a replica an explicit
  one naming all of its adapters: scale 1 for the adapter requested, 0 for the others (all
  0 for the base model). llama.cpp ignores unknown ids silently, so ids a client sends
  itself are checked here.

Nothing here holds a connection; the engine calls go through an :class:`EngineAdmin`
(the gateway's pooled upstream client), each under its own deadline.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

import attrs
import httpx
import trio

from llmgw.spec import LORA_FIELD_ENGINES, ON_DEMAND_ADAPTER_ENGINES

from . import errors
from .auth import Tenant, model_not_allowed
from .replicas import LoadTracker, Replica, ReplicaTable
from .http.upstream import UpstreamClient, UpstreamConnectError, describe_error

if TYPE_CHECKING:
    from .metrics import GatewayMetrics

log = logging.getLogger(__name__)

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
MODELS_PATH = "/v1/models"

# Seconds a replica gets to load an adapter. vLLM reads it from the node's disk (fetched
# with the weights): milliseconds for a small adapter, seconds for a large one on a busy
# engine. Past two minutes the engine is stuck; the requests waiting get a 503.
LOAD_TIMEOUT_S = 120.0

# Seconds a replica gets to unload an adapter (it only drops a registration).
UNLOAD_TIMEOUT_S = 30.0

# Seconds to read a replica's /v1/models the first time an adapter request goes to it
# (adapters loaded before this gateway started). It answers from memory; on timeout the
# gateway assumes nothing is loaded, and vLLM's "already loaded" answer corrects it.
MODELS_TIMEOUT_S = 5.0

# Seconds a request waits for one of the chosen replica's N adapters to become idle
# (no request in flight) so it can be unloaded. Requests last seconds to minutes; waiting
# longer than a typical request only hides a model whose N is too small (503 instead).
SLOT_WAIT_S = 30.0

# A replica holding the adapter is saturated when its requests in flight exceed both
# HOLDER_LOAD_RATIO x and HOLDER_LOAD_SLACK more than the least-loaded candidate's: then
# the adapter is loaded on another replica too. The slack keeps an idle fleet from
# spreading an adapter on every small burst (a load costs a slot and time); the ratio
# lets a busy fleet stay sticky to warm replicas.
HOLDER_LOAD_RATIO = 2.0
HOLDER_LOAD_SLACK = 8

# Characters of an engine's error message kept in the gateway's own error.
ENGINE_MESSAGE_CHARS = 300


@attrs.frozen
class Target:
    """What a request's ``model`` names: ``model`` is the catalog model whose replicas
    serve it, ``adapter`` the adapter's name (None for the base model); ``name`` is the
    name as requested."""

    name: str
    model: str
    adapter: str | None = None


class EngineAdmin(Protocol):
    """Sends the gateway's own small requests to a replica (adapter loads, /v1/models)."""

    async def call(
        self, replica: Replica, method: str, path: str, payload: Mapping[str, Any] | None, request_id: str
    ) -> tuple[int, bytes]:
        """Return (status, body) of ``method path`` on ``replica`` with ``payload`` as JSON.

        No deadline of its own (callers wrap it). Raises :class:`UpstreamConnectError` or
        ``httpx.HTTPError`` when the exchange fails.
        """
        ...


class UpstreamAdmin:
    """:class:`EngineAdmin` over the gateway's pooled :class:`UpstreamClient`.

    ``client()`` returns the client (the gateway's ``upstream_client``, which raises a
    503 GatewayError while the gateway is not serving).
    """

    def __init__(self, client: Callable[[], UpstreamClient]) -> None:
        self._client = client

    async def call(
        self, replica: Replica, method: str, path: str, payload: Mapping[str, Any] | None, request_id: str
    ) -> tuple[int, bytes]:
        """See :meth:`EngineAdmin.call`; closes the response before returning."""
        body = json.dumps(payload).encode() if payload is not None else b""
        return await self._client().call(replica, method, path, body, request_id)


class AdapterHold:
    """One request in flight on one adapter of one replica; :meth:`release` ends it
    (idempotent). While held, the adapter is never unloaded to make room."""

    __slots__ = ("_state", "adapter")

    def __init__(self, state: _ReplicaAdapters | None, adapter: str) -> None:
        self._state = state
        self.adapter = adapter

    def release(self) -> None:
        """Stop counting this request on the adapter; calling it again does nothing."""
        state, self._state = self._state, None
        if state is not None:
            state.release(self.adapter)


#: The hold of every request that needs no adapter bookkeeping (base model, adapters
#: loaded at start): its :meth:`~AdapterHold.release` does nothing. Shared: no allocation
#: on the hot path.
NO_HOLD = AdapterHold(None, "")


class _Pending:
    """One load in progress (single flight): waiters wait on ``done`` then read ``error``."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: str | None = "the load was interrupted"  # cleared on success


class _ReplicaAdapters:
    """What the gateway knows one replica holds: loaded adapters in least-recently-used
    order (oldest first), loads and unloads in progress, requests in flight per adapter."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.loading: dict[str, _Pending] = {}
        self.unloading: dict[str, trio.Event] = {}
        self.in_flight: collections.Counter[str] = collections.Counter()
        # Requests routed here for an adapter and not yet holding it (reading /v1/models,
        # waiting for its load or a slot): later requests for it join them.
        self.wanted: collections.Counter[str] = collections.Counter()
        self.synced: trio.Event | None = None  # set once /v1/models was read (or failed)
        self._changed = trio.Event()

    def occupied(self) -> int:
        """Return the adapter slots in use: loaded plus loading."""
        return len(self.loaded) + len(self.loading)

    def holds(self, adapter: str) -> bool:
        return adapter in self.loaded

    def claimed(self, adapter: str) -> bool:
        """Return whether ``adapter`` is being loaded here or requests here wait for it."""
        return adapter in self.loading or self.wanted[adapter] > 0

    def idle_lru(self) -> str | None:
        """Return the least recently used loaded adapter with nothing in flight, or None."""
        for name in self.loaded:
            if not self.in_flight[name]:
                return name
        return None

    def hold(self, adapter: str) -> AdapterHold:
        self.in_flight[adapter] += 1
        self.loaded.move_to_end(adapter)
        return AdapterHold(self, adapter)

    def release(self, adapter: str) -> None:
        count = self.in_flight[adapter] - 1
        if count > 0:
            self.in_flight[adapter] = count
        else:
            del self.in_flight[adapter]
        if adapter in self.loaded:
            self.loaded.move_to_end(adapter)
        self.notify()

    def notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_change(self) -> None:
        """Return at the next change (a release, a load or unload ending); no deadline."""
        await self._changed.wait()


class Adapters:
    """LoRA routing state and decisions for one gateway (see the module docstring).

    ``table`` gives models' adapters and engines (:meth:`ReplicaTable.model_info`),
    ``load`` the requests in flight per replica, ``admin`` the way to reach engines.
    Synchronous methods do no I/O; :meth:`acquire` is the only one that waits.
    """

    def __init__(
        self,
        table: ReplicaTable,
        load: LoadTracker,
        admin: EngineAdmin,
        *,
        metrics: GatewayMetrics | None = None,
        slot_wait_s: float = SLOT_WAIT_S,
    ) -> None:
        self.table = table
        self.load = load
        self.admin = admin
        self.metrics = metrics
        self.slot_wait_s = slot_wait_s
        self._replicas: dict[str, _ReplicaAdapters] = {}

    # -- names ---------------------------------------------------------------------------

    def resolve(self, name: str, body: Mapping[str, Any] | None = None) -> Target:
        """Return what ``name`` (a request's ``model``) refers to.

        Raises a 404 GatewayError when it is neither a catalog model nor an adapter of
        one, and a 400 when ``body`` names an adapter of a llama.cpp model and also
        carries its own ``lora`` field (the two would contradict each other).
        """
        if self.table.has_model(name):
            return Target(name, name)
        parent = self.table.parent_of(name)
        if parent is None:
            raise errors.model_not_found(name)
        if body is not None and "lora" in body and self.table.model_info(parent).engine in LORA_FIELD_ENGINES:
            raise errors.invalid_request(
                f"'{name}' is an adapter: the gateway sets the 'lora' field for it. Remove 'lora' from "
                f"the request, or name the base model '{parent}' instead.",
                param="lora",
            )
        return Target(name, parent, name)

    # -- candidates ----------------------------------------------------------------------

    def serving(self, target: Target, replicas: Sequence[Replica]) -> Sequence[Replica]:
        """Return the replicas of ``replicas`` that can serve ``target`` (``replicas`` itself for a base model).

        Raises a 503 GatewayError when ``target`` is an adapter that none of them lists.
        """
        if target.adapter is None:
            return replicas
        found = [r for r in replicas if r.adapter_path(target.adapter) is not None]
        if not found and replicas:
            raise errors.adapter_not_served(target.adapter, target.model)
        return found

    def prefer(self, target: Target, replicas: Sequence[Replica]) -> Sequence[Replica]:
        """Return the replicas the routing policy should choose among for ``target``
        (``replicas`` itself unless the adapter is loaded on demand).

        Only on-demand adapters are narrowed (see the module docstring): replicas that
        hold the adapter and are not saturated; else those loading it or about to (their
        load is shared); else the one best replica for a new load: least loaded, then a
        free slot over an idle adapter to unload, then fewest adapters, then first in
        ``replicas`` (a deterministic pick, so concurrent cold requests agree even when
        the policy awaits before :meth:`acquire` claims the replica); else the
        least-loaded holders; else the least-loaded of all. ``replicas`` must be
        already filtered by :meth:`serving`; the result is non-empty when they are.
        """
        adapter = target.adapter
        if adapter is None or not replicas or not self._on_demand(replicas[0], target):
            return replicas
        loads = {r.id: self.load.outstanding(r.id) for r in replicas}
        least = min(loads.values())
        limit = max(least * HOLDER_LOAD_RATIO, least + HOLDER_LOAD_SLACK)
        states = {r.id: self._replicas.get(r.id) for r in replicas}
        holders = [r for r in replicas if (s := states[r.id]) is not None and s.holds(adapter)]
        fresh = [r for r in holders if loads[r.id] <= limit]
        if fresh:
            return fresh
        loading = [r for r in replicas if (s := states[r.id]) is not None and s.claimed(adapter)]
        if loading:
            return loading
        slots = self._limit(target.model)
        best: tuple[tuple[int, int, int, int], Replica] | None = None
        for index, r in enumerate(replicas):
            s = states[r.id]
            if r in holders:
                continue
            occupied = s.occupied() if s is not None else 0
            if occupied >= slots and (s is None or s.idle_lru() is None):
                continue  # full, every adapter busy
            key = (loads[r.id], 0 if occupied < slots else 1, occupied, index)
            if best is None or key < best[0]:
                best = (key, r)
        if best is not None:
            return [best[1]]
        pool = holders or list(replicas)
        fewest = min(loads[r.id] for r in pool)
        return [r for r in pool if loads[r.id] == fewest]

    # -- loading ---------------------------------------------------------------------------

    async def acquire(self, replica: Replica, target: Target, request_id: str) -> AdapterHold:
        """Make sure ``replica`` holds ``target``'s adapter; return the hold that counts the request on it.

        Release the hold when the request ends. For anything but an on-demand adapter
        this returns at once with a hold that does nothing. Loads the adapter if needed
        (unloading the least recently used idle one when the replica is full, waiting at
        most ``slot_wait_s`` for one to become idle); requests for an adapter being loaded
        wait for that load.

        Raises a 503 GatewayError when the load fails (the engine's words in the message)
        or no slot became free in time. Cancellation abandons the wait; a load or unload
        already sent runs to its end (shielded, bounded by its deadline) so what the
        gateway believes the replica holds stays true.
        """
        adapter = target.adapter
        if adapter is None or not self._on_demand(replica, target):
            return NO_HOLD
        state = self._state(replica)
        state.wanted[adapter] += 1  # before any wait: later requests for it join this replica
        try:
            return await self._acquire(replica, state, target.model, adapter, request_id)
        finally:
            state.wanted[adapter] -= 1
            if state.wanted[adapter] <= 0:
                del state.wanted[adapter]

    async def _acquire(
        self, replica: Replica, state: _ReplicaAdapters, model: str, adapter: str, request_id: str
    ) -> AdapterHold:
        """:meth:`acquire`'s work for an on-demand adapter (same results and errors)."""
        await self._sync(replica, state, request_id)
        slots = self._limit(model)
        give_up = trio.current_time() + self.slot_wait_s
        while True:
            if state.holds(adapter):
                return state.hold(adapter)
            pending = state.loading.get(adapter)
            if pending is not None:
                await pending.done.wait()  # the loader's deadlines bound this wait
                if pending.error is not None:
                    raise errors.adapter_load_failed(adapter, replica.id, pending.error)
                continue
            victim = None
            if state.occupied() >= slots:
                victim = state.idle_lru()
                if victim is None:
                    with trio.move_on_at(give_up) as waiting:
                        await state.wait_change()
                    if waiting.cancelled_caught:
                        raise errors.adapter_capacity(adapter, replica.id, len(state.loaded), self.slot_wait_s)
                    continue
            failure = await self._load(replica, state, adapter, victim, request_id)
            if failure is not None:
                raise errors.adapter_load_failed(adapter, replica.id, failure)

    def engine_answered(self, replica: Replica, target: Target, status: int) -> bool:
        """Note the engine's answer to a forwarded request; return whether the adapter was lost.

        A 404 for an adapter the gateway believed loaded means the replica no longer
        holds it (the engine restarted, or another gateway worker unloaded it): it is
        forgotten, so the next :meth:`acquire` loads it again, and True is returned (the
        caller may retry the request).
        """
        adapter = target.adapter
        if status != 404 or adapter is None:
            return False
        state = self._replicas.get(replica.id)
        if state is None or adapter not in state.loaded:
            return False
        log.warning("replica %s answered 404 for adapter %s, which it had loaded: loading it again",
                    replica.id, adapter)
        del state.loaded[adapter]
        state.notify()
        return True

    def loaded(self, replica_id: str) -> tuple[str, ...]:
        """Return the adapters the gateway believes ``replica_id`` holds, least recently used first."""
        state = self._replicas.get(replica_id)
        return tuple(state.loaded) if state is not None else ()

    async def _load(
        self, replica: Replica, state: _ReplicaAdapters, adapter: str, victim: str | None, request_id: str
    ) -> str | None:
        """Load ``adapter`` on ``replica`` (after unloading ``victim``), as the one load
        others wait for. Returns None once ``state`` records it loaded, else why it is not
        (waiters read the same from ``_Pending.error``); never raises for engine failures."""
        pending = state.loading[adapter] = _Pending()
        unloaded: trio.Event | None = None
        if victim is not None:
            del state.loaded[victim]
            unloaded = state.unloading[victim] = trio.Event()
        try:
            with trio.CancelScope(shield=True):
                if victim is not None:
                    failure = await self._unload(replica, victim, request_id)
                    if failure is not None:
                        state.loaded[victim] = None
                        state.loaded.move_to_end(victim, last=False)
                        pending.error = f"could not unload '{victim}' to make room: {failure}"
                        return pending.error
                earlier = state.unloading.get(adapter)
                if earlier is not None:  # another request is unloading this very adapter
                    with trio.move_on_after(UNLOAD_TIMEOUT_S):
                        await earlier.wait()
                pending.error = await self._send_load(replica, adapter, request_id)
        finally:
            if victim is not None and unloaded is not None:
                state.unloading.pop(victim, None)
                unloaded.set()
            del state.loading[adapter]
            if pending.error is None:
                state.loaded[adapter] = None
            pending.done.set()
            state.notify()
        return pending.error

    async def _send_load(self, replica: Replica, adapter: str, request_id: str) -> str | None:
        """POST the load; return None when the replica holds ``adapter`` afterwards, else why not."""
        path = replica.adapter_path(adapter)
        if path is None:
            return f"the replica does not list the adapter '{adapter}'"
        started = time.monotonic()
        error: str | None
        try:
            with trio.fail_after(LOAD_TIMEOUT_S):
                status, body = await self.admin.call(
                    replica, "POST", LOAD_PATH, {"lora_name": adapter, "lora_path": path}, request_id)
        except trio.TooSlowError:
            error = f"no answer to {LOAD_PATH} within {LOAD_TIMEOUT_S:g}s"
        except (UpstreamConnectError, httpx.HTTPError, errors.GatewayError) as exc:
            error = _describe(exc)
        else:
            if status == 200 or (status == 400 and b"already" in body.lower()):
                error = None  # vLLM answers 400 when it holds the adapter already
            else:
                error = f"{LOAD_PATH} answered {status}: {engine_message(body)}"
        if self.metrics is not None:
            if error is None:
                self.metrics.adapter_loaded(adapter, time.monotonic() - started)
            else:
                self.metrics.adapter_load_failed(adapter)
        if error is None:
            log.info("replica %s loaded adapter %s", replica.id, adapter)
        else:
            log.warning("replica %s could not load adapter %s: %s", replica.id, adapter, error)
        return error

    async def _unload(self, replica: Replica, adapter: str, request_id: str) -> str | None:
        """POST the unload; return None when the replica no longer holds ``adapter``, else why not."""
        try:
            with trio.fail_after(UNLOAD_TIMEOUT_S):
                status, body = await self.admin.call(replica, "POST", UNLOAD_PATH, {"lora_name": adapter}, request_id)
        except trio.TooSlowError:
            return f"no answer to {UNLOAD_PATH} within {UNLOAD_TIMEOUT_S:g}s"
        except (UpstreamConnectError, httpx.HTTPError, errors.GatewayError) as exc:
            return _describe(exc)
        if status not in (200, 404):  # 404: not loaded (any more), which is what was wanted
            return f"{UNLOAD_PATH} answered {status}: {engine_message(body)}"
        if self.metrics is not None:
            self.metrics.adapter_unloaded(adapter)
        log.info("replica %s unloaded adapter %s (least recently used, idle)", replica.id, adapter)
        return None

    async def _sync(self, replica: Replica, state: _ReplicaAdapters, request_id: str) -> None:
        """Learn, once per replica, which adapters it already holds from its /v1/models."""
        if state.synced is not None:
            await state.synced.wait()  # set within MODELS_TIMEOUT_S by whoever started it
            return
        done = state.synced = trio.Event()
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(MODELS_TIMEOUT_S) as deadline:
                status, body = await self.admin.call(replica, "GET", MODELS_PATH, None, request_id)
                if status == 200:
                    for name in adapters_listed(body):
                        if name not in state.loaded and name not in state.loading:
                            state.loaded[name] = None
                            state.loaded.move_to_end(name, last=False)  # older than anything used here
                else:
                    log.warning("replica %s: %s answered %d; assuming no adapter is loaded",
                                replica.id, MODELS_PATH, status)
            if deadline.cancelled_caught:
                log.warning("replica %s: no answer to %s within %gs; assuming no adapter is loaded",
                            replica.id, MODELS_PATH, MODELS_TIMEOUT_S)
        except (UpstreamConnectError, httpx.HTTPError, errors.GatewayError) as exc:
            log.warning("replica %s: cannot read %s (%s); assuming no adapter is loaded",
                        replica.id, MODELS_PATH, _describe(exc))
        finally:
            done.set()
            state.notify()

    def _state(self, replica: Replica) -> _ReplicaAdapters:
        """Return ``replica``'s state, fresh if it is new or moved; drops departed replicas'."""
        state = self._replicas.get(replica.id)
        if state is None or state.endpoint != replica.endpoint:
            present = {r.id for m in self.table.models() for r in self.table.replicas(m.name) or ()}
            for gone in [rid for rid in self._replicas if rid not in present]:
                del self._replicas[gone]
            state = self._replicas[replica.id] = _ReplicaAdapters(replica.endpoint)
        return state

    def _on_demand(self, replica: Replica, target: Target) -> bool:
        info = self.table.model_info(target.model)
        return info.max_loaded_adapters > 0 and (replica.engine or info.engine) in ON_DEMAND_ADAPTER_ENGINES

    def _limit(self, model: str) -> int:
        return max(1, self.table.model_info(model).max_loaded_adapters)

    # -- bodies ----------------------------------------------------------------------------

    def body_for(self, replica: Replica, target: Target, body: bytes, tenant: Tenant) -> bytes:
        """Return the request body to send to ``replica`` for ``target`` (``body`` itself
        when nothing changes).

        Only requests to llama.cpp replicas that load adapters get a different body: one
        with a ``lora`` field naming every adapter of the replica (see the module
        docstring). A client's own ``lora`` field on a base-model request is kept (ids not
        in it get scale 0) if every entry names one of the replica's adapters by id with a
        numeric scale, and each adapter it applies (scale not 0) is one ``tenant`` may use.
        Raises a 400 GatewayError for a malformed or unknown entry, a 403 for a forbidden
        adapter.
        """
        if (replica.engine or self.table.model_info(target.model).engine) not in LORA_FIELD_ENGINES:
            return body
        names = [name for name, _ in replica.adapters]
        if not names and b'"lora"' not in body:
            return body  # the common case: a replica without adapters, nothing to check
        parsed = json.loads(body)
        if target.adapter is not None:
            if "lora" in parsed:  # resolve() refuses these when the model's engine is known
                raise errors.invalid_request(
                    f"'{target.name}' is an adapter: remove 'lora' from the request.", param="lora")
            if target.adapter not in names:  # serving() filtered these out; the table changed since
                raise errors.adapter_not_served(target.adapter, target.model)
            parsed["lora"] = lora_field(names, {target.adapter: 1.0})
        elif "lora" in parsed:
            parsed["lora"] = lora_field(names, checked_lora_scales(parsed["lora"], names, tenant))
        else:
            parsed["lora"] = lora_field(names, {})
        return json.dumps(parsed).encode()

    # -- listing ---------------------------------------------------------------------------

    def model_objects(self, tenant: Tenant) -> list[dict[str, Any]]:
        """Return the OpenAI model objects ``tenant`` may use: models, then each one's adapters."""
        out = []
        for entry in self.table.models():
            if tenant.allows(entry.name):
                out.append(model_object(entry.name, entry.created))
            for adapter in self.table.model_info(entry.name).adapters:
                if tenant.allows(adapter):
                    out.append(model_object(adapter, entry.created, parent=entry.name))
        return out

    def model_object_of(self, name: str, tenant: Tenant) -> dict[str, Any] | None:
        """Return the model object of ``name`` (a model or an adapter) if ``tenant`` may use it, else None."""
        if not tenant.allows(name):
            return None
        for entry in self.table.models():
            if entry.name == name:
                return model_object(name, entry.created)
        parent = self.table.parent_of(name)
        if parent is None:
            return None
        created = next((m.created for m in self.table.models() if m.name == parent), 0)
        return model_object(name, created, parent=parent)


# -- pure helpers ---------------------------------------------------------------------------


def model_object(name: str, created: int, *, parent: str | None = None) -> dict[str, Any]:
    """Return an OpenAI model object; an adapter has its model as ``parent`` (as vLLM lists them)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "llmgw", "root": name, "parent": parent}


def lora_field(names: Sequence[str], scales: Mapping[str, float]) -> list[dict[str, Any]]:
    """Return llama.cpp's per-request ``lora`` value: each of ``names`` by id, with its scale
    in ``scales`` or 0 (an adapter left out of the field would get the engine's global scale, 1)."""
    return [{"id": i, "scale": float(scales.get(name, 0.0))} for i, name in enumerate(names)]


def checked_lora_scales(value: Any, names: Sequence[str], tenant: Tenant) -> dict[str, float]:
    """Return the adapter scales of a client's own llama.cpp ``lora`` field, by adapter name.

    ``names`` are the replica's adapters in id order. Raises a 400 GatewayError unless
    ``value`` is a list of ``{"id": int, "scale": number}`` with ids in range, and a 403
    when it applies an adapter ``tenant`` may not use.
    """
    hint = "Name the adapter as the request's 'model' instead (GET /v1/models lists them)."
    if not isinstance(value, list):
        raise errors.invalid_request(f"'lora' must be a list of {{\"id\", \"scale\"}} objects. {hint}", param="lora")
    scales: dict[str, float] = {}
    for entry in value:
        ident = entry.get("id") if isinstance(entry, dict) else None
        scale = entry.get("scale", 1.0) if isinstance(entry, dict) else None
        if not isinstance(ident, int) or isinstance(ident, bool) or not 0 <= ident < len(names):
            raise errors.invalid_request(
                f"'lora' entry {errors.echo(entry)} does not name one of this model's {len(names)} adapters "
                f"by id. {hint}",
                param="lora",
            )
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
            raise errors.invalid_request(
                f"'lora' entry {errors.echo(entry)} needs a finite numeric 'scale'.", param="lora")
        if scale != 0 and not tenant.allows(names[ident]):
            raise model_not_allowed(tenant.name, names[ident])
        scales[names[ident]] = float(scale)
    return scales


def adapters_listed(body: bytes) -> list[str]:
    """Return the adapter ids in a vLLM ``/v1/models`` answer (cards with a ``parent``); [] if unreadable."""
    try:
        data = json.loads(body).get("data")
    except (ValueError, AttributeError):
        return []
    if not isinstance(data, list):
        return []
    return [c["id"] for c in data if isinstance(c, dict) and c.get("parent") and isinstance(c.get("id"), str)]


def engine_message(body: bytes) -> str:
    """Return the message of an engine's error body (OpenAI or FastAPI shape, or plain text), shortened."""
    text = body.decode("utf-8", "replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        inner = parsed.get("error", parsed)
        if isinstance(inner, dict):
            for key in ("message", "detail"):
                if isinstance(inner.get(key), str):
                    text = inner[key]
                    break
    if len(text) > ENGINE_MESSAGE_CHARS:
        text = text[:ENGINE_MESSAGE_CHARS] + "..."
    return text or "(empty answer)"


def _describe(error: BaseException) -> str:
    return error.message if isinstance(error, errors.GatewayError) else describe_error(error)

