"""`engines:` in server.yaml reaches every agent, which converges on it and reports what it has."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.node.install.llamacpp import find_installed
from tests.system.harness import Cluster, eventually

pytestmark = pytest.mark.system


async def test_wanted_engines_are_pushed_to_agents_and_reported(tmp_path: Path) -> None:
    if find_installed() is None:
        pytest.fail("llama-server is not built: run `make test` (it builds and caches it first)")
    cluster = Cluster(tmp_path, extra={"engines": {"llama.cpp": "b11312"}})
    try:
        await cluster.init()
        await cluster.start_server()
        await cluster.start_agent("node-a")

        async def llama_installed() -> dict | None:
            [node] = cluster.ctl_json("nodes")
            engines = {e["name"]: e for e in node["engines"]}
            llama = engines.get("llama.cpp")
            return llama if llama and llama["installed"] else None

        llama = await eventually(llama_installed, "llama.cpp reported installed by node-a")
        assert "11312" in llama["version"]
        out = cluster.ctl("engine-check", "node-a", "llama.cpp")
        assert out.returncode == 0 and "11312" in out.stdout, out.stderr
    finally:
        cluster.stop()
