"""The simulated engine: ``python -m llmgw.sim``, shipped with llmgw itself.

It is always installed (it is part of this package) and its version is llmgw's.
It answers GET /health with 200 as soon as it listens, so its startup deadline is short.

Like vLLM, it publishes KV events by default (``--kv-events-endpoint`` the agent's
subscriber binds, ``--kv-replay-endpoint``, ``--hash-seed`` :data:`llmgw.kvhash.KV_HASH_SEED`);
the profile turns them off with ``--llmgw-no-kv-events``. A profile's own ``--hash-seed``
wins (it breaks precise routing: useful to test the router's hash-agreement alarm).
"""

from __future__ import annotations

import importlib.metadata
import sys

from llmgw import kvhash
from llmgw.catalog.engine_options import NO_KV_EVENTS_OPTION, llmgw_options, option_name, option_value
from llmgw.node.engines import DEFAULT_HEALTH_PATH, ENGINE_PATH, check_refused, cuda_env, llmgw_pythonpath
from llmgw.node.engines.load import VLLM_METRICS, InFlightProbe
from llmgw.node.kvevents import KvEventsConfig
from llmgw.spec import ENGINE_BUILT_IN, EngineInfo, ShardSpec

# The simulator loads nothing, so a few seconds is plenty even on a busy node;
# anything slower is a broken start, better retried than waited for.
SIM_STARTUP_TIMEOUT = 60.0
#: Simulator options through which a profile publishes events itself: the agent then adds none.
_OWN_EVENT_OPTIONS = ("--kv-events-endpoint", "--kv-replay-endpoint")


def sim_block_size(args: list[str] | tuple[str, ...]) -> int:
    """Returns the ``--block-size`` in ``args`` (``--block-size N`` or ``=N``; last wins), else the simulator's default."""
    text = option_value(args, "--block-size")
    if text is not None and text.isdigit() and int(text) > 0:
        return int(text)
    return kvhash.DEFAULT_BLOCK_SIZE


def _llmgw_version() -> str:
    """Returns llmgw's installed version, or "0+unknown" when running uninstalled."""
    try:
        return importlib.metadata.version("llmgw")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def sim_lora_args(spec: ShardSpec) -> list[str]:
    """Returns the simulator's LoRA flags for ``spec``'s catalog adapters ([] when none).

    ``--enable-lora --max-loras N`` (max_loaded_adapters, or the adapter count when all
    load at start) and ``--any-lora-path`` (a simulated adapter's source is a label, not a
    file); with max_loaded_adapters == 0 also ``--lora NAME=PATH`` per adapter.
    """
    if not spec.adapters:
        return []
    out = ["--enable-lora", "--max-loras", str(spec.max_loaded_adapters or len(spec.adapters)), "--any-lora-path"]
    if spec.max_loaded_adapters == 0:
        for adapter in spec.adapters:
            out += ["--lora", f"{adapter.name}={adapter.source}"]
    return out


class SimEngine:
    """Adapter for the simulated engine (see :class:`llmgw.node.engines.Engine`)."""

    name = "sim"
    health_path = DEFAULT_HEALTH_PATH
    #: The simulator computes nothing: GPUs placed for it stay empty (compute.unused_gpus skips it).
    holds_gpu_memory = False
    startup_timeout = SIM_STARTUP_TIMEOUT

    def probe(self) -> EngineInfo:
        """Returns installed=True with llmgw's version: the simulator ships with llmgw."""
        return EngineInfo(name=self.name, installed=True, version=_llmgw_version(), detail="built into llmgw",
                          origin=ENGINE_BUILT_IN)

    def in_flight_probe(self) -> InFlightProbe:
        """Returns how the simulator says how busy it is: vLLM's ``/metrics`` gauges."""
        return VLLM_METRICS

    def kv_events_for(self, spec: ShardSpec, host: str = "127.0.0.1",
                      avoid: set[int] = frozenset()) -> KvEventsConfig | None:  # type: ignore[assignment]
        """Returns fresh KV-event endpoints on ``host`` (ports outside ``avoid``) and the block
        size for ``spec``, or None when the profile turns events off or publishes them itself."""
        own, args = llmgw_options(self.name, spec.args)
        if NO_KV_EVENTS_OPTION in own or any(option_name(a) in _OWN_EVENT_OPTIONS for a in args):
            return None
        return KvEventsConfig.on_free_ports(host, block_size=sim_block_size(args), avoid=avoid)

    def argv(self, spec: ShardSpec, host: str, port: int, *, kv_events: KvEventsConfig | None = None) -> list[str]:
        """Returns ``python -m llmgw.sim --host H --port P --model NAME``, the KV-event options
        for ``kv_events`` (the hash seed before the profile's args, so a profile's own
        ``--hash-seed`` wins), the LoRA flags of the catalog's adapters (:func:`sim_lora_args`),
        then the profile's args without llmgw's own options."""
        _, args = llmgw_options(self.name, spec.args)
        argv = [sys.executable, "-m", "llmgw.sim", "--host", host, "--port", str(port), "--model", spec.model]
        if kv_events is not None:
            argv += [
                "--kv-events-endpoint", kv_events.endpoint,
                "--kv-replay-endpoint", kv_events.replay_endpoint,
                "--kv-topic", kv_events.topic,
                "--hash-seed", kvhash.KV_HASH_SEED,
            ]
        return [*argv, *sim_lora_args(spec), *args]

    def env(self, spec: ShardSpec) -> dict[str, str]:
        """Returns the profile's env plus unbuffered output and a PYTHONPATH that finds llmgw
        (and the engine path's ``llmgw_undumpable``)."""
        gpus = cuda_env(spec) if spec.gpus else {}  # as a real engine would get them (tests read them back)
        return {"PYTHONUNBUFFERED": "1", "PYTHONPATH": llmgw_pythonpath(ENGINE_PATH), **gpus, **spec.env}

    def check_args(self, spec: ShardSpec) -> None:
        """Raises :class:`~llmgw.node.engines.EngineRefused` for refused args/env."""
        check_refused(spec)
