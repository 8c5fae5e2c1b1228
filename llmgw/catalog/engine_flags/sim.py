"""The simulator's options, classified (``python -m llmgw.sim``: llmgw's own parser, same version).

Everything is safe except what the agent sets and what loads an adapter at start (adapters are
catalog entries). A profile may set its own KV-event endpoints and hash seed: the simulator is
how llmgw's tests drive those paths. ``tests/unit/test_engine_flags.py`` checks that every option
of :func:`llmgw.sim.config.build_parser` is classified here.
"""

from __future__ import annotations

from llmgw import __version__
from llmgw.catalog.engine_flags import AGENT, EXITS, Table, opt

VERSION = __version__

OPTIONS = (
    opt("-h", "--help", values=0, refused=EXITS),
    opt("--host", refused=AGENT),
    opt("--port", refused=AGENT),
    opt("--model", refused=AGENT),
    opt("--block-size"),
    opt("--num-blocks"),
    opt("--max-model-len"),
    opt("--max-num-seqs"),
    opt("--kv-events-endpoint"),
    opt("--kv-replay-endpoint"),
    opt("--kv-topic"),
    opt("--data-parallel-rank"),
    opt("--hash-seed"),
    opt("--prefill-us-per-token"),
    opt("--prefill-concurrency"),
    opt("--decode-us-per-token"),
    opt("--max-tokens-default"),
    opt("--enable-lora", values=0),
    opt("--max-loras"),
    opt("--lora", refused="it loads an adapter at start; adapters are catalog entries (ctl models add --adapter)"),
    opt("--any-lora-path", values=0),
    opt("--fail-after"),
    opt("--startup-delay"),
    opt("--embedding-dim"),
    opt("--tokenizer"),  # tests drive the gateway's own tokenization (and a wrong one) through these
    opt("--served-tokenizer"),
)

TABLE = Table("sim", VERSION, "argparse", OPTIONS)
