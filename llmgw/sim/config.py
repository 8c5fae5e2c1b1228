"""Command line and settings of the simulated engine (``python -m llmgw.sim``)."""

from __future__ import annotations

import argparse
import os
from typing import Mapping, Sequence

import attrs

from llmgw import kvhash

#: The variable the engine's secret comes in (set by the agent; never an option, since a
#: command line is readable by every local user). Set: every route but /health needs
#: ``Authorization: Bearer <secret>``; unset or empty: the engine answers anyone, as vLLM does.
API_KEY_ENV = "LLMGW_SIM_API_KEY"


@attrs.frozen
class SimConfig:
    """Everything the simulated engine is started with. See :func:`build_parser` for meanings."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    block_size: int = kvhash.DEFAULT_BLOCK_SIZE
    num_blocks: int = 1024
    max_model_len: int = 8192
    max_num_seqs: int = 256
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    kv_topic: str = "kv"
    data_parallel_rank: int = 0
    hash_seed: str | None = None
    prefill_us_per_token: float = 20.0
    prefill_concurrency: int = 0  # prefills computed at once (0: no limit)
    decode_us_per_token: float = 0.0
    max_tokens_default: int = 16
    enable_lora: bool = False
    max_loras: int = 1
    loras: tuple[tuple[str, str], ...] = ()
    lora_path_must_exist: bool = True
    fail_after: int | None = None
    startup_delay_s: float = 0.0
    embedding_dim: int = 16
    tokenizer: str | None = None  # a Hugging Face tokenizer directory: prompts tokenized with it
    served_tokenizer: str | None = None  # the directory served at GET /llmgw/tokenizer (default: tokenizer)
    api_key: str = attrs.field(default="", repr=False)  # from $LLMGW_SIM_API_KEY ("" = no check)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``python -m llmgw.sim``."""
    p = argparse.ArgumentParser(
        prog="python -m llmgw.sim",
        description="A simulated vLLM engine: OpenAI API, prefix cache with vLLM's sha256_cbor hashing, "
        "KV events over ZMQ, runtime LoRA API. Deterministic output.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed when listening)")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--block-size", type=int, default=kvhash.DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks in the cache (LRU eviction past it)")
    p.add_argument("--max-model-len", type=int, default=8192, help="prompt + output tokens allowed")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once; more wait")
    p.add_argument("--kv-events-endpoint", default=None, help="ZMQ PUB endpoint (binds if it has * or ::, else connects)")
    p.add_argument("--kv-replay-endpoint", default=None, help="ZMQ ROUTER endpoint for replays (always binds)")
    p.add_argument("--kv-topic", default="kv")
    p.add_argument("--data-parallel-rank", type=int, default=0)
    p.add_argument("--hash-seed", default=None, help="block-hash seed; default: $PYTHONHASHSEED as vLLM does")
    p.add_argument("--prefill-us-per-token", type=float, default=20.0, help="time to first token per uncached token")
    p.add_argument("--prefill-concurrency", type=int, default=0, metavar="N",
                   help="prefills computed at once, the rest queue in arrival order, as on a real engine "
                   "whose compute prefill saturates (default 0: no limit, every prefill runs on its own)")
    p.add_argument("--decode-us-per-token", type=float, default=0.0, help="time per generated token")
    p.add_argument("--max-tokens-default", type=int, default=16, help="max_tokens when a request gives none")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="adapter loaded at start")
    p.add_argument(
        "--any-lora-path",
        action="store_true",
        help="accept load_lora_adapter paths that do not exist (default: 404 like vLLM)",
    )
    p.add_argument("--fail-after", type=int, default=None, metavar="N", help="exit with status 1 after N requests")
    p.add_argument("--startup-delay", type=float, default=0.0, help="seconds to wait before listening")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenize prompts with the Hugging Face tokenizer and chat template in DIR (as vLLM "
                        "does) and serve its files at GET /llmgw/tokenizer; default: the built-in word tokenizer")
    p.add_argument("--served-tokenizer", default=None, metavar="DIR",
                   help="serve DIR's tokenizer files instead of --tokenizer's (a gateway given the wrong files)")
    return p


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> SimConfig:
    """Return the config for ``argv`` and ``environ`` (default: this process's; the secret is
    :data:`API_KEY_ENV`); exits with status 2 and a message on invalid arguments."""
    parser = build_parser()
    a = parser.parse_args(argv)
    loras = []
    for item in a.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"--lora expects NAME=PATH, got {item!r}")
        loras.append((name, path))
    if loras and not a.enable_lora:
        parser.error("--lora needs --enable-lora")
    for flag, value in (("--block-size", a.block_size), ("--num-blocks", a.num_blocks), ("--max-num-seqs", a.max_num_seqs), ("--max-model-len", a.max_model_len), ("--max-loras", a.max_loras)):
        if value <= 0:
            parser.error(f"{flag} must be positive, got {value}")
    if a.prefill_concurrency < 0:
        parser.error(f"--prefill-concurrency must be 0 (no limit) or positive, got {a.prefill_concurrency}")
    env = os.environ if environ is None else environ
    seed = a.hash_seed if a.hash_seed is not None else kvhash.seed_from_env(dict(env))
    return SimConfig(
        model=a.model,
        host=a.host,
        port=a.port,
        block_size=a.block_size,
        num_blocks=a.num_blocks,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        kv_events_endpoint=a.kv_events_endpoint,
        kv_replay_endpoint=a.kv_replay_endpoint,
        kv_topic=a.kv_topic,
        data_parallel_rank=a.data_parallel_rank,
        hash_seed=seed,
        prefill_us_per_token=a.prefill_us_per_token,
        prefill_concurrency=a.prefill_concurrency,
        decode_us_per_token=a.decode_us_per_token,
        max_tokens_default=a.max_tokens_default,
        enable_lora=a.enable_lora,
        max_loras=a.max_loras,
        loras=tuple(loras),
        lora_path_must_exist=not a.any_lora_path,
        fail_after=a.fail_after,
        startup_delay_s=a.startup_delay,
        embedding_dim=a.embedding_dim,
        tokenizer=a.tokenizer,
        served_tokenizer=a.served_tokenizer if a.served_tokenizer is not None else a.tokenizer,
        api_key=env.get(API_KEY_ENV, ""),
    )
