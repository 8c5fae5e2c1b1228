"""Admission control: whether a request may go to a replica now, later, or not at all.

Runs after authentication and before routing. Two layers:

* per tenant (limits from :class:`~llmgw.router.auth.Tenant`, applied live): requests in
  flight (``max_concurrency``), requests per minute (``rpm``) and tokens per minute
  (``tpm``). The token budget is charged an estimate when the request is admitted
  (prompt characters / 4 + ``max_tokens``) and corrected with the engine's ``usage``
  when the answer is done (:meth:`Ticket.settle`). A request over any tenant limit is
  shed at once: 429 with Retry-After.
* per model: at most ``ready replicas x max_inflight_per_replica`` requests in flight;
  beyond that up to ``queue_size`` wait in FIFO order for a slot, each for at most
  ``queue_timeout`` seconds (then 503 with Retry-After); a full queue sheds (429).

Several gateways (one per control plane, :mod:`llmgw.control.admission_shares`) share
each tenant's limits: this gateway enforces its *share* of each, ``ceil(limit x
fraction)`` (:class:`AdmissionShares`, set live by :meth:`Admission.set_shares`; 1 with a
single control plane), divided among its worker processes (``tenant_parts``): see
:func:`tenant_limit`.

Per-tenant counts of admitted, queued and shed requests (and of the tokens asked for) are
kept for ``llmgw ctl status`` and the control plane's share computation
(:meth:`Admission.snapshot`, :func:`demand_since`). Time is ``trio.current_time()``, so tests drive it
with ``trio.testing.MockClock``. Everything runs on the trio thread; only
:meth:`Admission.admit` waits (while queued).
"""

from __future__ import annotations

import collections
import math
from typing import Any, Callable, Mapping

import attrs
import trio

from llmgw.config.defaults import DEFAULT_MAX_INFLIGHT_PER_REPLICA, DEFAULT_QUEUE_SIZE, DEFAULT_QUEUE_TIMEOUT

from .auth import Tenant
from .errors import GatewayError

# The per-model limits (in flight per replica, queue size, queue timeout) are server.yaml's
# ``serving:`` section; their defaults and reasons are in llmgw.config.defaults.

#: Completion tokens assumed when a request does not say (``max_tokens``) how many it
#: wants; corrected by the real count when the answer is done.
DEFAULT_COMPLETION_ESTIMATE = 256
#: Characters per token in the prompt estimate (English text with BPE tokenizers).
CHARS_PER_TOKEN = 4
#: Retry-After, in seconds, when a tenant is at its concurrency limit: a slot frees when
#: one of its own requests finishes, which the gateway cannot predict.
CONCURRENCY_RETRY_AFTER_S = 1
#: Retry-After, in seconds, when a model's queue is full or a queued request timed out.
QUEUE_RETRY_AFTER_S = 2
#: Retry-After, in seconds, while an operator has stopped serving: stops are usually
#: maintenance of minutes, and clients should not hammer a stopped cluster.
STOPPED_RETRY_AFTER_S = 30
#: Slack when a share of a limit is rounded up: shares are sums of floats, and 4 x 0.5
#: computed as 2.0000000001 must still allow 2 requests, not 3.
SHARE_ROUNDING_SLACK = 1e-9


@attrs.frozen
class AdmissionLimits:
    """The per-model limits (server.yaml ``serving``; defaults in llmgw.config.defaults)."""

    max_inflight_per_replica: int = DEFAULT_MAX_INFLIGHT_PER_REPLICA
    queue_size: int = DEFAULT_QUEUE_SIZE
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT
    #: The gateway's worker processes: each enforces this part of the gateway's share of
    #: every tenant limit (``gateway.workers``; 1 for a gateway in one process).
    tenant_parts: int = 1


@attrs.define
class TenantCounters:
    """Counts for one tenant since the gateway started; ``in_flight`` includes queued requests.

    ``tokens`` is the tokens asked for by tenants with a token budget: the estimate charged
    to each admitted request, and that of each request shed over the budget.
    """

    admitted: int = 0
    queued: int = 0
    shed: int = 0
    in_flight: int = 0
    tokens: int = 0


@attrs.frozen
class TenantDemand:
    """What one tenant asked of one gateway over a window (a share computation's input).

    ``in_flight``: requests admitted or queued at the window's end; ``admitted``,
    ``shed`` and ``tokens`` (see :class:`TenantCounters`): during the window.
    """

    in_flight: int = 0
    admitted: int = 0
    shed: int = 0
    tokens: int = 0


def demand_since(
    before: Mapping[str, TenantCounters], now: Mapping[str, TenantCounters]
) -> dict[str, TenantDemand]:
    """Return each tenant's demand between two :meth:`Admission.snapshot` values, leaving out
    tenants with none (nothing in flight, nothing counted)."""
    out = {}
    zero = TenantCounters()
    for name, c in now.items():
        b = before.get(name, zero)
        demand = TenantDemand(max(0, c.in_flight), max(0, c.admitted - b.admitted), max(0, c.shed - b.shed),
                              max(0, c.tokens - b.tokens))
        if demand != _NO_DEMAND:
            out[name] = demand
    return out


_NO_DEMAND = TenantDemand()


@attrs.frozen
class TenantShare:
    """One gateway's fractions of one tenant's limits, each in (0, 1]."""

    concurrency: float = 1.0
    rpm: float = 1.0
    tpm: float = 1.0


@attrs.frozen
class AdmissionShares:
    """One gateway's shares of every tenant's limits: ``tenants`` by name, and ``default``
    (the same fraction of each limit) for every tenant not named there."""

    default: float = 1.0
    tenants: Mapping[str, TenantShare] = attrs.field(factory=dict)

    def of(self, tenant: str) -> TenantShare:
        """Return ``tenant``'s share."""
        share = self.tenants.get(tenant)
        if share is None:
            return TenantShare(self.default, self.default, self.default)
        return share


def tenant_limit(limit: int, fraction: float, parts: int = 1) -> int:
    """Return one worker's part of a tenant ``limit``: ``ceil(ceil(limit x fraction) / parts)``.

    0 (unlimited) stays 0; any other limit gives at least 1, so every gateway can admit a
    request however small its share. Summed over G gateways of W workers whose fractions
    add up to at most 1, the parts are at most ``limit + G x W - 1`` (docs/ha.md).
    """
    if not limit:
        return 0
    share = max(1, math.ceil(limit * fraction - SHARE_ROUNDING_SLACK))
    return max(1, -(-share // parts))


def too_many(message: str, code: str, retry_after: float) -> GatewayError:
    """429 with Retry-After (whole seconds, at least 1)."""
    return GatewayError(
        429, message, "rate_limit_error", code=code,
        headers={"Retry-After": str(_whole_seconds(retry_after))},
    )


def _limit_words(what: str, enforced: int, configured: int) -> str:
    """Return ``what``, saying when ``enforced`` is only this gateway's part of ``configured``."""
    if enforced == configured:
        return what
    return f"this gateway's share of {what} of {configured}"


def _share_words(enforced: int, configured: int) -> str:
    """Return "" or, when ``enforced`` is only this gateway's part, the configured limit in words."""
    return "" if enforced == configured else f" (this gateway's share of {configured})"


def _whole_seconds(seconds: float) -> int:
    """Return ``seconds`` rounded up to a whole second, at least 1 (float noise ignored)."""
    return max(1, math.ceil(seconds - 1e-6))


def system_stopped() -> GatewayError:
    """503 with Retry-After: an operator stopped serving (cluster setting ``serving.stopped``)."""
    return GatewayError(
        503,
        "Serving is stopped on this cluster by an operator (serving.stopped); "
        f"retry in {STOPPED_RETRY_AFTER_S} seconds. `llmgw ctl start` resumes it.",
        "service_unavailable",
        code="system_stopped",
        headers={"Retry-After": str(STOPPED_RETRY_AFTER_S)},
    )


def request_too_large(limit: int) -> GatewayError:
    """413: the request body is larger than ``limit`` bytes (server.yaml ``serving.max_request_bytes``)."""
    return GatewayError(
        413,
        f"The request body is larger than this gateway accepts ({limit} bytes).",
        "invalid_request_error",
        code="request_too_large",
    )


def queue_timeout(model: str, waited: float) -> GatewayError:
    """503 with Retry-After: a queued request waited its whole deadline for a slot."""
    return GatewayError(
        503,
        f"Every replica of '{model}' stayed busy for {waited:g}s while this request waited; "
        f"retry in {QUEUE_RETRY_AFTER_S} seconds, or ask an operator for more replicas.",
        "service_unavailable",
        code="queue_timeout",
        headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)},
    )


def estimate_tokens(body: object) -> int:
    """Return a cheap upper-ish estimate of the tokens a request will use (prompt + completion)."""
    if not isinstance(body, dict):
        return DEFAULT_COMPLETION_ESTIMATE
    chars = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p.get("text", "")) for p in content if isinstance(p, dict)
                             and isinstance(p.get("text"), str))
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, list):
            chars += sum(len(v) if isinstance(v, str) else 1 for v in value)
    completion = body.get("max_tokens", body.get("max_completion_tokens"))
    if isinstance(completion, bool) or not isinstance(completion, int) or completion < 0:
        completion = 0 if "input" in body else DEFAULT_COMPLETION_ESTIMATE
    return chars // CHARS_PER_TOKEN + 1 + completion


#: Shed reasons (metric labels) by the error code of the 429.
_SHED_REASONS = {
    "concurrency_limit_exceeded": "concurrency",
    "rate_limit_exceeded": "rpm",
    "tokens_limit_exceeded": "tpm",
}


class _Budget:
    """A token bucket holding at most one minute of ``per_minute``; refills continuously."""

    def __init__(self) -> None:
        self.level: float | None = None  # None: full (set on first use)
        self.updated = 0.0

    def _refill(self, per_minute: int, now: float) -> float:
        if self.level is None:
            self.level = float(per_minute)
        else:
            self.level = min(float(per_minute), self.level + (now - self.updated) * per_minute / 60.0)
        self.updated = now
        return self.level

    def wait_for(self, amount: float, per_minute: int, now: float) -> float:
        """Return seconds until ``amount`` is available (0 if it is now)."""
        level = self._refill(per_minute, now)
        return 0.0 if level >= amount else (amount - level) * 60.0 / per_minute

    def take(self, amount: float) -> None:
        assert self.level is not None
        self.level -= amount

    def give_back(self, amount: float) -> None:
        if self.level is not None:
            self.level += amount


class _TenantState:
    def __init__(self) -> None:
        self.counters = TenantCounters()
        self.requests = _Budget()
        self.tokens = _Budget()
        # The limits this gateway enforces (max_concurrency, rpm, tpm), worked out for
        # ``limits_of`` at shares version ``limits_version`` (recomputed when either changes).
        self.limits_of: Tenant | None = None
        self.limits_version = -1
        self.limits = (0, 0, 0)


class _ModelGate:
    """Slots for one model and the FIFO of requests waiting for one."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.capacity = 0
        self.waiters: collections.deque[trio.Event] = collections.deque()

    def release(self) -> None:
        self.in_flight -= 1
        while self.waiters and self.in_flight < self.capacity:
            self.in_flight += 1  # handed over: the waiter owns this slot once woken
            self.waiters.popleft().set()


class Ticket:
    """An admitted request. :meth:`release` when it is finished (idempotent); :meth:`settle`
    with the tokens it really used."""

    __slots__ = ("_tenant", "_gate", "_tpm_charge", "_released")

    def __init__(self, tenant: _TenantState, gate: _ModelGate, tpm_charge: float) -> None:
        self._tenant = tenant
        self._gate = gate
        self._tpm_charge = tpm_charge
        self._released = False

    def settle(self, tokens: int) -> None:
        """Correct the tenant's token budget from the estimate to ``tokens`` (once)."""
        if self._tpm_charge:
            self._tenant.tokens.give_back(self._tpm_charge - tokens)
            self._tpm_charge = 0.0

    def release(self) -> None:
        """Free the tenant's and the model's slot; calling it again does nothing."""
        if not self._released:
            self._released = True
            self._tenant.counters.in_flight -= 1
            self._gate.release()


class Admission:
    """Tenant budgets and per-model queues for one gateway (see the module docstring)."""

    def __init__(self, limits: AdmissionLimits = AdmissionLimits(), *, metrics: Any = None) -> None:
        self.limits = limits
        #: A :class:`~llmgw.router.metrics.GatewayMetrics` (or None): told of every
        #: admitted, queued and shed request.
        self.metrics = metrics
        self._tenants: dict[str, _TenantState] = {}
        self._models: dict[str, _ModelGate] = {}
        #: This gateway's shares of the tenants' limits (:meth:`set_shares`).
        self.shares = AdmissionShares()
        self._shares_version = 0

    def set_shares(self, shares: AdmissionShares) -> None:
        """Enforce ``shares`` of every tenant's limits from the next request on.

        Requests already admitted keep running; a token bucket larger than its new size is
        cut down to it when next used.
        """
        self.shares = shares
        self._shares_version += 1

    def tenant_limits(self, tenant: Tenant) -> tuple[int, int, int]:
        """Return the ``(max_concurrency, rpm, tpm)`` this gateway (this worker) enforces
        for ``tenant`` now (0: unlimited)."""
        state = self._tenants.get(tenant.name)
        if state is None:
            state = self._tenants[tenant.name] = _TenantState()
        return self._limits(tenant, state)

    def _limits(self, tenant: Tenant, state: _TenantState) -> tuple[int, int, int]:
        if state.limits_of is not tenant or state.limits_version != self._shares_version:
            share = self.shares.of(tenant.name)
            parts = self.limits.tenant_parts
            state.limits = (tenant_limit(tenant.max_concurrency, share.concurrency, parts),
                            tenant_limit(tenant.rpm, share.rpm, parts), tenant_limit(tenant.tpm, share.tpm, parts))
            state.limits_of = tenant
            state.limits_version = self._shares_version
        return state.limits

    async def admit(
        self, tenant: Tenant, model: str, ready_replicas: int, estimate: Callable[[], int]
    ) -> Ticket:
        """Return a :class:`Ticket` once ``tenant``'s request for ``model`` may be sent.

        ``estimate`` is called only when the tenant has a token budget. Returns at once
        when a slot is free; otherwise waits in the model's queue. Raises a 429
        :class:`GatewayError` (with Retry-After) when a tenant limit is reached or the
        queue is full, and a 503 when the queue deadline passes. Cancellation while
        queued leaves the queue and frees everything taken.
        """
        state = self._tenants.get(tenant.name)
        if state is None:
            state = self._tenants[tenant.name] = _TenantState()
        counters = state.counters
        try:
            tpm_charge = self._check_tenant(tenant, state, estimate)
        except GatewayError as error:
            self._shed(counters, tenant.name, model, _SHED_REASONS.get(error.code or "", "limit"))
            raise
        gate = self._models.get(model)
        if gate is None:
            gate = self._models[model] = _ModelGate()
        gate.capacity = ready_replicas * self.limits.max_inflight_per_replica
        if gate.in_flight < gate.capacity and not gate.waiters:
            gate.in_flight += 1
        else:
            if len(gate.waiters) >= self.limits.queue_size:
                self._shed(counters, tenant.name, model, "queue_full")
                raise too_many(
                    f"The model '{model}' is at capacity and its queue is full "
                    f"({self.limits.queue_size} waiting); retry in {QUEUE_RETRY_AFTER_S} seconds.",
                    "queue_full", QUEUE_RETRY_AFTER_S,
                )
            counters.queued += 1
            counters.in_flight += 1  # queued requests count against the tenant's concurrency
            metrics = self.metrics
            if metrics is not None:
                metrics.queued(tenant.name, model, 1)
            try:
                await self._wait(gate, model)
            except GatewayError:
                self._shed(counters, tenant.name, model, "queue_timeout")
                raise
            finally:
                counters.in_flight -= 1
                if metrics is not None:
                    metrics.queued(tenant.name, model, -1)
        self._charge(tenant, state, tpm_charge)
        counters.in_flight += 1
        counters.admitted += 1
        if self.metrics is not None:
            self.metrics.admitted(tenant.name, model)
        return Ticket(state, gate, tpm_charge)

    def _shed(self, counters: TenantCounters, tenant: str, model: str, reason: str) -> None:
        counters.shed += 1
        if self.metrics is not None:
            self.metrics.shed(tenant, model, reason)

    def _check_tenant(self, tenant: Tenant, state: _TenantState, estimate: Callable[[], int]) -> float:
        """Raise 429 if a tenant limit is reached; return the token charge (0 without a budget)."""
        concurrency, rpm, tpm = self._limits(tenant, state)
        if concurrency and state.counters.in_flight >= concurrency:
            raise too_many(
                f"Tenant '{tenant.name}' already has {concurrency} requests in flight "
                f"({_limit_words('its concurrency limit', concurrency, tenant.max_concurrency)}); "
                "retry when one finishes.",
                "concurrency_limit_exceeded", CONCURRENCY_RETRY_AFTER_S,
            )
        now = trio.current_time()
        if rpm:
            wait = state.requests.wait_for(1, rpm, now)
            if wait:
                raise too_many(
                    f"Tenant '{tenant.name}' is over its limit of {rpm} requests per minute"
                    f"{_share_words(rpm, tenant.rpm)}; retry in {_whole_seconds(wait)} seconds.",
                    "rate_limit_exceeded", wait,
                )
        charge = 0.0
        if tpm:
            charge = float(min(estimate(), tpm))
            wait = state.tokens.wait_for(charge, tpm, now)
            if wait:
                state.counters.tokens += int(charge)  # asked for: the demand the shares follow
                raise too_many(
                    f"Tenant '{tenant.name}' is over its limit of {tpm} tokens per minute"
                    f"{_share_words(tpm, tenant.tpm)} (this request needs about {charge:g}); "
                    f"retry in {_whole_seconds(wait)} seconds.",
                    "tokens_limit_exceeded", wait,
                )
        return charge

    def _charge(self, tenant: Tenant, state: _TenantState, tpm_charge: float) -> None:
        now = trio.current_time()
        _, rpm, tpm = self._limits(tenant, state)
        if rpm:
            state.requests.wait_for(1, rpm, now)  # refill up to now first
            state.requests.take(1)
        if tpm_charge and tpm:  # (the tenant may have lost its budget while queued)
            state.tokens.wait_for(tpm_charge, tpm, now)
            state.tokens.take(tpm_charge)
            state.counters.tokens += int(tpm_charge)

    async def _wait(self, gate: _ModelGate, model: str) -> None:
        """Wait in ``gate``'s FIFO until handed a slot; 503 after the queue timeout."""
        woken = trio.Event()
        gate.waiters.append(woken)
        timeout = self.limits.queue_timeout
        try:
            with trio.move_on_after(timeout):
                await woken.wait()
        except BaseException:
            if woken.is_set():
                gate.release()  # handed a slot just as we were cancelled: pass it on
            else:
                gate.waiters.remove(woken)
            raise
        if not woken.is_set():
            gate.waiters.remove(woken)
            raise queue_timeout(model, timeout)

    def snapshot(self) -> dict[str, TenantCounters]:
        """Return a copy of every tenant's counters, by tenant name."""
        return {name: attrs.evolve(state.counters) for name, state in self._tenants.items()}

    def queue_depth(self, model: str) -> int:
        """Return how many requests are waiting for a slot of ``model``."""
        gate = self._models.get(model)
        return len(gate.waiters) if gate is not None else 0

    def in_flight(self, model: str) -> int:
        """Return how many admitted requests of ``model`` hold a slot."""
        gate = self._models.get(model)
        return gate.in_flight if gate is not None else 0
