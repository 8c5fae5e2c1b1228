"""The LoRA trainer: a script run by the vLLM environment's python with the training overlay.

Run as ``<vLLM python> trainer.py CONFIG.json`` with ``PYTHONPATH=<overlay>``
(:func:`llmgw.node.training.overlay.overlay_env`); :func:`llmgw.node.training.run.run_trainer`
does that. Nothing at module level imports torch: llmgw's own environment imports this
module for its constants (the torch part runs from :func:`main` only).

Input: one JSON object in the file CONFIG.json (what
:meth:`llmgw.node.training.run.TrainerConfig.to_json` writes):

``base_model``  a Hugging Face model directory: config, safetensors, tokenizer, chat template
``pairs``       the training pairs, JSONL (:mod:`llmgw.training_pairs`)
``output_dir``  where the adapter goes; must not exist, or be an empty directory
``steps`` / ``epochs``  how long: exactly one of them is above 0 (an epoch is one pass
                over the pairs in batches of ``batch_size``)
``batch_size``, ``rank``, ``alpha``, ``dropout``, ``learning_rate``, ``seed``,
``device`` ("cpu" or "cuda:N"), ``max_seq_len`` (tokens of one rendered pair)

What it does: renders every pair with the tokenizer's chat template (the conversation
without the answer, with the generation prompt, then the whole conversation; the answer's
tokens are what the second adds), refuses pairs longer than ``max_seq_len`` by line number,
wraps the model in a PEFT LoRA on the attention projections (q/k/v/o) and trains it with
AdamW at a constant learning rate, the loss taken on the answer's tokens only, the order of
the pairs shuffled by ``seed`` every epoch. The adapter is saved (``adapter_config.json`` +
``adapter_model.safetensors``, what vLLM's runtime LoRA loading and llama.cpp's converter
read) into a scratch directory beside ``output_dir`` and renamed into place: there is
never a partial adapter at ``output_dir``.

Output: one JSON object per line on stdout, and nothing else there (whatever the libraries
print goes to stderr):

- ``{"event": "start", "pid", "steps", "pairs", "batch_size", "tokens", "trainable_params",
  "total_params", "device", "rank", "alpha", "load_s"}`` when training begins (``pid``: the
  trainer's process id, which is its process group's id when it was started in a session
  of its own; ``tokens``: of all pairs; ``load_s``: seconds spent before training);
- ``{"event": "progress", "step", "steps", "loss", "peak_memory_bytes", "device",
  "elapsed_s"}`` after every step, or every ``steps // MAX_PROGRESS_EVENTS`` steps for long
  runs (the first and last step always); ``loss`` is that step's, ``elapsed_s`` counts from
  the start event, ``peak_memory_bytes`` is ``torch.cuda.max_memory_allocated`` on CUDA and
  the process's peak resident set size on CPU;
- ``{"event": "done", "adapter_dir", "first_loss", "final_loss", "steps",
  "peak_memory_bytes", "elapsed_s"}`` once the adapter is in place (exit status 0);
- ``{"event": "error", "message"}`` for a failure it understands (bad config or pairs, a
  model without a chat template, no such device, out of memory, a diverging loss): the
  message says what to do (exit status :data:`EXIT_ERROR`);
- ``{"event": "stopped", "step"}`` after SIGTERM: it stops before the next step (or the
  next phase while loading) and exits with :data:`EXIT_TERMINATED` (143) without writing
  an adapter.

Anything else (a bug, a library's traceback) exits 1 with the traceback on stderr.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__" and sys.path:  # pragma: no cover - the script's own start
    # This directory holds gguf.py, run.py, ...: as the script's directory at the head of
    # sys.path they would shadow the real packages of those names (gguf!) in the engine's python.
    try:
        if Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
            del sys.path[0]
    except OSError:
        pass

import json
import math
import random
import resource
import shutil
import signal
import time
from typing import IO, Any, Iterator

__all__ = [
    "EVENTS",
    "EXIT_ERROR",
    "EXIT_TERMINATED",
    "MAX_PROGRESS_EVENTS",
    "TARGET_MODULES",
    "main",
    "output_taken",
    "partial_dir",
]

#: Exit status after an ``error`` event: a failure the trainer understood and explained.
EXIT_ERROR = 2
#: Exit status after SIGTERM: 128 + 15, what a shell reports for a process SIGTERM ended.
EXIT_TERMINATED = 128 + int(signal.SIGTERM)
#: The events the trainer prints.
EVENTS = ("start", "progress", "done", "error", "stopped")
#: Modules LoRA is applied to: the attention projections of Llama-like models, which every
#: engine's LoRA support (vLLM, llama.cpp) accepts.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
#: A long run prints about this many progress events (and always the first and last step):
#: a 100,000-step job must not flood the agent with events.
MAX_PROGRESS_EVENTS = 500
#: Gradient norm clipped to this: one odd batch must not throw the adapter away at a high
#: learning rate (the usual value for fine-tuning).
MAX_GRAD_NORM = 1.0
#: Label of tokens the loss ignores (the prompt's, padding): transformers' convention.
IGNORE_INDEX = -100
#: Bad pairs named in one error message (all are counted).
MAX_LINES_NAMED = 10
#: Variables set unless the caller set them: no network (a local model only), no progress
#: bars or advisory warnings interleaved with the libraries' output.
QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}

#: Config keys and their types (int accepted where float is asked).
_CONFIG_KEYS: dict[str, type | tuple[type, ...]] = {
    "base_model": str, "pairs": str, "output_dir": str, "steps": int, "epochs": int, "batch_size": int,
    "rank": int, "alpha": (int, float), "dropout": (int, float), "learning_rate": (int, float), "seed": int,
    "device": str, "max_seq_len": int,
}


def partial_dir(output_dir: Path, pid: int) -> Path:
    """Returns the scratch directory the trainer with process id ``pid`` saves into before
    renaming it to ``output_dir`` (removed by whoever finds it after a killed trainer)."""
    return output_dir.parent / f".{output_dir.name}.partial-{pid}"


def output_taken(output_dir: Path) -> bool:
    """Returns whether something is at ``output_dir`` that an adapter must not replace: a
    file, or a directory that is not empty (an empty directory is taken over)."""
    return output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir()))


class TrainerError(Exception):
    """A failure the trainer understands; ``str()`` is the ``error`` event's message."""


class Stopped(Exception):
    """SIGTERM arrived; training stops before the next step without saving."""


_stop_requested = False


def _on_sigterm(signum: int, frame: Any) -> None:
    global _stop_requested
    _stop_requested = True


def _check_stop(step: int = 0) -> None:
    """Raises :class:`Stopped` (carrying the steps done) when SIGTERM has arrived."""
    if _stop_requested:
        raise Stopped(step)


class Events:
    """Writes events, one JSON object per line, to the stdout the trainer was given.

    :meth:`claim` keeps a private copy of file descriptor 1 for events and points 1 at
    stderr, so whatever else prints to stdout (libraries, C code) cannot corrupt the stream.
    """

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    @classmethod
    def claim(cls) -> "Events":
        sys.stdout.flush()
        fd = os.dup(1)
        os.dup2(2, 1)
        return cls(os.fdopen(fd, "w", buffering=1, encoding="utf-8"))

    def emit(self, event: str, **fields: Any) -> None:
        self.out.write(json.dumps({"event": event, **fields}, allow_nan=False) + "\n")
        self.out.flush()


# -- config and data --------------------------------------------------------------------------


def load_config(path: Path) -> dict[str, Any]:
    """Returns the checked config in the JSON file ``path``; raises TrainerError saying which key is wrong."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TrainerError(f"cannot read the config {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise TrainerError(f"the config {path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise TrainerError(f"the config {path} is not a JSON object")
    missing = [key for key in _CONFIG_KEYS if key not in config]
    if missing:
        raise TrainerError(f"the config {path} lacks {', '.join(missing)}")
    for key, kind in _CONFIG_KEYS.items():
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise TrainerError(f"the config's {key} is {value!r}, of the wrong type")
    if (config["steps"] > 0) == (config["epochs"] > 0) or config["steps"] < 0 or config["epochs"] < 0:
        raise TrainerError("the config must ask for steps or for epochs: exactly one of them above 0")
    for key in ("batch_size", "rank", "max_seq_len"):
        if config[key] < 1:
            raise TrainerError(f"the config's {key} must be at least 1")
    if not config["learning_rate"] > 0 or not config["alpha"] > 0 or not 0 <= config["dropout"] < 1:
        raise TrainerError("the config's learning_rate and alpha must be above 0, dropout in [0, 1)")
    return config


def _load_pairs_module() -> Any:
    """Returns :mod:`llmgw.training_pairs`: imported from llmgw where it is importable,
    else loaded from the file beside this one (the engine's python has no llmgw)."""
    if __package__:
        from llmgw import training_pairs as pairs

        return pairs
    import importlib.util

    name = "_llmgw_training_pairs"
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "training_pairs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def encode_pairs(tokenizer: Any, pairs: list[Any], max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Returns (token ids, labels) per pair: the chat template's rendering, labels
    :data:`IGNORE_INDEX` except on the answer's tokens.

    Raises TrainerError naming the lines whose conversation the template renders so that
    the answer is not a suffix of it, or that come out longer than ``max_seq_len``.
    """
    encoded, too_long, odd = [], [], []
    for pair in pairs:
        messages = pair.as_messages()
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(messages, tokenize=False)
        if not isinstance(prompt, str) or not isinstance(whole, str) or not whole.startswith(prompt):
            odd.append(pair.line)
            continue
        prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        answer_ids = list(tokenizer(whole[len(prompt):], add_special_tokens=False)["input_ids"])
        if not answer_ids:
            odd.append(pair.line)
            continue
        ids = prompt_ids + answer_ids
        if len(ids) > max_seq_len:
            too_long.append((pair.line, len(ids)))
            continue
        encoded.append((ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids))
    if odd:
        raise TrainerError(
            f"the chat template does not render the answer as the end of the conversation for "
            f"{_named_lines(odd)}, so its tokens cannot be told apart: use a model whose template renders "
            "the conversation without the answer (with the generation prompt) as a prefix of the whole")
    if too_long:
        named = _first_named([f"line {line}: {n} tokens" for line, n in too_long])
        raise TrainerError(f"{len(too_long)} pair(s) are longer than max_seq_len {max_seq_len} tokens ({named}): "
                           "shorten them or raise max_seq_len")
    return encoded


def _first_named(items: list[str]) -> str:
    """Returns the first :data:`MAX_LINES_NAMED` of ``items``, and how many more there are."""
    more = len(items) - MAX_LINES_NAMED
    return ", ".join(items[:MAX_LINES_NAMED]) + (f" and {more} more" if more > 0 else "")


def _named_lines(numbers: list[int]) -> str:
    """Returns "line 3" or "lines 3, 7 and 2 more" for pairs at those line numbers."""
    return f"line{'s' if len(numbers) > 1 else ''} {_first_named([str(n) for n in numbers])}"


def batches(count: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Yields batches of indexes into ``count`` pairs forever: every epoch a new order
    (shuffled by ``seed``), each batch ``batch_size`` long except an epoch's last."""
    rng = random.Random(seed)
    order = list(range(count))
    while True:
        rng.shuffle(order)
        for start in range(0, count, batch_size):
            yield order[start:start + batch_size]


def total_steps(config: dict[str, Any], pairs: int) -> int:
    """Returns the steps of the run: ``steps``, or ``epochs`` passes over ``pairs`` in batches."""
    if config["steps"] > 0:
        return int(config["steps"])
    return int(config["epochs"]) * math.ceil(pairs / config["batch_size"])


def progress_every(steps: int) -> int:
    """Returns every how many steps a progress event goes out (see :data:`MAX_PROGRESS_EVENTS`)."""
    return max(1, steps // MAX_PROGRESS_EVENTS)


# -- training (torch from here on) ----------------------------------------------------------


def _peak_memory(torch: Any, device: Any) -> int:
    """Returns peak memory in bytes: allocated by torch on a CUDA device, else the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def _device(torch: Any, name: str) -> Any:
    """Returns the torch device ``name`` ("cpu", "cuda:N"); raises TrainerError when absent."""
    if name == "cpu":
        return torch.device("cpu")
    if not name.startswith("cuda:") or not name[5:].isdigit():
        raise TrainerError(f"device {name!r} is not \"cpu\" or \"cuda:N\"")
    index = int(name[5:])
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        raise TrainerError(f"device {name} is not available: this environment's torch sees {count} CUDA device(s) "
                           f"(torch {torch.__version__}); pick another device or train on cpu")
    return torch.device(name)


def _prepare_output(output: Path) -> None:
    """Refuses an ``output`` that exists and is not an empty directory (no adapter is overwritten)."""
    if output_taken(output):
        raise TrainerError(f"output_dir {output} already exists and is not empty: the trainer never overwrites "
                           "an adapter; choose a new directory")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrainerError(f"cannot create {output.parent}: {exc.strerror or exc}") from None


def train(config: dict[str, Any], events: Events) -> None:
    """Trains and saves the adapter the config asks for, emitting start, progress and done.

    Raises TrainerError for what it understands, :class:`Stopped` after SIGTERM.
    """
    started = time.monotonic()
    base = Path(config["base_model"])
    output = Path(config["output_dir"])
    if not (base / "config.json").is_file():
        raise TrainerError(f"base_model {base} has no config.json: it must be a Hugging Face model directory")
    _prepare_output(output)
    pairs_module = _load_pairs_module()
    try:
        pairs = pairs_module.read_pairs(config["pairs"])
    except pairs_module.PairsError as exc:
        raise TrainerError(f"{exc}; fix these lines and start the job again") from None
    except OSError as exc:
        raise TrainerError(f"cannot read the pairs file {config['pairs']}: {exc.strerror or exc}") from None
    _check_stop()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import peft
    except ImportError as exc:
        raise TrainerError(f"peft cannot be imported ({exc}): run the trainer with PYTHONPATH set to the training "
                           "overlay (`python -m llmgw.node.training.overlay install` installs it)") from None
    _check_stop()
    device = _device(torch, config["device"])
    torch.manual_seed(config["seed"])
    try:
        tokenizer = AutoTokenizer.from_pretrained(base)
    except (OSError, ValueError) as exc:
        raise TrainerError(f"cannot load the tokenizer of {base}: {exc}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise TrainerError(f"the tokenizer of {base} has no chat template, so pairs cannot be rendered as the engine "
                           "will see them: use a chat (instruct) model, or add chat_template.jinja to it")
    encoded = encode_pairs(tokenizer, pairs, config["max_seq_len"])
    _check_stop()
    dtype = torch.float32
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        dtype = torch.bfloat16  # the frozen base in bf16; peft keeps the adapter's weights in float32
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        model.to(device)
    except torch.cuda.OutOfMemoryError:
        raise TrainerError(f"the base model does not fit in {device}'s memory: use a GPU with more memory") from None
    except (OSError, ValueError) as exc:
        raise TrainerError(f"cannot load the model in {base}: {exc}") from None
    _check_stop()
    lora = peft.LoraConfig(r=config["rank"], lora_alpha=config["alpha"], lora_dropout=config["dropout"],
                           target_modules=list(TARGET_MODULES), bias="none", task_type="CAUSAL_LM")
    try:
        model = peft.get_peft_model(model, lora)
    except ValueError as exc:  # e.g. no q_proj/k_proj/v_proj/o_proj in this architecture
        raise TrainerError(f"cannot put a LoRA on {base} ({exc}): the trainer adapts {', '.join(TARGET_MODULES)}, "
                           "which this model's architecture must have") from None
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config["learning_rate"], weight_decay=0.0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    steps = total_steps(config, len(encoded))
    every = progress_every(steps)
    order = batches(len(encoded), config["batch_size"], config["seed"])
    events.emit("start", pid=os.getpid(), steps=steps, pairs=len(encoded), batch_size=config["batch_size"],
                tokens=sum(len(ids) for ids, _ in encoded),
                trainable_params=sum(p.numel() for p in params),
                total_params=sum(p.numel() for p in model.parameters()),
                device=str(device), rank=config["rank"], alpha=config["alpha"],
                load_s=round(time.monotonic() - started, 3))
    began = time.monotonic()
    first_loss = final_loss = math.nan
    for step in range(1, steps + 1):
        _check_stop(step - 1)
        batch = [encoded[i] for i in next(order)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch], device=device)
        labels = torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab)) for _, lab in batch], device=device)
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch], device=device)
        try:
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        except torch.cuda.OutOfMemoryError:
            raise TrainerError(f"out of memory on {device} at step {step} (peak {_peak_memory(torch, device)} bytes): "
                               "lower batch_size or max_seq_len, or use a GPU with more memory") from None
        value = float(loss.detach())
        if not math.isfinite(value):
            raise TrainerError(f"the loss became {value} at step {step}: lower learning_rate")
        if step == 1:
            first_loss = value
        final_loss = value
        if step == 1 or step == steps or step % every == 0:
            events.emit("progress", step=step, steps=steps, loss=value, peak_memory_bytes=_peak_memory(torch, device),
                        device=str(device), elapsed_s=round(time.monotonic() - began, 3))
    _check_stop(steps)
    scratch = partial_dir(output, os.getpid())
    try:
        model.save_pretrained(str(scratch), safe_serialization=True)
        (scratch / "README.md").unlink(missing_ok=True)  # peft's empty model card
        if output.exists():
            output.rmdir()  # checked empty before training
        os.rename(scratch, output)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    events.emit("done", adapter_dir=str(output), first_loss=first_loss, final_loss=final_loss, steps=steps,
                peak_memory_bytes=_peak_memory(torch, device), elapsed_s=round(time.monotonic() - began, 3))


def main(argv: list[str]) -> int:
    """Trains as the module docstring says; returns the exit status (0, 1, 2 or 143)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    events = Events.claim()
    if len(argv) != 1:
        events.emit("error", message="usage: trainer.py CONFIG.json")
        return EXIT_ERROR
    try:
        train(load_config(Path(argv[0])), events)
    except TrainerError as exc:
        events.emit("error", message=str(exc))
        return EXIT_ERROR
    except Stopped as exc:
        events.emit("stopped", step=exc.args[0] if exc.args else 0)
        return EXIT_TERMINATED
    except MemoryError:
        events.emit("error", message="out of memory: lower batch_size or max_seq_len, or give the job more memory")
        return EXIT_ERROR
    return 0


if __name__ == "__main__":  # pragma: no cover - run by the engine's python
    sys.exit(main(sys.argv[1:]))
