"""Waiting for an engine to finish the requests it has in flight (a rollout's drain, agent side).

The control plane has taken the replica out of routing; :func:`drain` polls the engine's
in-flight count (its adapter's :class:`~llmgw.node.engines.load.InFlightProbe`) until it is
0 or the time is up. An engine that cannot say (no probe, or a probe that fails) gets the
old fixed wait instead, :data:`DRAIN_FALLBACK_S`, and the log says so.
"""

from __future__ import annotations

import logging

import attrs
import httpx
import trio

from llmgw.node.engines.load import InFlightProbe

__all__ = ["DRAIN_FALLBACK_S", "DRAIN_POLL_S", "DRAIN_PROBE_TIMEOUT_S", "DrainResult", "drain"]

log = logging.getLogger(__name__)

# Between two reads of the engine's count: the last request's end is seen within this, and a
# few reads a second cost the engine nothing next to a request.
DRAIN_POLL_S = 0.2
# One read of the count; an engine that does not answer within this is counted as unable to say
# (a busy engine still answers its metrics in milliseconds).
DRAIN_PROBE_TIMEOUT_S = 2.0
# An engine that cannot say how busy it is is given this long, as every rollout was before the
# drain read the engine: enough for the route change to reach every gateway and short requests
# to end; a longer stream is cut.
DRAIN_FALLBACK_S = 5.0


@attrs.frozen
class DrainResult:
    """``idle``: the engine said it had nothing in flight (or, ``probed`` False, the fixed
    fallback wait passed); ``in_flight``: its last count (0 when it could not say)."""

    idle: bool
    in_flight: int
    probed: bool = True


async def drain(
    base_url: str,
    probe: InFlightProbe | None,
    timeout: float,
    *,
    headers: dict[str, str] | None = None,
    label: str = "engine",
    poll: float = DRAIN_POLL_S,
    fallback: float = DRAIN_FALLBACK_S,
) -> DrainResult:
    """Returns once the engine at ``base_url`` has no request in flight, or after ``timeout``
    seconds (then ``idle`` is False with the last count). ``headers``: what each read carries
    (the shard's secret as Bearer). Without a probe, or when a read fails, waits what is left of
    ``fallback`` seconds (at most ``timeout``) and returns idle with ``probed`` False."""
    start = trio.current_time()
    deadline = start + timeout
    if probe is None:
        log.info("%s cannot say how many requests it has in flight: waiting a fixed %g s", label, min(fallback, timeout))
        return await _fallback(start, deadline, fallback)
    url = base_url + probe.path
    in_flight = 0
    async with httpx.AsyncClient(timeout=DRAIN_PROBE_TIMEOUT_S, trust_env=False, headers=headers or {}) as client:
        while True:
            try:
                with trio.fail_after(DRAIN_PROBE_TIMEOUT_S):
                    response = await client.get(url)
                response.raise_for_status()
                in_flight = probe.parse(response.text)
            except (httpx.HTTPError, trio.TooSlowError, ValueError) as exc:
                log.warning("%s: reading %s failed (%s): waiting a fixed %g s instead", label, url,
                            f"{type(exc).__name__}: {exc}".rstrip(": "), min(fallback, timeout))
                return await _fallback(start, deadline, fallback)
            if in_flight == 0:
                return DrainResult(idle=True, in_flight=0)
            if trio.current_time() + poll > deadline:
                return DrainResult(idle=False, in_flight=in_flight)
            await trio.sleep(poll)


async def _fallback(start: float, deadline: float, fallback: float) -> DrainResult:
    """Sleeps until ``start + fallback`` (not past ``deadline``); returns an unprobed idle result."""
    await trio.sleep_until(min(start + fallback, deadline))
    return DrainResult(idle=True, in_flight=0, probed=False)
