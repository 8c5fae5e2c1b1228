"""What one training job does on a node: the ``train`` of :class:`llmgw.node.jobs.JobRunner`.

In order: find the vLLM environment (its torch trains) and the training overlay (peft,
accelerate: installed once, hash-locked, beside it), fetch the weights to train on (a
local directory, a URL or ``hf://org/repo`` as for any model), run the trainer
(:func:`llmgw.node.training.run.run_trainer`) as the engines' user, with what engines inherit
of the agent's environment and only the card placement chose visible (as for a shard:
:func:`llmgw.node.engines.gpu_env`; none for a CPU job), then package the result: the PEFT
directory as one tar (what vLLM loads), or, for a model llama.cpp serves, the adapter
converted to GGUF with the installed llama.cpp's own conversion script.
"""

from __future__ import annotations

import json
import logging
import math
import tarfile
from pathlib import Path
from typing import Awaitable, Callable

import trio

from llmgw.node.engine_user import hand_over, home_env, prepare_home, resolve
from llmgw.node.engines import base_environment, gpu_env
from llmgw.node.fetch import FetchSettings, fetch_weights
from llmgw.node.jobs import JobSpec, Train
from llmgw.node.training.gguf import convert_adapter_to_gguf, find_llamacpp_sdist
from llmgw.node.install import InstallError
from llmgw.node.install.as_user import run_as_engine_user
from llmgw.node.install.llamacpp import fetch_sdist
from llmgw.node.install.python_env import default_root
from llmgw.node.training.overlay import SUBDIR as OVERLAY_SUBDIR
from llmgw.node.training.overlay import find_overlay, install_overlay, vllm_python
from llmgw.node.training.run import TrainerConfig, run_trainer
from llmgw.training import GGUF, PEFT

log = logging.getLogger(__name__)


def make_train(*, engines_root: Path, llamacpp_cache: Path, fetch: FetchSettings, engine_user: str,
               engine_home: Path) -> Train:
    """Returns the ``train`` of a node whose engines live under ``engines_root`` (llama.cpp's
    source tree, with its GGUF converter, under ``llamacpp_cache``), whose weights are fetched
    with ``fetch``, and whose engines run as ``engine_user`` ("" the agent's own user) with
    their home ``engine_home``."""

    async def train(spec: JobSpec, pairs: Path, workdir: Path, on_event: Callable[[str], None]) -> tuple[Path, str]:
        def note(message: str) -> None:
            on_event(json.dumps({"event": "agent", "message": message}))

        async def install(request: dict[str, str], writes: Path, what: str,
                          here: Callable[[], Awaitable[Path]]) -> Path:
            """Runs the install ``request`` as the engines' user, like every engine install
            (llmgw/node/install/as_user.py), or ``here()`` where engines run as the agent."""
            if not engine_user:
                return await here()
            return Path(await run_as_engine_user(request, user_name=engine_user, home=engine_home, writes=(writes,),
                                                 progress=note, what=what))

        python = await trio.to_thread.run_sync(vllm_python)  # FileNotFoundError says how to install it
        overlay = (await trio.to_thread.run_sync(find_overlay, engines_root)
                   or await trio.to_thread.run_sync(find_overlay, default_root()))  # one `make test` installed
        if overlay is None:
            note("installing the training overlay (peft, accelerate; once per node)")
            overlay = await install(
                {"action": "overlay", "python": str(python), "root": str(engines_root)}, engines_root / OVERLAY_SUBDIR,
                "installing the training overlay",
                lambda: trio.to_thread.run_sync(lambda: install_overlay(python, engines_root, note)))
        weights = await fetch_weights(spec.weights, fetch, note, what="training weights")
        user = await trio.to_thread.run_sync(resolve, engine_user) if engine_user else None
        # What engines inherit (nothing of the agent's own secrets), and only the card placement chose.
        cards = ((spec.gpu,), (spec.gpu_uuid,)) if spec.gpu >= 0 else ((), ())
        env = {**base_environment(), **gpu_env(*cards)}
        workdir.mkdir(parents=True, exist_ok=True)
        if user is not None:
            home = await trio.to_thread.run_sync(prepare_home, engine_home, user)
            env.update(home_env(home))
            await trio.to_thread.run_sync(hand_over, pairs.parent, user)
        p = spec.params
        config = TrainerConfig(
            base_model=Path(weights).resolve(), pairs=pairs.resolve(), output_dir=(workdir / "adapter").resolve(),
            steps=p.steps, epochs=0 if p.steps else max(1, math.ceil(p.epochs)), rank=p.rank, alpha=p.alpha,
            learning_rate=p.learning_rate, seed=p.seed, device="cuda:0" if spec.gpu >= 0 else "cpu",
            max_seq_len=p.max_seq_len,
        )
        result = await run_trainer(config, python=python, overlay=overlay, workdir=workdir / "trainer",
                                   on_event=lambda event: on_event(json.dumps(event, sort_keys=True)),
                                   user=user, env=env)
        if spec.gguf:
            sdist = await trio.to_thread.run_sync(lambda: find_llamacpp_sdist([llamacpp_cache])
                                                  or find_llamacpp_sdist())
            if sdist is None:  # llama-server came from a release archive, or agent.yaml names one
                note("fetching the llama.cpp source tree (its convert_lora_to_gguf.py converts the adapter)")
                try:
                    sdist = await install({"action": "sdist", "cache": str(llamacpp_cache)}, llamacpp_cache,
                                          "fetching the llama.cpp source tree", lambda: fetch_sdist(llamacpp_cache, note))
                except InstallError as exc:
                    raise RuntimeError(f"the adapter cannot be converted to GGUF for llama.cpp: {exc}") from None
            out = workdir / "adapter.gguf"
            note("converting the adapter to GGUF with llama.cpp's convert_lora_to_gguf.py")
            await trio.to_thread.run_sync(lambda: convert_adapter_to_gguf(
                python, result.adapter_dir, Path(weights), out, sdist, env=env, user=user))
            return out, GGUF
        out = workdir / "adapter.tar"
        await trio.to_thread.run_sync(pack_directory, result.adapter_dir, out)
        return out, PEFT

    return train


def pack_directory(directory: Path, out: Path) -> Path:
    """Writes the files of ``directory`` (not the directory itself, no owners) into the tar ``out``."""
    with tarfile.open(out, "w") as tar:
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                info = tar.gettarinfo(str(path), arcname=str(path.relative_to(directory)))
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                with path.open("rb") as f:
                    tar.addfile(info, f)
    return out
