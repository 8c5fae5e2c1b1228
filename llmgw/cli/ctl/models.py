"""``llmgw ctl models list|add|remove|adapters``: the model catalog.

A model given with ``add`` is checked here, with the catalog's own validation, before
it is sent: a malformed one fails without a round trip.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import click
import yaml

from llmgw.catalog import CatalogError, model_to_dict, validate_model
from llmgw.cli.ctl.common import call, json_option, mb, remove
from llmgw.cli.output import fail, print_table
from llmgw.catalog.sources import job_source
from llmgw.client import ClientError, ClusterClient, Rollout
from llmgw.labels import parse_pairs
from llmgw.spec import Adapter, ModelSpec


@click.group()
def models() -> None:
    """The model catalog: list, add, remove."""


@models.command("list")
@json_option
@click.pass_context
def models_list(ctx: click.Context, as_json: bool) -> None:
    """Catalog models and their profiles."""
    specs = call(ctx, as_json, lambda c: c.models(), as_data=lambda specs: [model_to_dict(m) for m in specs])
    print_table(["MODEL", "ENGINE", "REPLICAS", "MEMORY", "CPU CORES", "GPUS", "ADAPTERS", "SOURCE"],
                [[m.name, m.engine, m.profile.replicas, mb(m.profile.memory_mb) if m.profile.memory_mb else "-",
                  m.profile.cpu_cores or "-", m.profile.gpus or "-", _adapters_cell(m), m.source or "-"]
                 for m in specs],
                empty="the catalog is empty: add a model with `llmgw ctl models add`")


def _adapters_cell(model: ModelSpec) -> str:
    """Returns the adapters column: "a, b" (all loaded at start), "a, b (1 loaded at a time)" or "-"."""
    if not model.adapters:
        return "-"
    names = ", ".join(a.name for a in model.adapters)
    if model.max_loaded_adapters:
        return f"{names} ({model.max_loaded_adapters} loaded at a time)"
    return names


def _adapter_options(items: tuple[str, ...]) -> list[dict[str, str]]:
    """Returns ``--adapter NAME=SOURCE`` values as catalog data; exits with a message on a malformed one."""
    adapters = []
    for item in items:
        name, sep, source = item.partition("=")
        if not sep or not name:
            fail(f"--adapter {item!r}: expected NAME=SOURCE (a local path, http(s) URL or hf://org/repo)")
        adapters.append({"name": name, "source": source})
    return adapters


@models.command("add")
@click.argument("name", required=False)
@click.option("--file", "-f", "file", type=click.File(), help="A model as YAML or JSON (fields as in `models list --json`).")
@click.option("--engine", "-e", help="sim, llama.cpp, vllm or sglang.")
@click.option("--source", default="", help="Where the weights are (a local path for now).")
@click.option("--replicas", type=int, help="Replicas to run [1].")
@click.option("--memory-mb", type=int, help="Memory each replica reserves on its node.")
@click.option("--cpu-cores", type=float, help="CPU cores each replica reserves.")
@click.option("--gpus", type=int, help="Whole GPUs per replica.")
@click.option("--arg", "args", multiple=True, help="Engine argument (repeat for several).")
@click.option("--env", "envs", multiple=True, help="Engine environment variable KEY=VALUE (repeat).")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=SOURCE",
              help="A LoRA adapter: its name (requests name it as their model) and where its files are (repeat).")
@click.option("--max-loaded-adapters", type=int,
              help="vllm/sim: at most N adapters loaded per replica, loaded on first use [0: all at start].")
@click.option("--gpu-class", help="The GPU class each replica runs on, as `ctl nodes` shows them "
                                 "(h100-80g, a100-80g-mig-3g.40gb: a MIG instance).")
@click.option("--node-labels", "node_labels", multiple=True, metavar="KEY=VALUE[,...]",
              help="Place replicas only on nodes carrying these labels (agent.yaml labels, `ctl nodes add --labels`).")
@click.option("--replace", is_flag=True,
              help="Replace the model if it exists; replicas of the old definition are replaced one at a time.")
@json_option
@click.pass_context
def models_add(ctx: click.Context, name: str | None, file: Any, engine: str | None, source: str,
               replicas: int | None, memory_mb: int | None, cpu_cores: float | None, gpus: int | None,
               args: tuple[str, ...], envs: tuple[str, ...], adapters: tuple[str, ...],
               max_loaded_adapters: int | None, gpu_class: str | None, node_labels: tuple[str, ...], replace: bool,
               as_json: bool) -> None:
    """Add a model to the catalog; the cluster places its replicas."""
    data: dict[str, Any] = {}
    if file is not None:
        try:
            loaded = yaml.safe_load(file)
        except yaml.YAMLError as exc:
            fail(f"{file.name}: not valid YAML/JSON: {exc}")
        if not isinstance(loaded, dict):
            fail(f"{file.name}: expected a mapping with name, engine, source, profile")
        data = loaded
    if name:
        data["name"] = name
    if engine:
        data["engine"] = engine
    if source:
        data["source"] = source
    profile = dict(data.get("profile") or {})
    for key, value in (("replicas", replicas), ("memory_mb", memory_mb), ("cpu_cores", cpu_cores), ("gpus", gpus),
                       ("gpu_class", gpu_class)):
        if value is not None:
            profile[key] = value
    if args:
        profile["engine_args"] = list(args)
    if envs:
        env = {}
        for item in envs:
            key, sep, value = item.partition("=")
            if not sep:
                fail(f"--env {item!r}: expected KEY=VALUE")
            env[key] = value
        profile["engine_env"] = env
    if node_labels:
        try:
            profile["node_labels"] = parse_pairs(node_labels)
        except ValueError as exc:
            fail(f"--node-labels: {exc}")
    if profile:
        data["profile"] = profile
    if adapters:
        data["adapters"] = list(data.get("adapters") or []) + _adapter_options(adapters)
    if max_loaded_adapters is not None:
        data["max_loaded_adapters"] = max_loaded_adapters
    try:
        spec = validate_model(data)
    except CatalogError as exc:
        fail(str(exc))
    saved, rollout = call(ctx, as_json, lambda c: c.save_model(spec, replace=replace), as_data=_saved_data)
    click.echo(f"model {saved.name!r} {'saved' if replace else 'added'}: {saved.profile.replicas} replica(s) "
               f"on {saved.engine}; watch them with `llmgw ctl replicas -m {saved.name}`")
    if rollout.kind != "new":
        click.echo(rollout.message)


def _saved_data(result: tuple[ModelSpec, Rollout]) -> dict[str, Any]:
    """Returns ``models add --json``: ``{"model": the model as stored (as in `models list --json`),
    "rollout": {"kind", "outdated", "message"}}``, what happens to replicas of an older definition."""
    saved, rollout = result
    return {"model": model_to_dict(saved), "rollout": attrs.asdict(rollout)}


@models.command("remove")
@click.argument("name")
@json_option
@click.pass_context
def models_remove(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove a model from the catalog; its replicas are stopped."""
    remove(ctx, as_json, name, lambda c: c.remove_model(name),
           missing=f"no model {name!r} in the catalog (see `llmgw ctl models list`)",
           done=f"model {name!r} removed; its replicas are being stopped")


@models.group("adapters")
def adapters() -> None:
    """A model's LoRA adapters: add one (from a source or a training job), remove one."""


@adapters.command("add")
@click.argument("model")
@click.argument("name")
@click.option("--from-job", "job_id", help="A training job's result (`llmgw ctl jobs list`): nodes fetch it from "
                                           "the control plane.")
@click.option("--source", help="Where the adapter's files are: a path on the nodes, a URL or hf://org/repo.")
@json_option
@click.pass_context
def adapters_add(ctx: click.Context, model: str, name: str, job_id: str | None, source: str | None,
                 as_json: bool) -> None:
    """Add adapter NAME to MODEL. Requests name it as their model. vLLM replicas load it on first use
    when the model sets max_loaded_adapters (else every replica is replaced, one at a time, to load it
    at start); llama.cpp replicas load it at their next start."""
    if (job_id is None) == (source is None):
        fail("give the adapter's files with exactly one of --from-job JOB or --source SOURCE")
    adapter = Adapter(name, job_source(job_id) if job_id else str(source))

    def added(current: tuple[Adapter, ...]) -> tuple[Adapter, ...]:
        if any(a.name == name for a in current):
            raise ClientError(f"{model} has an adapter {name!r} already; `llmgw ctl models adapters remove "
                              f"{model} {name}` first to replace it")
        return (*current, adapter)

    saved, rollout = _change_adapters(ctx, as_json, model, added)
    click.echo(f"adapter {name!r} added to {saved.name} ({adapter.source})")
    if saved.engine == "llama.cpp":
        click.echo("llama.cpp replicas load it at their next start" + (f": {rollout.message}"
                                                                       if rollout.kind != "new" else ""))
    elif rollout.kind != "new":
        click.echo(rollout.message)


@adapters.command("remove")
@click.argument("model")
@click.argument("name")
@json_option
@click.pass_context
def adapters_remove(ctx: click.Context, model: str, name: str, as_json: bool) -> None:
    """Remove adapter NAME from MODEL."""

    def removed(current: tuple[Adapter, ...]) -> tuple[Adapter, ...]:
        if not any(a.name == name for a in current):
            raise ClientError(f"{model} has no adapter {name!r} (see `llmgw ctl models list`)")
        return tuple(a for a in current if a.name != name)

    saved, rollout = _change_adapters(ctx, as_json, model, removed)
    click.echo(f"adapter {name!r} removed from {saved.name}")
    if rollout.kind != "new":
        click.echo(rollout.message)


def _change_adapters(ctx: click.Context, as_json: bool, model: str,
                     change: Callable[[tuple[Adapter, ...]], tuple[Adapter, ...]]) -> tuple[ModelSpec, Rollout]:
    """Saves MODEL with ``change(its adapters)`` (which raises ClientError to refuse); returns it
    as stored and its rollout (``--json``: printed, and the command ends)."""

    async def save(c: ClusterClient) -> tuple[ModelSpec, Rollout]:
        spec = next((m for m in await c.models() if m.name == model), None)
        if spec is None:
            raise ClientError(f"no model {model!r} in the catalog (see `llmgw ctl models list`)")
        return await c.save_model(attrs.evolve(spec, adapters=change(spec.adapters)), replace=True)

    return call(ctx, as_json, save, as_data=_saved_data)  # type: ignore[no-any-return]
