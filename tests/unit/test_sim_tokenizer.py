"""The simulated engine's tokenizer and chat template are deterministic and reversible."""

import os
import subprocess
import sys

import pytest

from llmgw.sim import tokenizer

TEXT = "Hello there, how are you?  Fine: thanks!\nÜnïcode wörds too."


def test_split_round_trips():
    assert "".join(tokenizer.split(TEXT)) == TEXT
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


def test_ids_stable_across_processes():
    code = f"from llmgw.sim import tokenizer; print(tokenizer.encode({TEXT!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert out.strip() == str(tokenizer.encode(TEXT))


def test_ids_in_range_and_specials_fixed():
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.SPECIAL_TOKENS["<|im_start|>"]
    assert ids[-1] == tokenizer.SPECIAL_TOKENS["<|im_end|>"]
    assert all(0 < t < tokenizer.VOCAB_SIZE for t in ids)


def test_generated_words_are_single_tokens():
    for piece, tid in zip(tokenizer.GENERATED_PIECES, tokenizer.GENERATED_IDS):
        assert tokenizer.encode(piece) == [tid]
    assert tokenizer.encode("".join(tokenizer.GENERATED_PIECES)) == list(tokenizer.GENERATED_IDS)


def test_chat_template():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert tokenizer.render_chat(msgs) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    without = tokenizer.encode_chat(msgs, add_generation_prompt=False)
    with_gen = tokenizer.encode_chat(msgs)
    assert with_gen[: len(without)] == without and len(with_gen) > len(without)
    assert tokenizer.encode_chat(msgs) == with_gen


@pytest.mark.parametrize("bad", [[], "hi", [{"content": "x"}], [{"role": "user", "content": 5}]])
def test_chat_template_rejects_bad_messages(bad):
    with pytest.raises(ValueError):
        tokenizer.encode_chat(bad)


def test_unknown_id_decodes_visibly():
    assert tokenizer.decode([99]) == "<|99|>"
