"""A training job runs as the engines' user (issue 18): the trainer and the GGUF conversion, with
the agent bounded to its unit's capabilities, as tests/system/test_least_privilege.py runs it.

The engines' user cannot enter /root, where `make test` keeps the vLLM environment, its Python,
the training overlay and llama.cpp's source tree. So they are staged where it can read them,
without copying gigabytes: a virtual environment on the system's Python of the same version
whose site-packages are hard links to the vLLM environment's, and hard-linked copies of the
overlay and the source tree. The agent finds them as its default engines root
(``LLMGW_ENGINES_DIR``) and XDG cache, as a node finds what its own installs left there; what
appears under its ``install_dir`` is the engines' user's.

While the job trains, every trainer process runs as the engines' user with no capability; the
job ends with a GGUF adapter, converted as that user in the job's directory (theirs).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from llmgw.node.engines.vllm import VllmEngine
from llmgw.node.install import llamacpp, python_env
from llmgw.node.training.overlay import find_overlay, install_overlay
from tests.engines.test_training_e2e import ended, trainers, write_pairs
from tests.system.harness import WAIT, Cluster, eventually
from tests.system.test_least_privilege import NODE, PYTHON, USER, agent_proc, capabilities, join, root  # noqa: F401 - root is a fixture
from tests.system.test_least_privilege import pytestmark as least_privilege_marks

pytestmark = [pytest.mark.system, *least_privilege_marks]


def hard_link_tree(source: Path, target: Path) -> None:
    """Copies the tree ``source`` to ``target`` as hard links (directories new, files shared);
    skips the test where they cannot be (another filesystem)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["cp", "-al", str(source), str(target)], capture_output=True, text=True, timeout=WAIT)
    if done.returncode != 0:
        pytest.skip(f"cannot hard-link {source} to {target} ({done.stderr.strip()}): staging would copy gigabytes")


def stage_vllm(engines: Path) -> None:
    """Stages the vLLM environment under ``engines`` (an engines root) on :data:`PYTHON`."""
    real = Path(VllmEngine().python()).parent.parent
    staged = engines / "vllm" / real.name
    subprocess.run([str(PYTHON), "-m", "venv", "--without-pip", str(staged)], check=True, timeout=WAIT)
    site = Path("lib") / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    shutil.rmtree(staged / site)
    hard_link_tree(real / site, staged / site)
    for name in (python_env.MARKER, python_env.ENV_LOCK_COPY):  # what makes it count as installed
        shutil.copy2(real / name, staged / name)


async def test_a_training_job_runs_as_the_engines_user(root: Path, tiny_model: Path, tiny_gguf: Path,
                                                       llamacpp_sdist: Path) -> None:
    stage = root / "stage"
    engines, xdg = stage / "engines", stage / "xdg"
    stage_vllm(engines)
    overlay = find_overlay() or await trio.to_thread.run_sync(install_overlay, Path(VllmEngine().python()))
    hard_link_tree(overlay, engines / overlay.relative_to(python_env.default_root()))
    tree = next(p for p in llamacpp_sdist.parents if (p / llamacpp.SRC_MARKER).is_file())  # the unpacked sdist
    hard_link_tree(tree, xdg / "llmgw" / "engines" / "llama.cpp" / tree.relative_to(llamacpp.default_root()))
    # The shared model is readable by every user: weights at a local path must be the engines' to read.
    model, gguf = tiny_model, tiny_gguf
    pairs = write_pairs(stage / "pairs.jsonl")

    async with Cluster(root) as cluster:
        config = join(cluster, root)
        engine_uid = pwd.getpwnam(USER).pw_uid
        agent = agent_proc(config, root / "agent.log", xdg, env={python_env.ROOT_ENV: str(engines)})
        cluster.agents[NODE] = agent
        await agent.wait_for_line(rf"agent: joined \S+ as node '{NODE}'")
        assert cluster.ctl("models", "add", "tiny-gguf", "--engine", "llama.cpp", "--source", str(gguf),
                           "--replicas", "0").returncode == 0
        job = cluster.ctl_json("jobs", "train", "--model", "tiny-gguf", "--weights", str(model), "--data",
                               str(pairs), "--steps", "200", "--lr", "0.01", "--rank", "4")

        # From its start (torch's import takes seconds) to its last step, the trainer is the engines' user's.
        running = await eventually(lambda: trainers(cluster), "the trainer to start", timeout=120)
        for proc in running:
            assert proc.uids().real == proc.uids().effective == engine_uid, proc
            assert capabilities(proc.pid)["CapEff"] == 0
        done = await ended(cluster, job["id"])
        assert done["state"] == "succeeded", done["message"]
        assert done["result_format"] == "gguf" and done["result_bytes"] > 0
        # Nothing under install_dir is root's (the join's doctor ran its engine checks as the engines' user).
        assert {p.lstat().st_uid for p in (root / NODE / "engines").rglob("*")} <= {engine_uid}
        assert os.stat(root / NODE / "engine-home").st_uid == engine_uid
