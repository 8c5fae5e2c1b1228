"""Conversions between llmgw.spec values and Cap'n Proto structs.

``to_*`` functions fill a capnp builder (or return a dict pycapnp accepts);
``from_*`` functions copy a capnp reader into plain Python values, so a server
method can copy its params before its first await.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from llmgw import labels
from llmgw.telemetry import ForeignGpuProcess, GpuTelemetry, NodeTelemetry, ShardUsage, XidCount
from llmgw.training import TrainingJob, TrainingParams
from llmgw.spec import EngineInfo, GpuInfo, Hardware, ModelSpec, Profile, ShardSpec, ShardState, ShardStatus
from llmgw.spec import Adapter, Compute, ComputeDevice, KvDelta, adapters_to_dicts, model_to_dict


def _kv(mapping: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"key": k, "value": v} for k, v in sorted(mapping.items())]


def _from_kv(items: Any) -> dict[str, str]:
    return {item.key: item.value for item in items}


def _capnp_names(data: Any) -> Any:
    """Returns ``data`` with every mapping key in capnp's spelling (``memory_mb`` -> ``memoryMb``)."""
    if isinstance(data, dict):
        return {_camel(key): _capnp_names(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_capnp_names(item) for item in data]
    return data


def _camel(name: str) -> str:
    """Returns a snake_case ``name`` in camelCase."""
    first, *rest = name.split("_")
    return first + "".join(part.title() for part in rest)


def hardware_dict(hw: Hardware) -> dict[str, Any]:
    return {
        "cpuCount": hw.cpu_count,
        "memoryTotalMb": hw.memory_total_mb,
        "memoryAvailableMb": hw.memory_available_mb,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "memoryTotalMb": g.memory_total_mb,
                "memoryFreeMb": g.memory_free_mb,
                "gpuClass": g.gpu_class,
            }
            for g in hw.gpus
        ],
        "gpuNote": hw.gpu_note,
        "diskFreeMb": hw.disk_free_mb,
        "diskTotalMb": hw.disk_total_mb,
        "driverVersion": hw.driver_version,
        "cudaVersion": hw.cuda_version,
        "os": hw.os,
        "arch": hw.arch,
        "cpuFlags": list(hw.cpu_flags),
    }


def hardware_from(r: Any) -> Hardware:
    return Hardware(
        cpu_count=r.cpuCount,
        memory_total_mb=r.memoryTotalMb,
        memory_available_mb=r.memoryAvailableMb,
        gpus=tuple(
            GpuInfo(g.index, g.uuid, g.name, g.memoryTotalMb, g.memoryFreeMb, g.gpuClass) for g in r.gpus
        ),
        gpu_note=r.gpuNote,
        disk_free_mb=r.diskFreeMb,
        disk_total_mb=r.diskTotalMb,
        driver_version=r.driverVersion,
        cuda_version=r.cudaVersion,
        os=r.os,
        arch=r.arch,
        cpu_flags=tuple(r.cpuFlags),
    )


def _readings(values: Mapping[str, float]) -> list[dict[str, Any]]:
    return [{"name": name, "value": float(value)} for name, value in values.items()]


def _ms(seconds: float) -> int:
    """Returns ``seconds`` as whole milliseconds for a UInt32 age (clamped to its range)."""
    return min(max(0, int(seconds * 1000)), 0xFFFF_FFFF)


def telemetry_dict(t: NodeTelemetry) -> dict[str, Any]:
    return {
        "ageMs": _ms(t.age_s),
        "host": _readings(t.host),
        "gpus": [
            {
                "index": g.index, "uuid": g.uuid, "gpuClass": g.gpu_class, "ageMs": _ms(g.age_s),
                "readings": _readings(g.readings), "throttleReasons": list(g.throttle_reasons or ()),
                "throttleKnown": g.throttle_reasons is not None,
            }
            for g in t.gpus
        ],
        "shards": [
            {"shardId": u.shard_id, "cores": math.nan if u.cores is None else u.cores, "memoryBytes": u.memory_bytes}
            for u in t.shards
        ],
        "foreignProcesses": [
            {"pid": p.pid, "name": p.name, "gpu": p.gpu,
             "usedMemoryMb": -1 if p.used_memory_mb is None else p.used_memory_mb}
            for p in t.foreign_processes
        ],
        "xids": [
            {"pciAddress": x.pci_address, "xid": x.xid, "count": x.count, "lastMessage": x.last_message}
            for x in t.xids
        ],
        "note": t.note,
    }


def telemetry_from(r: Any) -> NodeTelemetry:
    """Returns the telemetry in ``r`` (a ``Telemetry`` reader); an unset one is empty."""
    return NodeTelemetry(
        age_s=r.ageMs / 1000,
        host={reading.name: reading.value for reading in r.host},
        gpus=tuple(
            GpuTelemetry(
                g.index, g.uuid, g.gpuClass, {reading.name: reading.value for reading in g.readings},
                tuple(g.throttleReasons) if g.throttleKnown else None, g.ageMs / 1000,
            )
            for g in r.gpus
        ),
        shards=tuple(
            ShardUsage(u.shardId, None if math.isnan(u.cores) else u.cores, u.memoryBytes) for u in r.shards
        ),
        foreign_processes=tuple(
            ForeignGpuProcess(p.pid, p.name, p.gpu, None if p.usedMemoryMb < 0 else p.usedMemoryMb)
            for p in r.foreignProcesses
        ),
        xids=tuple(XidCount(x.pciAddress, x.xid, x.count, x.lastMessage) for x in r.xids),
        note=r.note,
    )


def training_params_dict(p: TrainingParams) -> dict[str, Any]:
    return {"steps": p.steps, "epochs": p.epochs, "rank": p.rank, "alpha": p.alpha, "learningRate": p.learning_rate,
            "seed": p.seed, "maxSeqLen": p.max_seq_len}


def training_params_from(r: Any) -> TrainingParams:
    return TrainingParams(r.steps, r.epochs, r.rank, r.alpha, r.learningRate, r.seed, r.maxSeqLen)


def training_job_dict(j: TrainingJob) -> dict[str, Any]:
    return {
        "id": j.id, "adapter": j.adapter, "model": j.model, "weights": j.weights, "node": j.node,
        "assignedNode": j.assigned_node, "gpuMib": j.gpu_mib, "gpu": j.gpu, "params": training_params_dict(j.params),
        "state": j.state, "message": j.message, "step": j.step, "steps": j.steps, "loss": j.loss,
        "firstLoss": j.first_loss, "peakMemoryBytes": j.peak_memory_bytes, "device": j.device, "pairs": j.pairs,
        "createdBy": j.created_by, "createdAt": j.created_at, "updatedAt": j.updated_at,
        "resultBytes": j.result_bytes, "resultSha256": j.result_sha256, "resultFormat": j.result_format,
        "register": j.register,
    }


def training_job_from(r: Any) -> TrainingJob:
    return TrainingJob(
        r.id, r.adapter, r.model, r.weights, r.node, r.gpuMib, training_params_from(r.params), r.state, r.message,
        r.assignedNode, r.gpu, r.step, r.steps, r.loss, r.firstLoss, r.peakMemoryBytes, r.device, r.pairs,
        r.createdBy, r.createdAt, r.updatedAt, r.resultBytes, r.resultSha256, r.resultFormat, r.register,
    )


def engine_dict(e: EngineInfo) -> dict[str, Any]:
    return {
        "name": e.name,
        "installed": e.installed,
        "version": e.version,
        "installable": e.installable,
        "detail": e.detail,
        "state": e.state,
        "path": e.path,
        "origin": e.origin,
    }


def engine_from(r: Any) -> EngineInfo:
    return EngineInfo(r.name, r.installed, r.version, r.installable, r.detail, state=r.state, path=r.path,
                      origin=r.origin)


def shard_spec_dict(s: ShardSpec) -> dict[str, Any]:
    return {
        "id": s.id,
        "model": s.model,
        "engine": s.engine,
        "source": s.source,
        "args": list(s.args),
        "env": _kv(s.env),
        "memoryMb": s.memory_mb,
        "cpuCores": s.cpu_cores,
        "gpus": list(s.gpus),
        "adapters": adapters_to_dicts(s.adapters),
        "maxLoadedAdapters": s.max_loaded_adapters,
        "apiKey": s.api_key,
        "fingerprint": s.fingerprint,
        "gpuUuids": list(s.gpu_uuids),
    }


def adapters_from(items: Any) -> tuple[Adapter, ...]:
    return tuple(Adapter(a.name, a.source) for a in items)


def kv_update_dict(d: KvDelta) -> dict[str, Any]:
    return {
        "reset": d.reset,
        "stored": list(d.stored),
        "removed": list(d.removed),
        "blockSize": d.block_size,
        "eventsApplied": d.events_applied,
        "gaps": d.gaps,
        "resyncs": d.resyncs,
    }


def kv_update_from(r: Any) -> KvDelta:
    return KvDelta(
        reset=r.reset,
        stored=tuple(r.stored),
        removed=tuple(r.removed),
        block_size=r.blockSize,
        events_applied=r.eventsApplied,
        gaps=r.gaps,
        resyncs=r.resyncs,
    )


def shard_spec_from(r: Any) -> ShardSpec:
    return ShardSpec(
        id=r.id,
        model=r.model,
        engine=r.engine,
        source=r.source,
        args=tuple(r.args),
        env=_from_kv(r.env),
        memory_mb=r.memoryMb,
        cpu_cores=r.cpuCores,
        gpus=tuple(r.gpus),
        adapters=adapters_from(r.adapters),
        max_loaded_adapters=r.maxLoadedAdapters,
        api_key=r.apiKey,
        fingerprint=r.fingerprint,
        gpu_uuids=tuple(r.gpuUuids),
    )


def shard_status_dict(s: ShardStatus) -> dict[str, Any]:
    return {
        "id": s.id,
        "state": s.state.value,
        "endpoint": s.endpoint,
        "pid": s.pid,
        "restarts": s.restarts,
        "message": s.message,
        "lastOutput": list(s.last_output),
        "adapters": [{"key": k, "value": v} for k, v in s.adapters],
        **compute_fields(s.compute),
    }


def compute_fields(c: Compute | None) -> dict[str, Any]:
    """Returns ``{"compute": ..., "hasCompute": ...}`` for a struct with those two fields.

    ``None`` (not known yet) leaves ``compute`` unset and ``hasCompute`` false.
    """
    if c is None:
        return {"hasCompute": False}
    return {
        "hasCompute": True,
        "compute": {
            "backend": c.backend,
            "devices": [
                {
                    "name": d.name,
                    "description": d.description,
                    "memoryTotalMb": max(0, d.memory_total_mb),
                    "memoryFreeMb": max(0, d.memory_free_mb),
                }
                for d in c.devices
            ],
            "modelBufferMb": float(c.model_buffer_mb),
            "kvBufferMb": float(c.kv_buffer_mb),
            "layersOffloaded": c.layers_offloaded,
            "layersTotal": c.layers_total,
            "threads": max(0, c.threads),
            "source": c.source,
            "notes": list(c.notes),
        },
    }


def compute_from(r: Any) -> Compute | None:
    """Returns the Compute of a struct with ``compute``/``hasCompute`` fields, or None if unknown."""
    if not r.hasCompute:
        return None
    c = r.compute
    return Compute(
        backend=c.backend,
        devices=tuple(ComputeDevice(d.name, d.description, d.memoryTotalMb, d.memoryFreeMb) for d in c.devices),
        model_buffer_mb=c.modelBufferMb,
        kv_buffer_mb=c.kvBufferMb,
        layers_offloaded=c.layersOffloaded,
        layers_total=c.layersTotal,
        threads=c.threads,
        source=c.source,
        notes=tuple(c.notes),
    )


def shard_status_from(r: Any) -> ShardStatus:
    return ShardStatus(
        id=r.id,
        state=ShardState(str(r.state)),
        endpoint=r.endpoint,
        pid=r.pid,
        restarts=r.restarts,
        message=r.message,
        last_output=tuple(r.lastOutput),
        compute=compute_from(r),
        adapters=tuple((item.key, item.value) for item in r.adapters),
    )


def model_dict(m: ModelSpec) -> dict[str, Any]:
    """Returns ``m`` as a capnp ``Model``: :func:`llmgw.spec.model_to_dict` in capnp's spelling,
    the engine environment as key/value pairs."""
    data = model_to_dict(m)
    data["profile"]["engine_env"] = _kv(m.profile.engine_env)
    data["profile"]["node_labels"] = labels.to_pairs(m.profile.node_labels)
    return _capnp_names(data)


def model_from(r: Any) -> ModelSpec:
    p = r.profile
    return ModelSpec(
        name=r.name,
        engine=r.engine,
        source=r.source,
        profile=Profile(
            replicas=p.replicas,
            memory_mb=p.memoryMb,
            cpu_cores=p.cpuCores,
            gpus=p.gpus,
            engine_args=tuple(p.engineArgs),
            engine_env=_from_kv(p.engineEnv),
            node_labels=labels.parse_pairs(p.nodeLabels),
            gpu_class=p.gpuClass,
        ),
        adapters=adapters_from(r.adapters),
        max_loaded_adapters=r.maxLoadedAdapters,
    )
