"""SGLang's options, classified by hand for SGLang 0.5.6 (``python -m sglang.launch_server``).

SGLang is not installed where this table was made, so it holds the options operators tune most,
not every option: every other one is refused as not classified until someone classifies it.
With SGLang installed, ``python -m llmgw.cli.engine_flags sglang`` lists the options
its parser has that this table lacks (docs/engine-options.md says how to classify them).
"""

from __future__ import annotations

from llmgw.catalog.engine_flags import AGENT, CODE, CREDENTIAL, EXITS, GPUS, READS, WEIGHTS, Table, opt

VERSION = "0.5.6"
#: False: a hand-made subset (the completeness test skips it; see the module docstring).
COMPLETE = False

OPTIONS = (
    opt("-h", "--help", values=0, refused=EXITS),
    opt("--model-path", refused=AGENT),
    opt("--served-model-name", refused=AGENT),
    opt("--host", refused=AGENT),
    opt("--port", refused=AGENT),
    opt("--tp-size", "--tensor-parallel-size", refused=AGENT),
    opt("--pp-size", "--pipeline-parallel-size", refused=AGENT),
    opt("--dp-size", "--data-parallel-size", refused=GPUS),
    opt("--nnodes", refused=AGENT),
    opt("--node-rank", refused=AGENT),
    opt("--dist-init-addr", refused=AGENT),
    opt("--trust-remote-code", values=0, refused="it runs Python code shipped with the model weights"),
    opt("--tokenizer-path", refused="it loads a tokenizer from another path or repository than the model's"),
    opt("--chat-template", refused=READS),
    opt("--api-key", refused=CREDENTIAL),
    opt("--download-dir", refused=WEIGHTS),
    opt("--lora-paths", values="*", refused="it loads adapters from paths at start; llmgw loads adapters itself"),
    opt("--tool-call-parser"),
    opt("--reasoning-parser"),
    opt("--custom-logit-processor", refused=CODE),
    opt("--context-length"),
    opt("--mem-fraction-static"),
    opt("--max-running-requests"),
    opt("--max-total-tokens"),
    opt("--max-prefill-tokens"),
    opt("--chunked-prefill-size"),
    opt("--schedule-policy"),
    opt("--schedule-conservativeness"),
    opt("--page-size"),
    opt("--dtype"),
    opt("--kv-cache-dtype"),
    opt("--quantization"),
    opt("--random-seed"),
    opt("--log-level"),
    opt("--log-requests", values=0),
    opt("--enable-metrics", values=0),
    opt("--disable-radix-cache", values=0),
    opt("--enable-torch-compile", values=0),
    opt("--disable-cuda-graph", values=0),
    opt("--cuda-graph-max-bs"),
    opt("--attention-backend"),
    opt("--sampling-backend"),
    opt("--grammar-backend"),
    opt("--stream-interval"),
    opt("--enable-mixed-chunk", values=0),
    opt("--enable-lora", values=0),
    opt("--max-loras-per-batch"),
    opt("--max-lora-rank"),
)

TABLE = Table("sglang", VERSION, "argparse", OPTIONS)
