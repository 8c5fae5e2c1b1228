"""``llmgw ctl nodes NODE``: one node's cards, engines, replicas and live readings (issue 16)."""

from __future__ import annotations

from typing import Any

import click

from llmgw.cli.ctl.common import mb
from llmgw.cli.output import print_table
from llmgw.client import NodeRow, ReplicaRow
from llmgw.labels import describe as describe_labels
from llmgw.spec import gpu_display
from llmgw.telemetry import GpuTelemetry, NodeTelemetry

_GIB = 1024**3


def print_node(node: NodeRow, replicas: list[ReplicaRow]) -> None:
    """Prints ``node`` for people: hardware and live host readings, each card, its engines,
    the replicas on it with what they use, foreign GPU processes and XID counts."""
    hw, t = node.hardware, node.telemetry
    version = f"  llmgw {node.version}" if node.version else ""
    click.echo(f"node {node.id}  {node.state}  {node.address}{version}  "
               f"heartbeat {node.seconds_since_heartbeat:.1f}s ago")
    if node.labels:
        click.echo(f"labels: {describe_labels(node.labels)}")
    platform = ", ".join(p for p in (hw.os, hw.arch, " ".join(hw.cpu_flags)) if p)
    if platform:
        click.echo(f"platform: {platform}")
    if hw.driver_version:
        click.echo(f"NVIDIA driver {hw.driver_version}, CUDA {hw.cuda_version or 'unknown'}")
    click.echo(f"host: {host_line(hw.cpu_count, hw.memory_total_mb, hw.memory_available_mb, t)}")
    if hw.disk_total_mb:
        click.echo(f"weights disk: {mb(hw.disk_free_mb)} free of {mb(hw.disk_total_mb)}")
    if node.config_problem:
        click.echo(f"runs on its previous configuration: {node.config_problem}")
    if t.note:
        click.echo(f"telemetry: {t.note}")

    click.echo("")
    readings = {g.index: g for g in t.gpus}
    rows = [_gpu_row(g.index, g.gpu_class or g.name, g.uuid, g.memory_total_mb, g.memory_free_mb,
                     readings.pop(g.index, None)) for g in hw.gpus]
    # Cards in MIG mode are placed as their instances; their readings are the card's own.
    rows += [_gpu_row(r.index, r.gpu_class, r.uuid, None, None, r) for r in readings.values()]
    print_table(["GPU", "CLASS", "MEM USED/TOTAL", "UTIL", "MEM BW", "SM CLOCK", "TEMP/HBM", "POWER/LIMIT", "ECC",
                 "THROTTLE", "UUID"], rows, empty=f"GPUs: {hw.gpu_note or 'none'}")

    click.echo("")
    usage = {u.shard_id: u for u in t.shards}
    print_table(["REPLICA", "MODEL", "STATE", "CORES", "MEMORY", "COMPUTE"],
                [[r.id, r.model, r.state, _cores(usage.get(r.id)), _rss(usage.get(r.id)), r.compute_summary or "-"]
                 for r in replicas], empty="no replicas on this node")

    engines = [e for e in node.engines if e.installed or e.state or e.detail]
    if engines:
        click.echo("\nengines:")
        for e in engines:
            what = e.version or e.state or e.detail or ""
            click.echo(f"  {e.name}: {'installed' if e.installed else 'not installed'}"
                       + (f", {what}" if what else "") + (f" ({e.path})" if e.path else ""))
    if t.foreign_processes:
        click.echo("\nprocesses that are not llmgw's on the GPUs (placement counts their memory as taken):")
        for p in t.foreign_processes:
            held = f"{p.used_memory_mb} MiB" if p.used_memory_mb is not None else "memory not reported"
            click.echo(f"  GPU {gpu_display(p.gpu)}: pid {p.pid} {p.name or '?'}, {held}")
    if t.xids:
        click.echo("\nXID errors since the agent started (kernel log):")
        for x in t.xids:
            click.echo(f"  {x.pci_address} XID {x.xid}: {x.count}x, last: {x.last_message}")


def host_line(cpus: int, memory_total_mb: int, memory_available_mb: int, t: NodeTelemetry) -> str:
    """Returns the node's CPUs and memory with the live readings that were read, in one line."""
    h = t.host
    parts = [f"{cpus} CPUs"]
    if "cpu_utilization_percent" in h:
        parts[0] += f" {h['cpu_utilization_percent']:.0f}% busy"
    if "load1" in h:
        parts.append("load " + " ".join(f"{h[k]:.2f}" for k in ("load1", "load5", "load15") if k in h))
    available = h.get("memory_available_bytes")
    free = f"{available / _GIB:.1f}G" if available is not None else mb(memory_available_mb)
    parts.append(f"memory {free} available of {mb(memory_total_mb)}")
    sensors = []
    if "cpu_package_celsius" in h:
        sensors.append(f"CPU {h['cpu_package_celsius']:.0f}°C")
    if "board_inlet_celsius" in h:
        sensors.append(f"inlet {h['board_inlet_celsius']:.0f}°C")
    if "cpu_package_watts" in h:
        sensors.append(f"{h['cpu_package_watts']:.0f} W")
    if sensors:
        parts.append(" ".join(sensors))
    if h:
        parts.append(f"sampled {t.age_s:.0f}s ago")
    else:
        parts.append("no live readings")
    return ", ".join(parts)


def _gpu_row(index: int, gpu_class: str, uuid: str, total_mb: int | None, free_mb: int | None,
             t: GpuTelemetry | None) -> list[Any]:
    r = t.readings if t is not None else {}

    def show(name: str, fmt: str) -> str:
        return fmt.format(r[name]) if name in r else "-"

    used = r.get("memory_used_bytes")
    if used is None and total_mb is not None and free_mb is not None:
        used = (total_mb - free_mb) * 1024 * 1024
    memory = f"{mb(int(used // (1024 * 1024)))}" if used is not None else "-"
    if total_mb:
        memory += f"/{mb(total_mb)}"
    temps = show("temperature_celsius", "{:.0f}°C") + "/" + show("memory_temperature_celsius", "{:.0f}°C")
    power = show("power_draw_watts", "{:.0f}") + "/" + show("power_limit_watts", "{:.0f} W")
    if t is None or t.throttle_reasons is None:
        throttle = "-"
    else:
        throttle = ",".join(x for x in t.throttle_reasons if x != "gpu_idle") or "no"
    sm_clock = f"{r['sm_clock_hertz'] / 1e6:.0f} MHz" if "sm_clock_hertz" in r else "-"
    return [gpu_display(index), gpu_class or "-", memory, show("utilization_percent", "{:.0f}%"),
            show("memory_utilization_percent", "{:.0f}%"), sm_clock, temps, power,
            show("ecc_uncorrected_errors", "{:.0f}"), throttle, uuid or "-"]


def _cores(usage: Any) -> str:
    return "-" if usage is None or usage.cores is None else f"{usage.cores:.2f}"


def _rss(usage: Any) -> str:
    return "-" if usage is None else mb(usage.memory_bytes // (1024 * 1024))
