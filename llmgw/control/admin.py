"""The ``Admin`` capability: what ``llmgw ctl`` and ``llmgw.client`` programs may do.

Handed out by ``Cluster.admin`` to admin certificates only; it acts on the
:class:`AdminServices` the control plane's wiring gives it. Methods copy their
params into Python values before the first await, and raise plain exceptions
whose message is for the operator (the client shows the last line).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Awaitable, Callable

import attrs
import trio

from llmgw import __version__, labels
from llmgw.catalog import model_to_dict, validate_model
from llmgw.catalog.fingerprint import model_fingerprint, shard_fingerprint
from llmgw.control.keys import AccessSync
from llmgw.control.peers import FeedTee, upgrade_standby
from llmgw.control.restart import restart_cluster
from llmgw.control.joining import JoinService
from llmgw.control.servers_admin import ServersAdminMixin
from llmgw.control.jobs_admin import JobsAdminMixin, check_job_adapters
from llmgw.control.training import JobScheduler
from llmgw.control.admin_tokens import AdminTokensAdminMixin
from llmgw.control.settings import SERVING_STOPPED
from llmgw.control.settings_admin import SettingsAdminMixin
from llmgw.control.keys_admin import AccessAdminMixin, admission_rows
from llmgw.control import rollout
from llmgw.control.reconciler import Reconciler
from llmgw.control.registry import NodeState, Registry
from llmgw.control.sessions import NodeSessions
from llmgw.control.store import Store
from llmgw.releasefiles import ReleaseError, ReleaseInbox, sha256_file
from llmgw.releases import UPGRADE_EXIT_STATUS, install_here, release_root
from llmgw.rpc import convert, schema
from llmgw.router.interface import GatewayInterface
from llmgw.spec import ShardState
from llmgw.telemetry import NodeTelemetry

log = logging.getLogger(__name__)


@attrs.frozen
class AdminServices:
    """What the ``Admin`` capability acts on, for one running control plane."""

    store: Store
    registry: Registry
    sessions: NodeSessions
    reconciler: Reconciler
    gateway: GatewayInterface
    #: Keys, tenants and ``serving.stopped`` into the gateway; usage out of it.
    access: AccessSync
    #: Tells the reconciler and the gateway's route feed that the catalog changed.
    catalog_changed: Callable[[], None]
    #: The gateway's base URL, as clients reach it (``http://host:port``).
    gateway_url: str
    #: The standbys attached to this leader (and the routes streamed to them).
    tee: FeedTee
    #: ``restart_self(reason, exit_status=None)``: restart this control plane once the current call
    #: has answered (raises RuntimeError where it cannot).
    restart_self: Callable[..., None]
    #: Call after an ``agents.*`` setting changed: every node gets its layer a second later.
    agent_settings_changed: Callable[[], None]
    #: Who leads and the control planes, as ``ClusterStatus`` fields (leader, epoch, ...).
    leadership: Callable[[], Awaitable[dict[str, Any]]]
    #: This leader's join desk (None: it holds no CA key and mints no join tokens).
    joins: JoinService | None = None
    #: Where `ctl upgrade` uploads release wheels (None: this control plane takes none).
    releases_dir: Path | None = None
    #: The leader's training job scheduler (`ctl jobs`).
    jobs: JobScheduler = attrs.field(default=None)


def unplaceable_reasons(reconciler: Reconciler) -> list[str]:
    """Return why the reconciler's last pass could not place or is still waiting to place replicas."""
    return [u.reason for u in reconciler.last_unplaceable] + [w.reason for w in reconciler.last_waiting]


def _config_problem(sessions: NodeSessions, node_id: str) -> str:
    """Returns why node ``node_id`` runs on an older configuration, as its session knows ("": none)."""
    try:
        session = sessions.get(node_id)
    except LookupError:
        return ""
    return "; ".join(p for p in (session.settings_problem, session.file_problem) if p)


def _release_inbox(services: AdminServices) -> ReleaseInbox:
    """Return where this control plane keeps uploaded releases; raises ReleaseError where it keeps none."""
    if services.releases_dir is None:
        raise ReleaseError("this control plane takes no releases (it runs inside llmgw up: upgrade with pip)")
    return ReleaseInbox(services.releases_dir)


async def _uploaded(services: AdminServices, name: str, sha256: str) -> tuple[Path, str]:
    """Return the uploaded wheel ``name`` and its SHA-256, checked against ``sha256``; raises
    ReleaseError when it was not uploaded or arrived damaged."""
    wheel = _release_inbox(services).path(name)
    if not wheel.is_file():
        raise ReleaseError(f"{name} was not uploaded to this control plane (ctl upgrade uploads it first)")
    got = await trio.to_thread.run_sync(sha256_file, wheel)
    if got != sha256.lower():
        raise ReleaseError(f"{name}: SHA-256 {got} here, expected {sha256}: upload it again")
    return wheel, got


def _session(services: AdminServices, node_id: str) -> Any:
    """Return ``node_id``'s session; raises LookupError naming the node when it is not connected."""
    try:
        return services.sessions.get(node_id)
    except LookupError:
        raise LookupError(f"node {node_id!r} is not connected (see `llmgw ctl nodes`)") from None


def make_admin(services: AdminServices, actor: str, *, via: str = "") -> Any:
    """Return an ``Admin`` server object acting on ``services`` for ``actor`` (the
    certificate's name); ``via`` names the standby the caller reached it through ("": none)."""
    s = schema.load()

    # tenants, keys, usage: keys_admin.py; cluster settings: settings_admin.py
    class AdminServer(AccessAdminMixin, SettingsAdminMixin, AdminTokensAdminMixin, ServersAdminMixin, JobsAdminMixin,
                      s.Admin.Server):
        async def status(self, _context: Any, **_: Any) -> None:
            fleet = services.registry.snapshot()
            shards = [sh for node in fleet.nodes.values() for sh in node.shards.values()]
            models = await services.store.list_models()
            gateway = services.gateway.status()
            _context.results.status = {
                "version": __version__,
                "nodesOnline": sum(1 for n in fleet.nodes.values() if n.state is NodeState.ONLINE),
                "nodesLost": sum(1 for n in fleet.nodes.values() if n.state is NodeState.LOST),
                "replicasReady": sum(1 for sh in shards if sh.state is ShardState.READY),
                "replicasTotal": len(shards),
                "models": len(models),
                "gatewayUrl": services.gateway_url,
                "unplaceable": unplaceable_reasons(services.reconciler),
                "servingStopped": gateway.stopped,
                "admission": admission_rows(gateway),
                "kvAlarms": list(gateway.kv_alarms),
                "routing": gateway.routing,
                **await services.leadership(),
            }

        async def removeNode(self, name: str, _context: Any, **_: Any) -> None:
            node_id = str(name)
            removal = await services.store.remove_node(node_id, actor)
            try:
                services.sessions.get(node_id).close()  # it reconnects, and is refused: revoked
            except LookupError:
                pass
            forgotten = services.registry.forget_node(node_id)  # its replicas are placed elsewhere
            removed = removal.known or forgotten or removal.tokens_revoked > 0
            if removed:
                await services.store.audit(actor, "node.remove", node_id, {
                    "certificates_revoked": removal.certificates_revoked, "tokens_revoked": removal.tokens_revoked})
                services.catalog_changed()
                log.info("%s removed node %s (%d certificate(s) revoked)", actor, node_id,
                         removal.certificates_revoked)
            _context.results.removed = removed
            _context.results.certificatesRevoked = removal.certificates_revoked
            _context.results.tokensRevoked = removal.tokens_revoked

        async def listNodes(self, _context: Any, **_: Any) -> None:
            fleet = services.registry.snapshot()
            now = trio.current_time()
            _context.results.nodes = [
                {
                    "id": node.id,
                    "address": node.address,
                    "state": node.state.value,
                    "hardware": convert.hardware_dict(node.hardware),
                    "engines": [convert.engine_dict(e) for e in node.engines],
                    "secondsSinceHeartbeat": max(0.0, now - node.last_heartbeat),
                    "shards": len(node.shards),
                    "version": services.sessions.agent_versions.get(node.id, ""),
                    "configProblem": _config_problem(services.sessions, node.id),
                    "labels": labels.to_pairs(node.labels),
                    "telemetry": convert.telemetry_dict(node.live_telemetry(now) or NodeTelemetry()),
                }
                for node in sorted(fleet.nodes.values(), key=lambda n: n.id)
            ]

        async def listReplicas(self, _context: Any, **_: Any) -> None:
            fleet = services.registry.snapshot()
            current = {m.name: model_fingerprint(m) for m in await services.store.list_models()}
            rows = []
            for node in sorted(fleet.nodes.values(), key=lambda n: n.id):
                for shard in sorted(node.shards.values(), key=lambda sh: (sh.model, sh.id)):
                    st = shard.status
                    state = st.state.value if node.state is NodeState.ONLINE else f"{st.state.value} (node {node.state.value})"
                    rows.append(
                        {
                            "id": shard.id,
                            "model": shard.model,
                            "nodeId": node.id,
                            "state": state,
                            "endpoint": st.endpoint,
                            "pid": st.pid,
                            "restarts": st.restarts,
                            "message": st.message,
                            "lastOutput": list(st.last_output),
                            **convert.compute_fields(st.compute),
                            "computeSummary": st.compute.summary() if st.compute is not None else "",
                            "fingerprint": shard_fingerprint(shard.spec),
                            "outdated": shard.model in current and shard_fingerprint(shard.spec) != current[shard.model],
                        }
                    )
            _context.results.replicas = rows
            _context.results.unplaceable = unplaceable_reasons(services.reconciler)

        async def listModels(self, _context: Any, **_: Any) -> None:
            models = await services.store.list_models()
            _context.results.models = [convert.model_dict(m) for m in models]

        async def addModel(self, model: Any, replace: bool, _context: Any, **_: Any) -> None:
            spec = validate_model(model_to_dict(convert.model_from(model)))
            await check_job_adapters(services.store, spec)
            replace = bool(replace)
            existed = replace and await services.store.get_model(spec.name) is not None
            saved = await services.store.put_model(spec, create_only=not replace)
            plan = rollout.preview(saved, services.registry.snapshot(), now=trio.current_time(), existed=existed)
            if plan.outdated:
                log.info("model %s saved by %s: %s", saved.name, actor, plan.message)
            await services.store.audit(actor, "model.replace" if replace else "model.add", spec.name,
                                    model_to_dict(saved))
            services.catalog_changed()
            _context.results.model = convert.model_dict(saved)
            _context.results.rollout = {"kind": plan.kind, "outdated": plan.outdated, "message": plan.message}

        async def removeModel(self, name: str, _context: Any, **_: Any) -> None:
            name = str(name)
            removed = await services.store.delete_model(name)
            if removed:
                await services.store.audit(actor, "model.remove", name, {})
                services.catalog_changed()
            _context.results.removed = removed

        async def replicaLogs(self, id: str, lines: int, _context: Any, **_: Any) -> None:
            shard_id, count = str(id), int(lines) or 100
            try:
                session = services.sessions.find_shard(shard_id)
            except KeyError:
                raise LookupError(
                    f"no replica {shard_id!r} on a connected node (see `llmgw ctl replicas`)"
                ) from None
            _context.results.lines = await session.logs(shard_id, count)

        async def nodeLogs(self, node: str, source: str, lines: int, after: int, _context: Any, **_: Any) -> None:
            got, sources, cursor = await _session(services, str(node)).node_logs(str(source), int(lines), int(after))
            _context.results.lines, _context.results.sources, _context.results.cursor = got, sources, cursor

        async def restartCluster(self, _context: Any, **_: Any) -> None:
            await services.store.audit(actor, "cluster.restart", "cluster", {})
            agents, standbys = await restart_cluster(services.registry, services.sessions, services.tee,
                                                     answering=via)
            services.restart_self("llmgw ctl restart")
            _context.results.agents = agents
            _context.results.standbys = standbys
            _context.results.leader = (await services.leadership())["leader"]

        async def uploadRelease(self, name: str, offset: int, chunk: bytes, _context: Any, **_: Any) -> None:
            _context.results.received = _release_inbox(services).write(str(name), int(offset), bytes(chunk))

        async def upgradeNode(self, node: str, name: str, sha256: str, rollbackAfterMs: int, _context: Any,
                              **_: Any) -> None:
            node_id = str(node)
            wheel, got = await _uploaded(services, str(name), str(sha256))
            await services.store.audit(actor, "node.upgrade", node_id, {"release": str(name), "sha256": got})
            release, previous = await _session(services, node_id).upgrade(wheel, got, rollbackAfterMs / 1000)
            _context.results.release, _context.results.previous = release, previous

        async def upgradeControlPlane(self, name: str, release: str, sha256: str, _context: Any, **_: Any) -> None:
            plane = str(name)
            wheel, got = await _uploaded(services, str(release), str(sha256))
            await services.store.audit(actor, "control_plane.upgrade", plane, {"release": str(release), "sha256": got})
            if plane == (await services.leadership())["leader"]:  # this control plane: after answering
                new, previous = await install_here(release_root(), _release_inbox(services), str(release), got)
                services.restart_self(f"upgraded to llmgw {new}", UPGRADE_EXIT_STATUS)
            else:
                new, previous = await upgrade_standby(services.tee.feed_of(plane), wheel, got)
            _context.results.release, _context.results.previous = new, previous

        async def rollbackNode(self, node: str, _context: Any, **_: Any) -> None:
            node_id = str(node)
            await services.store.audit(actor, "node.rollback", node_id, {})
            release, previous = await _session(services, node_id).rollback()
            _context.results.release, _context.results.previous = release, previous

        async def checkEngine(self, node: str, engine: str, _context: Any, **_: Any) -> None:
            _context.results.output = await _session(services, str(node)).check_engine(str(engine))

    server = AdminServer()
    server.bind_access(services.store, services.access, actor, serving_changed=services.catalog_changed)

    async def gateway_applied(stored: str) -> None:
        await services.access.reload()
        services.access.changed()
        if stored == SERVING_STOPPED:
            services.catalog_changed()

    server.bind_settings(services.store, actor, gateway_applied, services.agent_settings_changed)

    async def leader() -> str:
        return str((await services.leadership())["leader"])

    server.bind_servers(services.store, actor, services.joins, services.tee, leader)
    server.bind_jobs(services.store, actor, lambda: services.jobs)
    return server
