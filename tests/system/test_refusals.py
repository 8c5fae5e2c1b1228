"""A node's refusal reaches `ctl replicas` as one line with the reason, and goes with its model.

Real processes: ``llmgw server``, one agent, ``llmgw ctl``. The model the node refuses is one
the catalog refuses too, so it is written into the store directly, as a catalog written by an
older llmgw may hold it; the node checks again before start, and that refusal is what
`ctl replicas` shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmgw.catalog.engine_flags import table_for
from llmgw.config.server import load_server_config
from llmgw.control.store import open_store
from llmgw.spec import ModelSpec, Profile
from tests.system.harness import Cluster, eventually, iter_replicas, ready_replicas

pytestmark = pytest.mark.system

MODEL = "legacy"
#: What the node refuses (a library injected into the engine) and the words it says it with.
REFUSED_ENV = {"LD_PRELOAD": "/tmp/x.so", "PYTHONPATH": "/tmp/evil"}


def _refusals(cluster: Cluster) -> list[str]:
    """Returns what `ctl replicas --json` says about MODEL's failures: failed rows' messages
    and the reasons it waits (the failure backoff quotes the last failure)."""
    out = cluster.ctl_json("replicas")
    rows = [r["message"] for r in out["replicas"] if r["model"] == MODEL and r["state"] == "failed"]
    return rows + [reason for reason in out["unplaceable"] if f"model {MODEL} " in reason and "(last: " in reason]


async def test_a_node_refusal_is_one_line_and_its_rows_go_with_the_model(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        await cluster.init()
        config = load_server_config(cluster.server_yaml)
        async with open_store(config.store.url) as store:
            profile = Profile(replicas=1, engine_env=REFUSED_ENV)
            await store.put_model(ModelSpec(MODEL, "sim", "", profile), create_only=True)
        await cluster.start_server()
        await cluster.start_agent("n1")

        async def refused() -> list[str] | None:
            return _refusals(cluster) or None

        for text in await eventually(refused, f"the node's refusal of {MODEL} in ctl replicas"):
            assert "refused on this node" in text and all(name in text for name in REFUSED_ENV), text
            assert "\n" not in text and "Traceback" not in text and 'File "' not in text, text
        plain = cluster.ctl("replicas")
        assert plain.returncode == 0 and "Traceback" not in plain.stdout + plain.stderr

        assert cluster.ctl("models", "remove", MODEL).returncode == 0

        async def gone() -> bool:
            out = cluster.ctl_json("replicas")
            rows = [r for r in out["replicas"] if r["model"] == MODEL]
            return not rows and not any(f"model {MODEL} " in reason for reason in out["unplaceable"])

        await eventually(gone, f"no row of {MODEL} after `ctl models remove`")

        # The catalog refuses the same model up front, naming every refused variable at once.
        args: list[Any] = [f"--env={k}={v}" for k, v in REFUSED_ENV.items()]
        again = cluster.ctl("models", "add", MODEL, "--engine", "sim", *args)
        assert again.returncode != 0 and all(name in again.stderr + again.stdout for name in REFUSED_ENV)
        assert not list(iter_replicas(cluster, MODEL))
        # Added again without them, it serves; no failed row of the old definition comes back.
        assert cluster.ctl("models", "add", MODEL, "--engine", "sim").returncode == 0
        await ready_replicas(cluster, MODEL, 1)
    finally:
        cluster.stop()


def _table_args(engine: str, *, refused: bool) -> tuple[list[str], dict[str, str]]:
    """Returns ``engine``'s table options as profile arguments: every refused option (or a safe
    one with a value outside its allowed ones) when ``refused``, else every safe option; with
    each option's own value count. Returns (args, {option as written: the reason expected})."""
    table = table_for(engine)
    assert table is not None
    args: list[str] = []
    reasons: dict[str, str] = {}
    for option in table.options:
        if refused and option.refused is None and option.allowed_values is None:
            continue
        if not refused and (option.refused is not None or option.name in _NOT_ON_CPU):
            continue
        value = option.allowed_values[0] if option.allowed_values and not refused else _VALUES.get(option.name, "1")
        if refused and option.allowed_values is not None:
            value = "not-a-safe-value"
        count = option.values if isinstance(option.values, int) else 1
        args += [option.name, *[value] * count]
        if refused:
            reasons[option.name] = option.refused or f"the value {value!r} is not one of the safe ones"
    return args, reasons


#: Values a safe option needs to pass the catalog's device check (CPU shards).
_VALUES = {"--block-size": "128"}
#: Safe options left out of the accepted model: they exit or change what the engine is.
_NOT_ON_CPU: frozenset[str] = frozenset()


async def test_ctl_models_add_names_every_option_the_tables_refuse_and_accepts_the_safe_ones(tmp_path: Path) -> None:
    """Driven by the classified tables: every refused option of an engine, in one `ctl models add`,
    is named with its reason; the same engine's safe options, all at once, are accepted."""
    async with Cluster(tmp_path) as cluster:
        for engine in ("vllm", "llama.cpp", "sim"):
            source = "sim" if engine == "sim" else "/models/m"
            args, reasons = _table_args(engine, refused=True)
            out = cluster.ctl("models", "add", f"bad-{engine.replace('.', '')}", "--engine", engine,
                              "--source", source, *[f"--arg={a}" for a in args])
            text = " ".join((out.stdout + out.stderr).split())
            assert out.returncode != 0 and "Traceback" not in text, text[:2000]
            missing = [f"{name} is not allowed: {why}" for name, why in reasons.items()
                       if f"{name} is not allowed: {why}" not in text]
            assert not missing, missing[:5]

            safe, _ = _table_args(engine, refused=False)
            name = f"ok-{engine.replace('.', '')}"
            ok = cluster.ctl("models", "add", name, "--engine", engine, "--source", source,
                             *[f"--arg={a}" for a in safe])
            assert ok.returncode == 0, ok.stdout + ok.stderr
            listed = {m["name"]: m for m in cluster.ctl_json("models", "list")}
            assert listed[name]["profile"]["engine_args"] == safe
