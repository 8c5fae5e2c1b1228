"""Each engine's command line for a model with catalog LoRA adapters (paths already local)."""

from __future__ import annotations

from pathlib import Path


from llmgw.node.engines.llamacpp import LlamaCppEngine
from llmgw.node.engines.sim import SimEngine
from llmgw.node.engines.vllm import DEFAULT_MAX_LORA_RANK, vllm_argv, vllm_env
from llmgw.sim.config import parse_args
from llmgw.spec import Adapter, ShardSpec

ADAPTERS = (Adapter("sql", "/w/sql"), Adapter("chat", "/w/chat"))


def spec(engine: str, *, max_loaded: int = 0, args: tuple[str, ...] = (), adapters=ADAPTERS) -> ShardSpec:
    return ShardSpec(id="s1", model="base", engine=engine, source="/w/base", args=args, adapters=adapters,
                     max_loaded_adapters=max_loaded)


def after(argv: list[str], flag: str) -> list[str]:
    """Returns the values that follow ``flag`` up to the next option."""
    i = argv.index(flag) + 1
    out = []
    while i < len(argv) and not argv[i].startswith("--"):
        out.append(argv[i])
        i += 1
    return out


# -- vLLM ----------------------------------------------------------------------------------


def test_vllm_registers_every_adapter_at_start_when_all_load() -> None:
    argv = vllm_argv("py", spec("vllm"), "127.0.0.1", 8000)
    assert "--enable-lora" in argv
    assert after(argv, "--max-loras") == ["2"]
    assert after(argv, "--max-lora-rank") == [str(DEFAULT_MAX_LORA_RANK)]
    assert after(argv, "--lora-modules") == ["sql=/w/sql", "chat=/w/chat"]
    assert vllm_env(spec("vllm"))["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_vllm_on_demand_registers_nothing_and_caps_loaded_adapters() -> None:
    argv = vllm_argv("py", spec("vllm", max_loaded=1), "127.0.0.1", 8000)
    assert after(argv, "--max-loras") == ["1"]
    assert "--lora-modules" not in argv
    assert vllm_env(spec("vllm", max_loaded=1))["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_vllm_profile_lora_settings_win_and_are_not_repeated() -> None:
    argv = vllm_argv("py", spec("vllm", args=("--max-lora-rank", "64", "--enable-lora")), "127.0.0.1", 8000)
    assert argv.count("--enable-lora") == 1 and argv.count("--max-lora-rank") == 1
    assert after(argv, "--max-lora-rank") == ["64"]


def test_vllm_without_adapters_has_no_lora_flags() -> None:
    argv = vllm_argv("py", spec("vllm", adapters=()), "127.0.0.1", 8000)
    assert not [a for a in argv if "lora" in a]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env(spec("vllm", adapters=()))


# -- llama.cpp -----------------------------------------------------------------------------


def test_llamacpp_loads_adapters_in_order(tmp_path: Path) -> None:
    engine = LlamaCppEngine(binary=tmp_path / "llama-server")
    argv = engine.argv(spec("llama.cpp"), "127.0.0.1", 8000)
    loras = [argv[i + 1] for i, a in enumerate(argv) if a == "--lora"]
    assert loras == ["/w/sql", "/w/chat"]  # llama.cpp ids 0 and 1, the order ShardStatus.adapters reports


# -- sim -----------------------------------------------------------------------------------


def test_sim_loads_adapters_at_start_and_the_sim_accepts_the_flags() -> None:
    argv = SimEngine().argv(spec("sim"), "127.0.0.1", 8000)
    cfg = parse_args(argv[3:])
    assert cfg.enable_lora and cfg.max_loras == 2
    assert cfg.loras == (("sql", "/w/sql"), ("chat", "/w/chat"))


def test_sim_on_demand_caps_loaded_adapters() -> None:
    argv = SimEngine().argv(spec("sim", max_loaded=1), "127.0.0.1", 8000)
    cfg = parse_args(argv[3:])
    assert cfg.enable_lora and cfg.max_loras == 1 and cfg.loras == () and not cfg.lora_path_must_exist
