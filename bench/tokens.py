"""Where the router gets a request's tokens: the replica's ``/tokenize`` or a tokenizer in the gateway.

``python -m bench.tokens [--quick]`` serves the tiny test model (llmgw.testing.hf_model:
byte-level BPE, Jinja chat template) with one real vLLM (the environment ``make test``
installs) and measures, for chat prompts of about 100 and 1,800 tokens:

* ``tokenize``: ``POST /tokenize`` on the replica (chat template applied by vLLM), one
  loopback HTTP round trip per request, from llmgw's own HTTP client: what
  :mod:`llmgw.router.tokens` does;
* ``local``: the model's own tokenizer loaded in-process (``transformers.AutoTokenizer`` in
  the vLLM environment, since llmgw's has no transformers), ``apply_chat_template`` then
  encode: what a gateway-side tokenizer would cost per request, plus its load time and
  resident memory;

and checks that both give the same token ids. Medians of N runs each. Last stdout line:
one JSON object; ``local_vs_tokenize`` ratios below 1 mean the in-process tokenizer is
faster. The numbers that decide are elsewhere too: an in-process tokenizer needs
transformers (hundreds of MB), the model's tokenizer files on every gateway host, and the
engine's exact template and special-token handling; ``/tokenize`` is exact by
construction. bench/README.md has the measured figures and the choice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from llmgw.node.engines.vllm import VllmEngine, vllm_argv, vllm_env
from llmgw.sim.launch import free_tcp_port
from llmgw.spec import ShardSpec
from llmgw.testing.hf_model import write_tiny_model

HOST = "127.0.0.1"
#: vLLM takes 45-100 s to become healthy on a CPU; a busy 2-core machine takes longer.
READY_TIMEOUT_S = 600.0
#: Seconds allowed for one /tokenize call.
CALL_TIMEOUT_S = 30.0
#: Words per prompt size; the tiny tokenizer gives about 1.5 tokens per word of this text.
SIZES = {"short": 60, "long": 1200}
WORDS = "the quick brown fox jumps over the lazy dog engines serve models gateways route requests".split()

#: Runs inside the vLLM environment: times the model's own tokenizer.
_LOCAL_SCRIPT = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
load_s = time.perf_counter() - t0
prompts = json.loads(sys.stdin.read())
runs = int(sys.argv[2])
out = {"load_s": load_s, "tokens": {}, "median_s": {}}
for label, messages in prompts.items():
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    out["tokens"][label] = list(ids)
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        samples.append(time.perf_counter() - t)
    samples.sort()
    out["median_s"][label] = samples[len(samples) // 2]
out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompts() -> dict[str, list[dict[str, str]]]:
    out = {}
    for label, n in SIZES.items():
        text = " ".join(WORDS[i % len(WORDS)] for i in range(n))
        out[label] = [{"role": "system", "content": "You are a careful assistant."}, {"role": "user", "content": text}]
    return out


def start_vllm(python: str, model_dir: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    spec = ShardSpec(id="bench-tokenize", model="tiny", engine="vllm", source=str(model_dir),
                     args=("--max-model-len", "2048"), env={"OMP_NUM_THREADS": "1"})
    env = {**os.environ, **vllm_env(spec)}
    with open(log_path, "wb") as out:
        return subprocess.Popen(vllm_argv(python, spec, HOST, port), env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)  # polling an external process's health: nothing to wait on instead
    raise RuntimeError(f"vLLM not healthy within {READY_TIMEOUT_S:g}s:\n{log_path.read_text()[-3000:]}")


def measure_tokenize(url: str, messages: list[dict[str, str]], runs: int) -> tuple[list[int], float]:
    body = {"model": "tiny", "messages": messages, "add_generation_prompt": True}
    samples = []
    tokens: list[int] = []
    with httpx.Client(timeout=CALL_TIMEOUT_S) as client:
        for _ in range(runs + 3):  # the first calls warm the connection and vLLM's template cache
            t = time.perf_counter()
            r = client.post(url + "/tokenize", json=body)
            samples.append(time.perf_counter() - t)
            r.raise_for_status()
            tokens = r.json()["tokens"]
    return tokens, statistics.median(samples[3:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs per measurement")
    args = parser.parse_args(argv)
    runs = 20 if args.quick else 100
    python = VllmEngine().python()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-tokenize-") as tmp:
        root = Path(tmp)
        log("writing the tiny model")
        model_dir = write_tiny_model(python, root / "model")
        log("timing the in-process tokenizer (vLLM environment)")
        local = json.loads(subprocess.run([python, "-c", _LOCAL_SCRIPT, str(model_dir), str(runs)],
                                          input=json.dumps(prompts()), capture_output=True, text=True,
                                          check=True, timeout=300).stdout.strip().splitlines()[-1])
        port = free_tcp_port(HOST)
        url = f"http://{HOST}:{port}"
        log("starting vLLM (a minute or two on a CPU)")
        proc = start_vllm(python, model_dir, port, root / "vllm.log")
        try:
            wait_healthy(url, proc, root / "vllm.log")
            result: dict[str, Any] = {"runs": runs, "local_load_s": round(local["load_s"], 3),
                                      "local_max_rss_mb": round(local["max_rss_mb"], 1)}
            same = True
            for label, messages in prompts().items():
                tokens, median = measure_tokenize(url, messages, runs)
                same = same and tokens == local["tokens"][label]
                result[f"{label}_tokens"] = len(tokens)
                result[f"tokenize_{label}_ms"] = round(median * 1e3, 3)
                result[f"local_{label}_ms"] = round(local["median_s"][label] * 1e3, 3)
                result[f"local_vs_tokenize_{label}"] = round(local["median_s"][label] / median, 3)
                log(f"{label}: {len(tokens)} tokens, /tokenize {median * 1e3:.2f} ms, "
                    f"local {local['median_s'][label] * 1e3:.2f} ms")
            result["same_tokens"] = same
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps(result))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
