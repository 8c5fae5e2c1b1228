"""How many requests an engine has in flight, read over HTTP: what a rollout's drain waits on.

An adapter that can tell names its probe in ``in_flight_probe()`` (see
:func:`in_flight_probe`, which gives None, "cannot say", for an adapter without one):

* vLLM and the simulator: ``GET /metrics``, the sum of ``vllm:num_requests_running`` and
  ``vllm:num_requests_waiting`` (:func:`vllm_metrics_in_flight`);
* llama.cpp: ``GET /slots`` (enabled by default, off with ``--no-slots``), the slots whose
  ``is_processing`` is true (:func:`llamacpp_slots_in_flight`); requests queued for a slot are
  not listed there, but a queued request is followed by a processing one, so idle is idle.
"""

from __future__ import annotations

import json
import re
from typing import Callable

import attrs

__all__ = ["InFlightProbe", "in_flight_probe", "llamacpp_slots_in_flight", "vllm_metrics_in_flight",
           "LLAMACPP_SLOTS", "VLLM_METRICS"]

_VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
#: One sample of the Prometheus text format: name, optional {labels}, value (a timestamp may follow).
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})?\s+(?P<value>\S+)")


@attrs.frozen
class InFlightProbe:
    """``path``: what to GET on the engine; ``parse``: its body -> requests in flight
    (raises ValueError if the body does not say)."""

    path: str
    parse: Callable[[str], int]


def vllm_metrics_in_flight(text: str) -> int:
    """Returns running + waiting requests from a vLLM ``/metrics`` body (summed over every
    label set: one per engine core and model). Raises ValueError if neither gauge is there."""
    total = 0.0
    seen = False
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match["name"] not in _VLLM_GAUGES:
            continue
        total += float(match["value"])
        seen = True
    if not seen:
        raise ValueError(f"/metrics has neither {' nor '.join(_VLLM_GAUGES)}")
    return int(total)


def llamacpp_slots_in_flight(text: str) -> int:
    """Returns how many slots of a llama.cpp ``/slots`` body are processing a request.
    Raises ValueError if the body is not a JSON list of slots."""
    try:
        slots = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"/slots is not JSON: {exc}") from None
    if not isinstance(slots, list) or not all(isinstance(s, dict) and "is_processing" in s for s in slots):
        raise ValueError("/slots is not a list of slots with is_processing")
    return sum(1 for s in slots if s["is_processing"] is True)


VLLM_METRICS = InFlightProbe("/metrics", vllm_metrics_in_flight)
LLAMACPP_SLOTS = InFlightProbe("/slots", llamacpp_slots_in_flight)


def in_flight_probe(engine: object) -> InFlightProbe | None:
    """Returns ``engine``'s probe (its ``in_flight_probe()``), or None (the default) for an
    adapter that cannot tell how busy its engine is."""
    method = getattr(engine, "in_flight_probe", None)
    return method() if callable(method) else None
