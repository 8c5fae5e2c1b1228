"""The LoRA training toolkit without torch: the job's config, the pairs file's checks, the
trainer's events and the plumbing of run_trainer, the overlay's install steps, the trainer's
pure helpers (issue 17). The real trainer runs in tests/engines/test_training.py."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio

from llmgw import training_pairs as pairs
from llmgw.node import child
from llmgw.node.training import overlay, run, trainer
from llmgw.node.training.gguf import GgufConversionError, convert_adapter_to_gguf, find_llamacpp_sdist
from llmgw.training_pairs import MAX_PROBLEMS_SHOWN, Pair, PairsError, parse_pairs, read_pairs
from llmgw.node.training.run import TrainerConfig, TrainingError, parse_event, run_trainer

# -- TrainerConfig ------------------------------------------------------------------------------


def config(**changes: Any) -> TrainerConfig:
    fields: dict[str, Any] = {"base_model": "/m", "pairs": "/p.jsonl", "output_dir": "/out", "steps": 10}
    fields.update(changes)
    return TrainerConfig(**fields)


def test_config_defaults_and_json_round_trip() -> None:
    c = config(rank=16)
    assert c.alpha == 32.0 and c.device == "cpu" and c.epochs == 0 and c.batch_size == 4
    data = c.to_json()
    assert data["base_model"] == "/m" and data["steps"] == 10 and data["alpha"] == 32.0
    assert json.loads(json.dumps(data)) == data
    assert TrainerConfig.from_json(data) == c
    assert set(data) == set(trainer._CONFIG_KEYS), "the trainer reads exactly what the config writes"


@pytest.mark.parametrize("changes, words", [
    ({"base_model": "relative/model"}, "base_model must be an absolute path"),
    ({"steps": 0}, "exactly one"),
    ({"steps": 5, "epochs": 2}, "exactly one"),
    ({"steps": -1}, "steps must be between"),
    ({"steps": True}, "steps must be between"),
    ({"rank": 0}, "rank must be between 1 and 512"),
    ({"rank": 513}, "rank must be between"),
    ({"alpha": 0}, "alpha must be above 0"),
    ({"learning_rate": 0}, "learning_rate must be above 0"),
    ({"learning_rate": 3}, "learning_rate must be above 0 and at most 1"),
    ({"device": "gpu"}, "device must be \"cpu\" or \"cuda:N\""),
    ({"device": "cuda"}, "cuda:N"),
    ({"device": "cuda:x"}, "cuda:N"),
    ({"max_seq_len": 8}, "max_seq_len must be between 16"),
    ({"batch_size": 0}, "batch_size must be between 1"),
    ({"seed": -1}, "seed must be between"),
    ({"dropout": 1.0}, "dropout must be between"),
])
def test_config_refuses_values_out_of_bounds(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        config(**changes)


def test_config_takes_epochs_and_cuda_devices() -> None:
    c = config(steps=0, epochs=3, device="cuda:1", alpha=4)
    assert c.epochs == 3 and c.device == "cuda:1" and c.alpha == 4.0


# -- pairs --------------------------------------------------------------------------------------


def test_pairs_of_both_forms_and_blank_lines() -> None:
    lines = [
        json.dumps({"prompt": "hi", "completion": "hello", "id": 7}),
        "",
        json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
                                 {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                                 {"role": "assistant", "content": "d"}]}),
    ]
    got = parse_pairs(lines)
    assert got == [
        Pair(1, (("user", "hi"), ("assistant", "hello"))),
        Pair(3, (("system", "be brief"), ("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"))),
    ]
    assert got[1].answer == "d" and got[0].as_messages()[1] == {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize("line, words", [
    ("{not json", "not JSON (Expecting property name enclosed in double quotes at column 2)"),
    ("[1, 2]", "a JSON list, not an object"),
    ('{"prompt": "q"}', 'has no "completion"'),
    ('{"completion": "a"}', 'has no "prompt"'),
    ('{"prompt": "q", "completion": 3}', '"completion" is a JSON number, not a string'),
    ('{"prompt": " ", "completion": "a"}', '"prompt" is empty'),
    ('{"question": "q"}', 'has neither'),
    ('{"prompt": "q", "completion": "a", "messages": []}', "use one form"),
    ('{"messages": {"role": "user"}}', '"messages" is a JSON object, not a list'),
    ('{"messages": [{"role": "assistant", "content": "a"}]}', "at least a user message"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "a"}]}',
     "the last message must be the assistant's answer"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "a"}]}', "role 'tool'"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}, '
     '{"role": "assistant", "content": "a"}]}', "only the first message may be one"),
    ('{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}',
     "no user message comes before the answer"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}', "message 1 has no content"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}', "answer) is empty"),
])
def test_a_bad_line_is_refused_with_its_number_and_reason(line: str, words: str) -> None:
    good = json.dumps({"prompt": "q", "completion": "a"})
    with pytest.raises(PairsError) as caught:
        parse_pairs([good, "", line, good], source="train.jsonl")
    assert caught.value.problems[0][0] == 3
    assert words in caught.value.problems[0][1]
    assert str(caught.value).startswith("train.jsonl: 1 bad line: line 3: ")


def test_every_bad_line_is_counted_and_the_first_ones_named(tmp_path: Path) -> None:
    lines = [b'{"prompt": "q", "completion": "a"}'] + [b"oops"] * (MAX_PROBLEMS_SHOWN + 5) + [b"\xff\xfe"]
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(PairsError) as caught:
        read_pairs(path)
    err = caught.value
    assert len(err.problems) == MAX_PROBLEMS_SHOWN + 6
    assert err.problems[-1] == (MAX_PROBLEMS_SHOWN + 7, "not UTF-8 (byte 1)")
    text = str(err)
    assert text.startswith(f"{path}: {MAX_PROBLEMS_SHOWN + 6} bad lines: line 2: not JSON")
    assert text.endswith("; and 6 more")


def test_an_empty_file_and_an_oversized_line_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PairsError, match="no pairs"):
        parse_pairs(["", "  "])
    with pytest.raises(PairsError, match=f"line 1: longer than {pairs.MAX_LINE_BYTES} bytes"):
        parse_pairs([b"x" * (pairs.MAX_LINE_BYTES + 1)])
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b'{"prompt": "q", "completion": "a"}\r\n')
    assert read_pairs(path)[0].answer == "a"


# -- events ---------------------------------------------------------------------------------------


def test_parse_event_takes_the_trainer_s_events_only() -> None:
    assert parse_event(b'{"event": "progress", "step": 1, "loss": 2.5}\n') == {"event": "progress", "step": 1,
                                                                                "loss": 2.5}
    assert parse_event('  {"event": "done", "adapter_dir": "/a"}') == {"event": "done", "adapter_dir": "/a"}
    for line in (b"", b"Loading weights: 100%", b"[1, 2]", b'{"event": "party"}', b'{"step": 1}', b"{broken",
                 b'{"event": "start", "x": "' + b"y" * run.MAX_EVENT_LINE + b'"}'):
        assert parse_event(line) is None, line


async def test_lines_splits_chunks_and_cuts_an_endless_line() -> None:
    class Stream:
        def __init__(self, chunks: list[bytes]) -> None:
            self.chunks = chunks

        def __aiter__(self) -> "Stream":
            return self

        async def __anext__(self) -> bytes:
            if not self.chunks:
                raise StopAsyncIteration
            return self.chunks.pop(0)

    got: list[bytes] = []
    huge = b"z" * (child.MAX_LINE + 10)
    await child.read_lines(Stream([b"a\nb", b"c\n", huge[:100], huge[100:], b"tail\nd\nlast"]), got.append)  # type: ignore[arg-type]
    assert got == [b"a", b"bc", huge[:child.MAX_LINE], b"d", b"last"]


def test_failure_messages() -> None:
    assert run._failure(2, {"error": {"event": "error", "message": "fix line 3"}}, []) == "fix line 3"
    assert "stopped (SIGTERM)" in run._failure(143, {}, [])  # the trainer's own exit after SIGTERM
    assert "stopped (SIGTERM)" in run._failure(-signal.SIGTERM, {}, [])  # SIGTERM before its handler was set
    assert run._failure(1, {}, ["Traceback", "KeyError: 'x'"]).endswith("its last output:\nTraceback\nKeyError: 'x'")
    assert "killed by signal SIGKILL" in run._failure(-9, {}, [])
    assert "without reporting an adapter" in run._failure(0, {}, [])


# -- the trainer's pure helpers (no torch) --------------------------------------------------------


def test_batches_cover_every_pair_each_epoch_in_a_seeded_order() -> None:
    it = trainer.batches(10, 4, seed=3)
    epoch = [next(it) for _ in range(3)]
    assert [len(b) for b in epoch] == [4, 4, 2]
    assert sorted(i for b in epoch for i in b) == list(range(10))
    again = trainer.batches(10, 4, seed=3)
    assert [next(again) for _ in range(3)] == epoch
    assert trainer.total_steps({"steps": 0, "epochs": 2, "batch_size": 4}, 10) == 6
    assert trainer.total_steps({"steps": 7, "epochs": 0, "batch_size": 4}, 10) == 7
    assert trainer.progress_every(10) == 1 and trainer.progress_every(100_000) == 100_000 // trainer.MAX_PROGRESS_EVENTS


class FakeTokenizer:
    """Characters as tokens; the template of llmgw.testing.hf_model."""

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool = False) -> str:
        text = "<s>" + "".join(f"<{m['role']}>{m['content']}</s>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def test_encode_pairs_labels_the_answer_only_and_refuses_long_pairs() -> None:
    tok = FakeTokenizer()
    [(ids, labels)] = trainer.encode_pairs(tok, [Pair(1, (("user", "q"), ("assistant", "ab")))], 64)
    prompt = "<s><user>q</s><assistant>"
    assert ids == [ord(c) for c in prompt + "ab</s>"]
    assert labels == [trainer.IGNORE_INDEX] * len(prompt) + [ord(c) for c in "ab</s>"]
    long = [Pair(4, (("user", "q" * 50), ("assistant", "a"))), Pair(9, (("user", "q"), ("assistant", "a")))]
    with pytest.raises(trainer.TrainerError, match=r"1 pair\(s\) are longer than max_seq_len 40 tokens \(line 4: 79 tokens\)"):
        trainer.encode_pairs(tok, long, 40)
    assert trainer._named_lines([5]) == "line 5"
    assert trainer._named_lines(list(range(1, trainer.MAX_LINES_NAMED + 3))) == (
        "lines " + ", ".join(str(n) for n in range(1, trainer.MAX_LINES_NAMED + 1)) + " and 2 more")


def test_load_config_names_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config().to_json()))
    assert trainer.load_config(path)["steps"] == 10
    path.write_text(json.dumps({**config().to_json(), "rank": "8"}))
    with pytest.raises(trainer.TrainerError, match="rank is '8', of the wrong type"):
        trainer.load_config(path)
    path.write_text(json.dumps({"steps": 1}))
    with pytest.raises(trainer.TrainerError, match="lacks base_model"):
        trainer.load_config(path)


# -- run_trainer's plumbing, with llmgw's own python (the trainer refuses before torch) -------------


def bad_job(tmp_path: Path) -> TrainerConfig:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "q", "completion": "a"}\n{"prompt": "q"}\nnope\n')
    return config(base_model=model, pairs=data, output_dir=tmp_path / "out")


async def test_run_trainer_raises_the_trainer_s_own_message(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    with pytest.raises(TrainingError) as caught:
        await run_trainer(bad_job(tmp_path), python=Path(sys.executable), overlay=tmp_path / "no-overlay",
                          workdir=tmp_path / "work", on_event=events.append)
    message = str(caught.value)
    assert 'line 2: has no "completion"' in message and "line 3: not JSON" in message
    assert events == [{"event": "error", "message": message}]
    assert not (tmp_path / "out").exists()
    assert json.loads((tmp_path / "work" / run.CONFIG_NAME).read_text())["steps"] == 10


async def test_run_trainer_refuses_a_used_output_dir_before_starting(tmp_path: Path) -> None:
    job = bad_job(tmp_path)
    job.output_dir.mkdir()
    (job.output_dir / "adapter_config.json").write_text("{}")
    with pytest.raises(TrainingError, match="already exists and is not empty"):
        await run_trainer(job, python=Path(sys.executable), overlay=tmp_path, workdir=tmp_path / "w",
                          on_event=lambda e: None)
    assert not (tmp_path / "w").exists() and (job.output_dir / "adapter_config.json").exists()


FAKE_TRAINER = textwrap.dedent("""\
    import json, os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stubborn: only SIGKILL ends it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    out = json.load(open(sys.argv[1]))["output_dir"]
    os.makedirs(os.path.join(os.path.dirname(out), ".out.partial-%d" % os.getpid()))
    print(json.dumps({"event": "start", "pid": os.getpid(), "child": child.pid}), flush=True)
    print("not an event", flush=True)
    print(json.dumps({"event": "progress", "step": 1}), flush=True)
    time.sleep(60)
""")


async def test_cancelling_kills_the_whole_group_and_leaves_nothing(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    monkeypatch.setattr(run, "TRAINER_SCRIPT", script)
    monkeypatch.setattr(run, "STOP_GRACE", 0.3)
    events: list[dict[str, Any]] = []
    with trio.move_on_after(30) as scope:
        async with trio.open_nursery() as nursery:
            def on_event(event: dict[str, Any]) -> None:
                events.append(event)
                if event["event"] == "progress":
                    nursery.cancel_scope.cancel()

            nursery.start_soon(lambda: run_trainer(config(output_dir=tmp_path / "out"), python=Path(sys.executable),
                                                   overlay=tmp_path, workdir=tmp_path / "w", on_event=on_event))
    assert not scope.cancelled_caught, "the fake trainer never got to its progress event"
    assert [e["event"] for e in events] == ["start", "progress"]
    start = events[0]
    for pid in (start["pid"], start["child"]):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(ProcessLookupError):
        os.killpg(start["pid"], 0)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


async def test_an_exception_from_on_event_stops_the_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER.replace("signal.SIG_IGN", "signal.SIG_DFL"))
    monkeypatch.setattr(run, "TRAINER_SCRIPT", script)
    pids: list[int] = []

    def on_event(event: dict[str, Any]) -> None:
        pids.extend((event["pid"], event["child"]))
        raise KeyError("boom")

    with trio.fail_after(30), pytest.raises(KeyError):
        await run_trainer(config(output_dir=tmp_path / "out"), python=Path(sys.executable), overlay=tmp_path,
                          workdir=tmp_path / "w", on_event=on_event)
    with pytest.raises(ProcessLookupError):
        os.killpg(pids[0], 0)


# -- the overlay's install steps, with a stand-in python ---------------------------------------------


FAKE_PYTHON = textwrap.dedent("""\
    #!/bin/sh
    # "python -m pip install ... --target DIR -r LOCK" makes DIR/peft; "python -c CHECK" prints versions.
    if [ "$1" = "-m" ]; then
        [ -n "$FAIL_PIP" ] && { echo "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES" >&2; exit 1; }
        while [ $# -gt 0 ]; do [ "$1" = "--target" ] && target="$2"; shift; done
        mkdir -p "$target/peft" && exit 0
    fi
    echo "0.21.2 1.16.0"
""")


def fake_python(tmp_path: Path) -> Path:
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def test_overlay_installs_once_under_the_lock_s_hash(tmp_path: Path) -> None:
    root = tmp_path / "engines"
    assert overlay.find_overlay(root) is None
    said: list[str] = []
    target = overlay.install_overlay(fake_python(tmp_path), root, said.append)
    assert target == overlay.overlay_dir(root) and target.parent == root / "training"
    assert target.name == "overlay-" + overlay.sha256_file(overlay.LOCK)[:12]
    assert (target / "peft").is_dir() and overlay.find_overlay(root) == target
    marker = json.loads((target / overlay.MARKER).read_text())
    assert marker["peft"] == "0.21.2" and marker["accelerate"] == "1.16.0"
    assert [p.name for p in target.parent.iterdir()] == [target.name], "no scratch directory or lock file left"
    assert any("hash-pinned" in s for s in said)
    assert overlay.install_overlay(tmp_path / "not-called", root) == target  # installed: nothing runs
    assert overlay.overlay_env(target) == {"PYTHONPATH": str(target)}
    (target / overlay.LOCK_COPY).write_text("changed\n")
    assert overlay.find_overlay(root) is None


def test_a_failed_overlay_install_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIL_PIP", "1")
    root = tmp_path / "engines"
    with pytest.raises(RuntimeError, match="DO NOT MATCH THE HASHES"):
        overlay.install_overlay(fake_python(tmp_path), root)
    assert overlay.find_overlay(root) is None and list((root / "training").iterdir()) == []


def test_the_shipped_lock_pins_peft_and_accelerate_with_hashes() -> None:
    lines = [line for line in overlay.LOCK.read_text().splitlines() if line and not line.startswith("#")]
    assert sorted(line.split("==")[0] for line in lines) == ["accelerate", "peft"]
    assert all(" --hash=sha256:" in line for line in lines)
    assert {line.split(" ")[0] for line in lines} == set(overlay.REQUIREMENTS)


# -- GGUF conversion's refusals (the real conversion is in tests/engines) ----------------------------


def test_find_llamacpp_sdist_needs_the_installer_s_marker(tmp_path: Path) -> None:
    from llmgw.node.install.llamacpp import SDIST_LLAMA_DIR, SDIST_SHA256, SRC_MARKER

    tree = tmp_path / "src" / SDIST_LLAMA_DIR
    (tree / "gguf-py" / "gguf").mkdir(parents=True)
    (tree / "convert_lora_to_gguf.py").write_text("")
    assert find_llamacpp_sdist([tmp_path]) is None  # not marked unpacked
    marker = tmp_path / "src" / SDIST_LLAMA_DIR.split("/")[0] / SRC_MARKER
    marker.write_text("0" * 64 + "\n")
    assert find_llamacpp_sdist([tmp_path]) is None  # another sdist
    marker.write_text(SDIST_SHA256 + "\n")
    assert find_llamacpp_sdist([tmp_path / "nothing", tmp_path]) == tree


def test_convert_names_what_is_missing_and_the_converter_s_last_words(tmp_path: Path) -> None:
    sdist = tmp_path / "llama.cpp"
    sdist.mkdir()
    adapter, base = tmp_path / "adapter", tmp_path / "base"
    for d, names in ((adapter, ("adapter_config.json", "adapter_model.safetensors")), (base, ("config.json",))):
        d.mkdir()
        for name in names:
            (d / name).write_text("{}")
    with pytest.raises(GgufConversionError, match="llama.cpp's converter is missing"):
        convert_adapter_to_gguf(Path(sys.executable), adapter, base, tmp_path / "a.gguf", sdist)
    (sdist / "convert_lora_to_gguf.py").write_text("import sys\nprint('NotImplementedError: no such arch', file=sys.stderr)\n"
                                                   "sys.exit(1)\n")
    with pytest.raises(GgufConversionError, match="(?s)exit status 1.*no such arch"):
        convert_adapter_to_gguf(Path(sys.executable), adapter, base, tmp_path / "a.gguf", sdist)
    with pytest.raises(GgufConversionError, match="outtype"):
        convert_adapter_to_gguf(Path(sys.executable), adapter, base, tmp_path / "a.gguf", sdist, outtype="q4")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith("gguf") or "partial" in p.name] == []
