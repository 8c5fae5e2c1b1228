"""Tiny random llama.cpp models and LoRA adapters, written directly as GGUF files.

A model written here is a valid Llama-architecture GGUF with a SentencePiece-style
("llama") vocabulary of byte tokens plus a few hundred word pieces, random weights and
a ChatML chat template. llama-server loads it in milliseconds and answers every API
call; what it generates is gibberish (the weights are random). It exists so tests and
``llmgw up`` can serve a real engine without downloading a model.

    write_tiny_model(path)              -> Path   (~0.4 MB at the defaults)
    write_tiny_lora(path, TinyModel())  -> Path   (an adapter for that model)

Both are deterministic for a given seed and write atomically (temporary name, then
rename), so a half-written file never looks complete. They need numpy and the ``gguf``
package; no torch.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import numpy as np

__all__ = ["TinyModel", "write_tiny_lora", "write_tiny_model"]

# Word pieces in the vocabulary besides the 256 byte tokens: enough that ordinary
# English prompts tokenize into pieces rather than bytes only.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part hello world model test answer question llama server token cache prefix gateway"
).split()
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;"

# ChatML: a template llama.cpp's Jinja engine renders without surprises.
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@attrs.frozen
class TinyModel:
    """Shape of a tiny Llama model. The defaults give a ~0.4 MB file (64 wide, 2 layers)."""

    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 128
    context_length: int = 2048
    seed: int = 1234
    name: str = "llmgw-tiny-random"


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """Returns (tokens, scores, types): <unk> <s> </s>, 256 byte tokens, then pieces."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces = ["\u2581"] + [f"\u2581{w}" for w in _WORDS] + list(_LETTERS) + [f"\u2581{c}" for c in _LETTERS]
    seen = set(tokens)
    for piece in pieces:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(TokenType.NORMAL)
    # SPM merges by score: longer pieces first.
    scores = [0.0] * 259 + [-float(i) / 10.0 + len(t) for i, t in enumerate(tokens[259:])]
    return tokens, scores, [int(t) for t in types]


def _atomic(path: Path, write: "callable") -> Path:  # type: ignore[valid-type]
    """Calls ``write(tmp_path)`` then renames tmp onto ``path``; returns ``path``. Cleans up on error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_tiny_model(path: str | os.PathLike[str], shape: TinyModel = TinyModel()) -> Path:
    """Writes a random Llama GGUF of ``shape`` at ``path``; returns the path.

    Raises OSError if the file cannot be written (nothing is left at ``path`` then).
    """
    import gguf

    tokens, scores, types = _vocab()
    rng = np.random.default_rng(shape.seed)
    head_dim = shape.n_embd // shape.n_head
    n_embd_kv = head_dim * shape.n_head_kv

    def weight(*dims: int) -> np.ndarray:
        # numpy shape is (out, in): ggml's ne is the reverse. Scaled so activations stay moderate.
        return (rng.standard_normal(dims) / np.sqrt(dims[-1])).astype(np.float32)

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(str(tmp), "llama")
        w.add_name(shape.name)
        w.add_context_length(shape.context_length)
        w.add_embedding_length(shape.n_embd)
        w.add_block_count(shape.n_layer)
        w.add_feed_forward_length(shape.n_ff)
        w.add_head_count(shape.n_head)
        w.add_head_count_kv(shape.n_head_kv)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(10000.0)
        w.add_vocab_size(len(tokens))
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_chat_template(_CHAT_TEMPLATE)
        w.add_tensor("token_embd.weight", weight(len(tokens), shape.n_embd))
        for i in range(shape.n_layer):
            w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
            w.add_tensor(f"blk.{i}.attn_q.weight", weight(shape.n_embd, shape.n_embd))
            w.add_tensor(f"blk.{i}.attn_k.weight", weight(n_embd_kv, shape.n_embd))
            w.add_tensor(f"blk.{i}.attn_v.weight", weight(n_embd_kv, shape.n_embd))
            w.add_tensor(f"blk.{i}.attn_output.weight", weight(shape.n_embd, shape.n_embd))
            w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
            w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(shape.n_ff, shape.n_embd))
            w.add_tensor(f"blk.{i}.ffn_up.weight", weight(shape.n_ff, shape.n_embd))
            w.add_tensor(f"blk.{i}.ffn_down.weight", weight(shape.n_embd, shape.n_ff))
        w.add_tensor("output_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
        w.add_tensor("output.weight", weight(len(tokens), shape.n_embd))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return _atomic(Path(path), write)


def write_tiny_lora(
    path: str | os.PathLike[str], shape: TinyModel = TinyModel(), *, rank: int = 4, seed: int = 99, strength: float = 4.0
) -> Path:
    """Writes a random LoRA adapter GGUF for a model of ``shape``; returns the path.

    Adapts every layer's attention projections and FFN up/down (``blk.N.*.weight.lora_{a,b}``).
    ``strength`` scales lora_b: the default is large enough that the adapted model's
    greedy output differs from the base model's. Raises OSError if it cannot be written.
    """
    import gguf

    rng = np.random.default_rng(seed)
    head_dim = shape.n_embd // shape.n_head
    n_embd_kv = head_dim * shape.n_head_kv
    targets = {
        "attn_q": (shape.n_embd, shape.n_embd),
        "attn_k": (n_embd_kv, shape.n_embd),
        "attn_v": (n_embd_kv, shape.n_embd),
        "attn_output": (shape.n_embd, shape.n_embd),
        "ffn_up": (shape.n_ff, shape.n_embd),
        "ffn_down": (shape.n_embd, shape.n_ff),
    }

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(str(tmp), "llama")
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
        w.add_name(f"{shape.name}-lora")
        for i in range(shape.n_layer):
            for name, (n_out, n_in) in targets.items():
                a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
                b = (rng.standard_normal((n_out, rank)) * strength / np.sqrt(rank)).astype(np.float32)
                w.add_tensor(f"blk.{i}.{name}.weight.lora_a", a)
                w.add_tensor(f"blk.{i}.{name}.weight.lora_b", b)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return _atomic(Path(path), write)
