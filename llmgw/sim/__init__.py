"""A simulated vLLM engine for tests, demos and benchmarks.

``python -m llmgw.sim --model NAME --port 0`` serves vLLM's HTTP surface with a
deterministic tokenizer and output, a prefix cache hashed exactly like vLLM's
``sha256_cbor`` (:mod:`llmgw.kvhash`), KV events over ZMQ in vLLM's wire format,
and the runtime LoRA API. In-process use: ``await nursery.start(llmgw.sim.server.serve, cfg)``.
"""

from llmgw.sim.config import SimConfig, parse_args
from llmgw.sim.server import StartError, main, serve

__all__ = ["SimConfig", "StartError", "main", "parse_args", "serve"]
