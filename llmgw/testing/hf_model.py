"""A tiny random Hugging Face-format Llama model, tokenizer and LoRA adapter, for engine tests.

The writing half runs INSIDE an engine's environment (it needs torch, transformers,
tokenizers and safetensors, which llmgw's own environment does not have): run this file
as a script with that environment's python. The calling half
(:func:`write_tiny_model`, :func:`write_tiny_lora`) runs in llmgw's environment and starts
that subprocess; nothing at module level imports torch.

Model: a byte-level BPE tokenizer trained on a few KB of text (saved as a
``PreTrainedTokenizerFast`` with a Jinja chat template) and a ``LlamaConfig`` with hidden
size 64, 2 layers, 2 heads of size 32 (vLLM's CPU attention needs head size >= 32), 1 KV
head, random weights in safetensors: a few hundred KB, served by vLLM in about a minute.
Adapter: a PEFT-format LoRA (rank :data:`LORA_RANK` on q/k/v/o, non-zero B so it changes
outputs), written with safetensors directly (no peft needed).

Command line (with the engine environment's python)::

    python hf_model.py model OUT_DIR
    python hf_model.py lora MODEL_DIR OUT_DIR [SEED]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

#: LoRA rank of the tiny adapter; vLLM accepts 1, 8, 16, 32, ... as --max-lora-rank.
LORA_RANK = 8
#: Seconds the subprocess may take: importing torch and transformers on a busy 2-core machine.
WRITE_TIMEOUT = 300.0
#: Random seed: the same files every run.
SEED = 1234

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 2, 1
HEAD_DIM = HIDDEN // HEADS
VOCAB_TARGET = 512
MAX_POSITIONS = 2048

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_TEXT = (
    "The quick brown fox jumps over the lazy dog. A tiny model for tests says hello. "
    "Engines serve models; gateways route requests; nodes run replicas of models. "
    "Numbers one two three four five six seven eight nine ten. "
    "user assistant system hello hi world cache block token prefix adapter lora. "
) * 40


# -- the caller's half (llmgw's environment) ------------------------------------------------


def _run(python: str, *args: str) -> None:
    done = subprocess.run([python, str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                          timeout=WRITE_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"hf_model.py {' '.join(args)} failed with {python}:\n{(done.stdout + done.stderr)[-3000:]}")


def write_tiny_model(python: str, directory: Path) -> Path:
    """Writes the tiny model + tokenizer into ``directory`` using ``python`` (an engine
    environment's interpreter); returns ``directory``. Raises RuntimeError with the output on failure."""
    _run(python, "model", str(directory))
    return directory


def write_tiny_lora(python: str, model_dir: Path, directory: Path, seed: int = 1) -> Path:
    """Writes a LoRA adapter for the model in ``model_dir`` into ``directory``; returns
    ``directory``. Adapters of different ``seed`` have different weights (and answer
    differently); one seed gives the same files every run."""
    _run(python, "lora", str(model_dir), str(directory), str(seed))
    return directory


# -- the writing half (the engine's environment) ---------------------------------------------


def _make_model(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_TARGET, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([_TEXT], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)


def _make_lora(model_dir: Path, out: Path, seed: int = 1) -> None:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(SEED + seed)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    shapes = {  # module -> (in_features, out_features)
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (hidden, hidden),
    }
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, fan_in) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, LORA_RANK) * 0.1
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "target_modules": list(shapes),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }, indent=2))


def main(argv: list[str]) -> int:
    """The command line in the module docstring; returns the exit status."""
    if len(argv) == 2 and argv[0] == "model":
        _make_model(Path(argv[1]))
    elif len(argv) in (3, 4) and argv[0] == "lora":
        _make_lora(Path(argv[1]), Path(argv[2]), int(argv[3]) if len(argv) == 4 else 1)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
