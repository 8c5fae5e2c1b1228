"""agent.yaml ``engines:`` names hand-installed engines: ctl nodes says which one each node runs, and why one does not."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from llmgw.node.install.llamacpp import find_installed
from tests.system.harness import Cluster, eventually

pytestmark = pytest.mark.system


async def test_named_engines_are_proven_and_shown_by_ctl_nodes(tmp_path: Path) -> None:
    built = find_installed()
    if built is None:
        pytest.fail("llama-server is not built: run `make test` (it builds and caches it first)")
    # The operator's own llama-server: a wrapper elsewhere, so the path reported cannot be
    # the installed one the agent would otherwise find in the default engines root.
    server = tmp_path / "opt" / "llama-server"
    server.parent.mkdir()
    server.write_text(f'#!/bin/sh\nexec {built.binary} "$@"\n')
    server.chmod(0o755)
    broken = tmp_path / "opt" / "vllm-python"
    broken.write_text("not a program\n")  # mode 0644: cannot be run
    # server.yaml asks every node for llama.cpp: a node whose agent.yaml names it installs nothing.
    async with Cluster(tmp_path, extra={"engines": {"llama.cpp": "b11312"}}) as cluster:
        await cluster.start_agent("node-a", extra={"engines": {
            "llama.cpp": {"server": str(server)}, "vllm": {"python": str(broken)}}})

        async def proven() -> dict[str, Any] | None:
            [node] = cluster.ctl_json("nodes")
            engines = {e["name"]: e for e in node["engines"]}
            done = engines["llama.cpp"]["installed"] and "not usable" in engines["vllm"]["detail"]
            return engines if done else None

        engines = await eventually(proven, "node-a's named engines proven")
        llama, vllm = engines["llama.cpp"], engines["vllm"]
        assert (llama["version"], llama["path"], llama["origin"], llama["state"]) == (
            "b11312", str(server), "agent.yaml", "")
        assert (vllm["installed"], vllm["path"], vllm["origin"]) == (False, str(broken), "agent.yaml")
        assert vllm["detail"] == (
            f"not usable: {broken} is not executable by this user (uid {os.getuid()}); "
            "fix engines.vllm.python in agent.yaml (llmgw does not replace a path named there)")
        assert engines["sim"]["origin"] == "built-in"

        out = cluster.ctl("nodes")
        assert out.returncode == 0, out.stderr
        assert "vllm (not usable)" in out.stdout
        assert f"  llama.cpp b11312 {server} (agent.yaml)" in out.stdout
        assert f"  vllm: not usable: {broken} is not executable" in out.stdout

        check = cluster.ctl("engine-check", "node-a", "llama.cpp")
        assert check.returncode == 0, check.stderr
        assert check.stdout.startswith(f"llama.cpp b11312 at {server} (named in agent.yaml")
        refused = cluster.ctl("engine-check", "node-a", "vllm")
        assert refused.returncode != 0 and f"vllm at {broken} (engines.vllm.python in agent.yaml) is not usable" \
            in refused.stderr
        # Nothing was installed beside the named llama-server.
        assert not (tmp_path / "node-a" / "state" / "engines" / "llama.cpp").exists()
