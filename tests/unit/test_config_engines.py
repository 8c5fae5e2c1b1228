"""agent.yaml ``engines:``: the paths an operator names per engine, and what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.config import ConfigError, load_agent_config


def load(tmp_path: Path, text: str, overrides: dict | None = None):  # type: ignore[no-untyped-def]
    path = tmp_path / "agent.yaml"
    path.write_text("node_id: n1\n" + text)
    return load_agent_config(path, overrides or {})


def error(tmp_path: Path, text: str, overrides: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, overrides)
    prefix = f"{tmp_path / 'agent.yaml'}: "
    message = str(info.value)
    assert message.startswith(prefix), message
    return message[len(prefix):]


def test_no_engines_section_names_no_paths(tmp_path: Path) -> None:
    assert load(tmp_path, "").engine_paths == {}


def test_each_engine_names_its_path(tmp_path: Path) -> None:
    config = load(tmp_path, (
        "engines:\n"
        "  vllm: {python: /opt/vllm/bin/python}\n"
        "  sglang: {python: /opt/sglang/bin/python}\n"
        "  llama.cpp: {server: bin/llama-server}\n"
    ))
    assert config.engine_paths == {
        "vllm": Path("/opt/vllm/bin/python"),
        "sglang": Path("/opt/sglang/bin/python"),
        # relative to agent.yaml's directory, like every path of the file
        "llama.cpp": tmp_path / "bin" / "llama-server",
    }


def test_llamacpp_spelling_is_accepted_and_is_what_an_override_can_write(tmp_path: Path) -> None:
    assert load(tmp_path, "engines:\n  llamacpp: {server: /x/llama-server}\n").engine_paths == {
        "llama.cpp": Path("/x/llama-server")}
    overridden = load(tmp_path, "", {"engines.llamacpp.server": "/y/llama-server"})
    assert overridden.engine_paths == {"llama.cpp": Path("/y/llama-server")}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("engines:\n  vlm: {python: /x}\n", "engines.vlm: unknown engine 'vlm' (engines named here: llama.cpp, sglang, vllm)"),
        ("engines:\n  sim: {python: /x}\n", "engines.sim: unknown engine 'sim' (engines named here: llama.cpp, sglang, vllm)"),
        ("engines:\n  vllm: {pyton: /x}\n", "engines.vllm: unknown key 'pyton' (did you mean 'python'?)"),
        ("engines:\n  llama.cpp: {python: /x}\n", "engines.llama.cpp: unknown key 'python' (known keys: server)"),
        ("engines:\n  vllm: {}\n",
         "engines.vllm.python: missing: name the Python interpreter of an environment where vllm imports, "
         "or remove engines.vllm"),
        ("engines:\n  vllm: {python: ''}\n",
         "engines.vllm.python: missing: name the Python interpreter of an environment where vllm imports, "
         "or remove engines.vllm"),
        ("engines:\n  vllm: /opt/vllm/bin/python\n", 'engines.vllm: expected a mapping of keys, got "/opt/vllm/bin/python"'),
        ("engines:\n  vllm: {python: 3}\n", "engines.vllm.python: expected a non-empty string, got 3"),
        ("engines: [vllm]\n", "engines: expected a mapping of keys, got a list"),
        ("engines:\n  llama.cpp: {server: /a}\n  llamacpp: {server: /b}\n",
         "engines.llamacpp: llama.cpp is named twice (as 'llama.cpp' and 'llamacpp'); keep one"),
    ],
)
def test_refused(tmp_path: Path, text: str, message: str) -> None:
    assert error(tmp_path, text) == message
