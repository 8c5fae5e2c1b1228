"""Running the LoRA trainer (:mod:`llmgw.node.training.trainer`) under trio.

:func:`run_trainer` writes the job's :class:`TrainerConfig` into its work directory,
starts ``<vLLM python> trainer.py CONFIG`` with the training overlay on ``PYTHONPATH``
in a session and process group of its own, hands every JSON event the trainer prints on
stdout to ``on_event`` as it arrives, keeps the last lines of its stderr for errors, and
returns a :class:`TrainResult` once the adapter is in place. Cancelling it stops the
whole process group (SIGTERM, which the trainer answers by stopping before its next
step, then SIGKILL after :data:`STOP_GRACE`) and waits until nothing of it runs any
more; no adapter is left behind.

The trainer is the agent's child through pipes, not a detached engine
(:func:`llmgw.node.process.spawn` gives engines a log file so they outlive the agent): a
training job belongs to the agent that runs it, and one whose agent died stops at its
next event (its stdout is gone) instead of training for nobody.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
import trio

from llmgw.node.engine_user import EngineUser
from llmgw.node.child import MAX_LINE, run_reporting_child
from llmgw.node.process import describe_exit
from llmgw.node.training.overlay import overlay_env
from llmgw.node.training.trainer import EVENTS, EXIT_ERROR, EXIT_TERMINATED, QUIET_ENV, output_taken, partial_dir

__all__ = [
    "CONFIG_NAME",
    "STOP_GRACE",
    "TRAINER_SCRIPT",
    "TrainResult",
    "TrainerConfig",
    "TrainingError",
    "parse_event",
    "run_trainer",
]

#: The script the engine's python runs.
TRAINER_SCRIPT = Path(__file__).resolve().with_name("trainer.py")
#: The config file written into the work directory.
CONFIG_NAME = "trainer-config.json"
#: Seconds between SIGTERM and SIGKILL when a run is cancelled: the trainer stops before
#: its next step, and one step of a large model on a GPU takes seconds; ten is a hang.
STOP_GRACE = 10.0
#: stderr lines kept for errors: a Python traceback with its context.
STDERR_LINES = 40
#: stderr lines put into a TrainingError's message.
ERROR_LINES = 12
#: A stdout line longer than this is not an event (events are a few hundred bytes); it is cut.
MAX_EVENT_LINE = MAX_LINE
#: Bounds of :class:`TrainerConfig`. Rank: vLLM's largest ``--max-lora-rank`` is 512.
MAX_RANK = 512
#: A million steps is months on a GPU: beyond it a number is a mistake.
MAX_STEPS = 1_000_000
#: Epochs over the same pairs: past a thousand an adapter only memorises.
MAX_EPOCHS = 1000
#: Sequences a step trains on at once.
MAX_BATCH_SIZE = 1024
#: Tokens of one rendered pair; 16 is less than a chat template's own markup, 131072 the
#: longest context of common open models.
MIN_SEQ_LEN, MAX_SEQ_LEN = 16, 131072

_DEVICE = re.compile(r"cpu|cuda:\d+")


class TrainingError(Exception):
    """A training run failed; ``str()`` is the trainer's own message or its last stderr lines."""


def _absolute(instance: Any, attribute: attrs.Attribute, value: Path) -> None:  # type: ignore[type-arg]
    if not value.is_absolute():
        raise ValueError(f"{attribute.name} must be an absolute path, not {str(value)!r}")


def _between(low: float, high: float) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:  # type: ignore[type-arg]
        if isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"{attribute.name} must be between {low:g} and {high:g}, not {value!r}")

    return check


def _positive_up_to(high: float) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:  # type: ignore[type-arg]
        if isinstance(value, bool) or not 0 < value <= high:
            raise ValueError(f"{attribute.name} must be above 0 and at most {high:g}, not {value!r}")

    return check


def _device(instance: Any, attribute: attrs.Attribute, value: str) -> None:  # type: ignore[type-arg]
    if not _DEVICE.fullmatch(value):
        raise ValueError(f"device must be \"cpu\" or \"cuda:N\", not {value!r}")


@attrs.frozen
class TrainerConfig:
    """One training job, as the trainer reads it (see :mod:`llmgw.node.training.trainer`).

    Paths are absolute. Exactly one of ``steps`` and ``epochs`` is above 0. ``alpha``
    defaults to twice the rank (the LoRA update is scaled by alpha / rank). Raises
    ValueError, naming the field, for a value out of its bounds.
    """

    base_model: Path = attrs.field(converter=Path, validator=_absolute)
    pairs: Path = attrs.field(converter=Path, validator=_absolute)
    output_dir: Path = attrs.field(converter=Path, validator=_absolute)
    steps: int = attrs.field(default=0, validator=[attrs.validators.instance_of(int), _between(0, MAX_STEPS)])
    epochs: int = attrs.field(default=0, validator=[attrs.validators.instance_of(int), _between(0, MAX_EPOCHS)])
    batch_size: int = attrs.field(default=4, validator=[attrs.validators.instance_of(int),
                                                        _between(1, MAX_BATCH_SIZE)])
    rank: int = attrs.field(default=8, validator=[attrs.validators.instance_of(int), _between(1, MAX_RANK)])
    alpha: float = attrs.field(converter=float, validator=_positive_up_to(16 * MAX_RANK),
                               default=attrs.Factory(lambda self: 2.0 * self.rank, takes_self=True))
    dropout: float = attrs.field(default=0.0, converter=float, validator=_between(0.0, 0.9))
    learning_rate: float = attrs.field(default=2e-4, converter=float, validator=_positive_up_to(1.0))
    seed: int = attrs.field(default=0, validator=[attrs.validators.instance_of(int), _between(0, 2**32 - 1)])
    device: str = attrs.field(default="cpu", validator=_device)
    max_seq_len: int = attrs.field(default=1024, validator=[attrs.validators.instance_of(int),
                                                            _between(MIN_SEQ_LEN, MAX_SEQ_LEN)])

    def __attrs_post_init__(self) -> None:
        if (self.steps > 0) == (self.epochs > 0):
            raise ValueError("ask for steps or for epochs: exactly one of them above 0")

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON-ready dict the trainer reads (see :meth:`from_json`)."""
        return {key: str(value) if isinstance(value, Path) else value
                for key, value in attrs.asdict(self, recurse=False).items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TrainerConfig":
        """Returns the config :meth:`to_json` wrote; TypeError/ValueError if malformed."""
        return cls(**dict(data))


@attrs.frozen
class TrainResult:
    """A finished run: the adapter's directory, the losses of its first and last step,
    its steps, its peak memory in bytes (see the trainer), its device, and the seconds
    the whole run took (``elapsed_s``, starting the python included) and the training
    loop alone (``train_s``)."""

    adapter_dir: Path
    first_loss: float
    final_loss: float
    steps: int
    peak_memory_bytes: int
    device: str
    elapsed_s: float
    train_s: float


def parse_event(line: bytes | str) -> dict[str, Any] | None:
    """Returns the event a trainer's stdout line holds, or None when it holds none.

    An event is a JSON object whose ``"event"`` is one of the trainer's
    (:data:`~llmgw.node.training.trainer.EVENTS`); anything else (empty, not JSON, another
    JSON value, an unknown event, a line longer than :data:`MAX_EVENT_LINE`) is None.
    """
    if len(line) > MAX_EVENT_LINE:
        return None
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("event") not in EVENTS:
        return None
    return data


async def run_trainer(
    config: TrainerConfig,
    *,
    python: Path,
    overlay: Path,
    workdir: Path,
    on_event: Callable[[dict[str, Any]], None],
    user: EngineUser | None = None,
    env: Mapping[str, str] | None = None,
) -> TrainResult:
    """Runs the trainer on ``config`` and returns the result once the adapter is in
    ``config.output_dir``.

    ``python``: the vLLM environment's interpreter; ``overlay``: the training overlay
    (:func:`~llmgw.node.training.overlay.find_overlay`); ``workdir``: a directory for the
    config file (:data:`CONFIG_NAME`), created if missing, the trainer's working directory.
    ``on_event`` is called with every event (a dict, see
    :mod:`llmgw.node.training.trainer`) as it is printed; it must be cheap, and an exception
    from it stops the trainer (as a cancellation does) and propagates. ``user``: who runs the
    trainer (:func:`llmgw.node.engine_user.resolve`; None: this process's user); that user
    must be able to read the model and pairs and write
    ``workdir`` and the output's parent. ``env``: the trainer's environment (default: this
    process's); ``PYTHONPATH`` is replaced by the overlay, and
    :data:`~llmgw.node.training.trainer.QUIET_ENV` fills what it does not set. For an
    engines' user, pass :func:`llmgw.node.engine_user.home_env` of its prepared home in it.

    Raises :class:`TrainingError` when the output directory exists and is not empty
    (before starting anything), the trainer cannot start, exits
    non-zero (its ``error`` event's message, or its last stderr lines), or exits 0
    without a ``done`` event. Cancellation stops the trainer's whole process group
    (SIGTERM, SIGKILL after :data:`STOP_GRACE`) and waits for it, then propagates. On any
    failure or cancellation the trainer's scratch directory is removed, and so is what
    this run put at the output directory: no adapter is left.
    """
    output = config.output_dir
    if output_taken(output):
        raise TrainingError(f"output_dir {output} already exists and is not empty: choose a new directory")
    output_existed = output.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / CONFIG_NAME
    config_path.write_text(json.dumps(config.to_json(), indent=2) + "\n")
    child_env = {**QUIET_ENV, **(os.environ if env is None else env), **overlay_env(overlay)}
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    last: dict[str, dict[str, Any]] = {}
    strays: list[str] = []  # stdout lines that are not events: shown with stderr's on failure
    pids: list[int] = []
    started = time.monotonic()

    def on_stdout(raw: bytes) -> None:
        event = parse_event(raw)
        if event is None:
            if raw.strip():
                strays.append(raw.decode("utf-8", errors="replace"))
                del strays[:-STDERR_LINES]
            return
        last[event["event"]] = event
        on_event(event)

    succeeded = False
    try:
        try:
            ended = await run_reporting_child(
                [str(python), str(TRAINER_SCRIPT), str(config_path)], env=child_env, cwd=workdir,
                on_stdout=on_stdout, stop_grace=STOP_GRACE, user=user, stderr_lines=STDERR_LINES,
                on_start=pids.append)
        except OSError as exc:
            raise TrainingError(f"cannot start the trainer with {python}: {exc}") from None
        done = last.get("done")
        if ended.code == 0 and done is not None:
            succeeded = True
            return TrainResult(
                adapter_dir=Path(done["adapter_dir"]), first_loss=float(done["first_loss"]),
                final_loss=float(done["final_loss"]), steps=int(done["steps"]),
                peak_memory_bytes=int(done["peak_memory_bytes"]), device=str(last.get("start", {}).get("device", "")),
                elapsed_s=time.monotonic() - started, train_s=float(done["elapsed_s"]))
        raise TrainingError(_failure(ended.code, last, [*strays, *ended.stderr]))
    finally:
        if not succeeded and pids:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_remove_leftovers, output, pids[0], output_existed)


def _failure(code: int | None, last: Mapping[str, dict[str, Any]], tail: list[str]) -> str:
    """Returns a TrainingError's message for a run that ended with ``code`` without success."""
    error = last.get("error")
    if code == EXIT_ERROR and error is not None:
        return str(error.get("message", "the trainer failed without saying why"))
    if code in (EXIT_TERMINATED, -signal.SIGTERM):
        return "the trainer was stopped (SIGTERM) before it finished; no adapter was written"
    if code == 0:
        what = "the trainer exited without reporting an adapter"
    else:
        what = f"the trainer {describe_exit(code)}"
    lines = "\n".join(tail[-ERROR_LINES:]) or "(no output on stderr)"
    return f"{what}; its last output:\n{lines}"


def _remove_leftovers(output: Path, pid: int, output_existed: bool) -> None:
    """Removes what a failed or stopped trainer (process ``pid``) may have left: its scratch
    directory, and whatever is at ``output`` (it was absent or empty before the run, so it is
    this run's: an adapter renamed into place just before a cancellation); an ``output`` that
    existed before is left, empty."""
    shutil.rmtree(partial_dir(output, pid), ignore_errors=True)
    if output.is_dir() and (not output_existed or any(output.iterdir())):
        shutil.rmtree(output, ignore_errors=True)
        if output_existed:
            output.mkdir(exist_ok=True)
