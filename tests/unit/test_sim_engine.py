"""Deterministic output, limits, LoRA bookkeeping and the CLI config of the simulated engine."""

import pytest

from llmgw.sim import tokenizer
from llmgw.sim.config import parse_args
from llmgw.sim.engine import Engine, EngineError, embedding, plan_output
from llmgw.sim.publisher import KvEventPublisher

PROMPT = tokenizer.encode("Tell me about rivers.")


def test_output_is_deterministic_and_respects_max_tokens():
    a = plan_output(PROMPT, 5)
    assert a == plan_output(PROMPT, 5)
    assert len(a.token_ids) == len(a.pieces) == 5 and a.finish_reason == "length"
    assert tokenizer.encode(a.text) == list(a.token_ids)
    longer = plan_output(PROMPT, 10_000)
    assert longer.finish_reason == "stop" and longer.token_ids[:5] == a.token_ids


def test_output_depends_on_prompt_and_adapter():
    assert plan_output(PROMPT, 8).text != plan_output(PROMPT + [5], 8).text
    assert plan_output(PROMPT, 8).text != plan_output(PROMPT, 8, adapter="x").text


def test_stop_string_truncates():
    full = plan_output(PROMPT, 20)
    word = full.pieces[3].strip()
    out = plan_output(PROMPT, 20, stop=[word])
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert word not in out.text and full.text.startswith(out.text)


def test_embedding_unit_and_deterministic():
    v = embedding(PROMPT, 8)
    assert v == embedding(PROMPT, 8) and v != embedding(PROMPT + [1], 8)
    assert abs(sum(x * x for x in v) - 1.0) < 1e-9


def engine(*args):
    return Engine(parse_args(["--model", "base", *args]), KvEventPublisher(None))


def test_max_tokens_limits():
    e = engine("--max-model-len", "100", "--max-tokens-default", "16")
    assert e.max_tokens_for(10, None) == 16
    assert e.max_tokens_for(95, None) == 5
    assert e.max_tokens_for(10, 90) == 90
    for bad in (0, -1, "3", True, 91):
        with pytest.raises(EngineError) as info:
            e.max_tokens_for(10, bad)
        assert info.value.status == 400


def test_lora_load_unload_messages(tmp_path):
    e = engine("--enable-lora")
    assert e.load_lora("ad", str(tmp_path)) == "Success: LoRA adapter 'ad' added successfully."
    assert e.resolve_model("ad").int_id == 1
    assert e.resolve_model("base") is None and e.resolve_model(None) is None
    with pytest.raises(EngineError) as info:
        e.load_lora("ad", str(tmp_path))
    assert (info.value.status, info.value.err_type) == (400, "InvalidUserInput")
    with pytest.raises(EngineError) as info:
        e.load_lora("other", str(tmp_path / "missing"))
    assert info.value.status == 404
    with pytest.raises(EngineError) as info:
        e.load_lora("base", str(tmp_path))
    assert info.value.status == 400
    assert e.unload_lora("ad") == "Success: LoRA adapter 'ad' removed successfully."
    with pytest.raises(EngineError) as info:
        e.unload_lora("ad")
    assert info.value.status == 404
    with pytest.raises(EngineError) as info:
        e.resolve_model("ad")
    assert info.value.status == 404


def test_config_seed_from_env_unless_flag():
    assert parse_args(["--model", "m"], environ={"PYTHONHASHSEED": "0"}).hash_seed == "0"
    assert parse_args(["--model", "m"], environ={}).hash_seed is None
    assert parse_args(["--model", "m", "--hash-seed", "7"], environ={"PYTHONHASHSEED": "0"}).hash_seed == "7"


def test_config_lora_flags():
    cfg = parse_args(["--model", "m", "--enable-lora", "--lora", "a=/x", "--lora", "b=/y=z"])
    assert cfg.loras == (("a", "/x"), ("b", "/y=z"))
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--lora", "a=/x"])
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--enable-lora", "--lora", "nopath"])
