"""What a precise routing decision costs when the gateway tokenizes itself
(llmgw/hftokenizer.py), at a 4k-token conversation whose earlier turns were seen.

No model files are downloaded: :func:`bench_tokenizer_files` trains a byte-level BPE
tokenizer (16k tokens, the kind Llama 3 and Qwen use, smaller) on generated text in a few
seconds and gives it ChatML special tokens and a Qwen-style chat template. Used by
``python -m bench.routing`` (router_cost section) and runnable alone::

    python -m bench.localtokens                      # JSON on stdout
    python -m bench.localtokens --reserved-tokens 250  # with Llama 3's 250 reserved added tokens
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any, Callable

from llmgw.hftokenizer import LocalTokenizer
from llmgw.router.kvindex import KvIndex
from llmgw.router.kvrouting import KvAwarePolicy
from llmgw.router.replicas import LoadTracker, Replica, RequestInfo
from llmgw.router.tokens import TokenHasher
from llmgw.spec import KvDelta

MODEL = "bench-tokens"
BLOCK_SIZE = 16
REPLICAS = 4
#: Vocabulary of the trained tokenizer (real ones: 32k-256k; encoding cost grows slowly with it).
VOCAB = 16_000
#: Tokens of earlier turns in the measured conversation.
HISTORY_TOKENS = 4096
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_SYLLABLES = "ka lo mi nu pe ra si to vu we xa yo ze bri cla dro fen gor hul jin".split()


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randrange(1, 4)))


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(_word(rng) for _ in range(words)).capitalize() + rng.choice(".,;:!?")


#: Added tokens Llama 3's tokenizer reserves (``<|reserved_special_token_N|>``, about 250 of
#: its 256): none appears in a prompt, but the gateway's splitter looks for every added token.
LLAMA3_RESERVED_TOKENS = 250


def bench_tokenizer_files(seed: int = 1, reserved: int = 0) -> dict[str, bytes]:
    """Return the files of a trained byte-level BPE tokenizer with a ChatML template, and
    ``reserved`` more added tokens named as Llama 3 names its reserved ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    corpus = [_sentence(rng, rng.randrange(5, 30)) + f" {rng.randrange(10**6)}" for _ in range(40_000)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [
        f"<|reserved_special_token_{i}|>" for i in range(reserved)]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus, trainer)
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}
    return {"tokenizer.json": bpe.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode()}


def _median_us(fn: Callable[[], Any], runs: int) -> float:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return round(statistics.median(samples) * 1e6, 1)


def _run(coro: Any) -> Any:
    """Run a coroutine that never suspends (the local path awaits nothing) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the decision suspended: it went to the network")


def measure(runs: int = 200, seed: int = 2, reserved: int = 0) -> dict[str, Any]:
    """Return the costs (microseconds, medians over ``runs``) of tokenizing and deciding
    locally, with a tokenizer of ``reserved`` more added tokens (:func:`bench_tokenizer_files`)."""
    tokenizer = LocalTokenizer(bench_tokenizer_files(reserved=reserved))
    rng = random.Random(seed)
    history = [{"role": "system", "content": _sentence(rng, 60)}]
    while len(tokenizer.ids(tokenizer.chat_parts({"messages": history}) or _fail())) < HISTORY_TOKENS:
        history.append({"role": "user", "content": " ".join(_sentence(rng, 12) for _ in range(6))})
        history.append({"role": "assistant", "content": " ".join(_sentence(rng, 12) for _ in range(10))})
    bodies = [{"model": MODEL, "messages": history + [{"role": "user", "content": _sentence(rng, 25)}]}
              for _ in range(runs)]
    seen = {"model": MODEL, "messages": history + [{"role": "user", "content": _sentence(rng, 25)}]}
    prompt_tokens = len(tokenizer.ids(tokenizer.chat_parts(seen) or _fail()))

    load = LoadTracker()
    index = KvIndex()
    hasher = TokenHasher()
    cands = [Replica(f"c{i}", MODEL, f"http://127.0.0.1:{i + 1}", engine="vllm") for i in range(REPLICAS)]
    for r in cands:
        hasher.shelf.put(r.id, MODEL, tokenizer)
        index.apply(r.id, KvDelta(reset=True, stored=(), block_size=BLOCK_SIZE))
    policy = KvAwarePolicy(load, index=index, hasher=hasher)
    # The earlier turns were routed to c0 and it holds them (its KV events said so).
    seen_hashes = _run(hasher.hashes(cands[0], RequestInfo("/v1/chat/completions", MODEL, body=seen), BLOCK_SIZE, None))
    index.apply("c0", KvDelta(stored=tuple(seen_hashes), block_size=BLOCK_SIZE))

    def render_only() -> None:
        chat = tokenizer.chat
        assert chat is not None
        chat.render(chat.conversation(bodies[0]) or [], True)

    cold = iter(bodies)
    # Cold: tokenize the whole conversation with tokenizers in one call (what any gateway
    # tokenizing itself pays without remembering turns).
    cold_us = _median_us(lambda: tokenizer.tokenizer.encode(
        tokenizer.chat.render(tokenizer.chat.conversation(next(cold)) or [], True),  # type: ignore[union-attr]
        add_special_tokens=False), runs)
    decisions = []
    for body in bodies:
        info = RequestInfo("/v1/chat/completions", MODEL, body=body)
        t0 = time.perf_counter()
        decision = _run(policy.decide(cands, info))
        decisions.append(time.perf_counter() - t0)
        assert decision.replica.id == "c0"
    return {
        "prompt_tokens": prompt_tokens,
        "turns": len(history) // 2,
        "vocab": tokenizer.tokenizer.get_vocab_size(),
        "added_tokens": len(tokenizer.tokenizer.get_added_tokens_decoder()),
        "render_template_us": _median_us(render_only, runs),
        "tokenize_whole_prompt_us": cold_us,
        "precise_decision_next_turn_us": round(statistics.median(decisions) * 1e6, 1),
        "tokenized_in_gateway": hasher.local,
        "tokenize_calls": hasher.calls,
        "resumed_turns": hasher.turns.resumed,
    }


def _fail() -> Any:
    raise RuntimeError("the bench tokenizer's template refused the conversation")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.localtokens", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reserved-tokens", type=int, default=0, metavar="N",
                        help=f"N more added tokens, as Llama 3 reserves them ({LLAMA3_RESERVED_TOKENS}; default 0)")
    print(json.dumps(measure(reserved=parser.parse_args().reserved_tokens), indent=1))
