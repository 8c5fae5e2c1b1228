"""A node's refusal reaches `ctl replicas` as one line with the reason, and goes with its model.

Real processes: ``llmgw server``, one agent, ``llmgw ctl``. The model the node refuses is one
the catalog refuses too, so it is written into the store directly, as a catalog written by an
older llmgw may hold it; the node checks again before start, and that refusal is what
`ctl replicas` shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmgw.config.server import load_server_config
from llmgw.control.store import open_store
from llmgw.spec import ModelSpec, Profile
from tests.system.harness import Cluster, eventually, iter_replicas, ready_replicas

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
