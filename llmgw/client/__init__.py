"""llmgw's public client library: drive a cluster over Cap'n Proto with an admin certificate.

Example::

    import trio
    from llmgw.client import connect

    async def main():
        async with connect("10.0.0.1:7070", tls_dir="/etc/llmgw/admin") as cluster:
            for node in await cluster.nodes():
                print(node.id, node.state)

    trio.run(main)

Every call has a deadline (:data:`CALL_TIMEOUT`) and raises :class:`ClientError`
with the control plane's own message when it refuses or fails.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import attrs
import capnp
import trio

from llmgw import labels
from llmgw.catalog import validate_model
from llmgw.jointoken import NodeOverrides
from llmgw.releasefiles import ReleaseError, send_pieces, sha256_file, wheel_version
from llmgw.rpc import convert, net, schema
from llmgw.rpc.connection import open_client
from llmgw.rpc.errors import remote_reason
from llmgw.rpc.kjtrio import capnp_runtime, runtime_active
from llmgw.rpc.tls import TLSFileError, client_ssl_context, read_credentials
from llmgw.spec import EngineInfo, Hardware, ModelSpec
from llmgw.spec import Compute
from llmgw.telemetry import NodeTelemetry
from llmgw.training import TrainingJob, TrainingParams

__all__ = ["CALL_TIMEOUT", "ClientError", "ClusterClient", "ClusterStatus", "NodeRow", "ReplicaRow", "Rollout", "connect",
           "ControlPlaneRow", "JoinTokenRow", "KeyRow", "NewJoinToken", "SettingRow", "TenantAdmission", "TenantRow",
           "UsageRow"]

#: A cluster restart waits for every agent, then every standby, to be back (each step
#: bounded at a minute on the leader): a few steps of that.
RESTART_TIMEOUT = 300.0
#: Admin calls read in-memory state or do one small store write.
CALL_TIMEOUT = 30.0
#: An upgrade call sends the release to the node and waits for it to be installed there
#: (the leader's own deadline, llmgw.control.sessions.UPGRADE_TIMEOUT, plus the transfer).
UPGRADE_CALL_TIMEOUT = 1020.0


class ClientError(Exception):
    """The control plane could not be reached, refused the call, or the call failed."""


@attrs.frozen
class NodeRow:
    id: str
    address: str
    state: str
    hardware: Hardware
    engines: tuple[EngineInfo, ...]
    seconds_since_heartbeat: float
    shards: int
    version: str
    #: Why the node runs on an older configuration (refused settings, an agent.yaml that does not load); "": none.
    config_problem: str = ""
    #: The node's labels (agent.yaml ``labels``), which profiles' ``node_labels`` select.
    labels: Mapping[str, str] = attrs.field(factory=dict)
    #: Its latest telemetry, readings older than a minute left out (empty: none sent).
    telemetry: NodeTelemetry = attrs.field(factory=NodeTelemetry)


@attrs.frozen
class ReplicaRow:
    id: str
    model: str
    node_id: str
    state: str
    endpoint: str
    pid: int
    restarts: int
    message: str
    last_output: tuple[str, ...]
    compute: Compute | None = None  # what the engine computes on; None until it said (or was looked up)
    compute_summary: str = ""  # one line: "CPU, 0.4 MiB model, 0.5 MiB KV" / "CUDA0 H200, 33/33 layers"
    fingerprint: str = ""  # of the model definition it runs
    outdated: bool = False  # its model's definition changed since it started: a rollout replaces it


@attrs.frozen
class Rollout:
    """What saving a model did to its running replicas. ``kind``: "new", "unchanged", "surge"
    (one at a time, new ready before old stops), "in-place" (no room for a surge), "blocked" (the
    new definition fits nowhere; old replicas keep serving) or "waiting" (failure backoff);
    ``outdated``: replicas to replace; ``message``: the same for people."""

    kind: str
    outdated: int
    message: str


@attrs.frozen
class ClusterStatus:
    version: str
    nodes_online: int
    nodes_lost: int
    replicas_ready: int
    replicas_total: int
    models: int
    gateway_url: str
    unplaceable: tuple[str, ...]
    serving_stopped: bool = False
    admission: tuple[TenantAdmission, ...] = ()  # per tenant, this control plane's gateway
    kv_alarms: tuple[str, ...] = ()  # KV routing alarms in words (router/engine hash disagreement)
    leader: str = ""  # the control plane that leads (and answered)
    epoch: int = 0  # grows by one at every change of leader
    leader_since: float = 0.0  # Unix seconds
    control_planes: tuple[ControlPlaneRow, ...] = ()
    routing: str = ""  # the routing of the answering (leader's) gateway, in words


@attrs.frozen
class ControlPlaneRow:
    """A control plane of the cluster: ``role`` is "leader", "standby" (streaming from the
    leader) or "down" (no session with the leader now)."""

    name: str
    rpc_address: str
    http_address: str
    role: str
    last_seen: float
    version: str = ""  # its llmgw release where the leader knows it ("": not known)


@attrs.frozen
class JoinTokenRow:
    """A join token (never its secret): ``state`` is pending, used, expired or revoked."""

    id: str
    role: str
    name: str
    created_at: float
    created_by: str
    expires_at: float
    state: str
    used_by: str
    overrides: NodeOverrides = NodeOverrides()


@attrs.frozen
class NewJoinToken:
    """A join token just minted: ``token`` is shown this once; ``control_planes`` are the
    RPC addresses a joining machine may dial."""

    token: str
    name: str
    expires_at: float
    control_planes: tuple[str, ...]
    overrides: NodeOverrides = NodeOverrides()


@attrs.frozen
class NodeRemoved:
    """What removing a node did (``removed`` False: the cluster knew nothing of that name)."""

    name: str
    removed: bool
    certificates_revoked: int
    tokens_revoked: int


@attrs.frozen
class AdminTokenRow:
    """A bearer token of the HTTP admin API (never its secret); ``revoked_at`` 0 while active."""

    id: str
    name: str
    created_by: str
    created_at: float
    revoked_at: float


def _admin_token_from(t: Any) -> AdminTokenRow:
    return AdminTokenRow(str(t.id), str(t.name), str(t.createdBy), float(t.createdAt), float(t.revokedAt))


@attrs.frozen
class SettingRow:
    """One version of a cluster setting (``value`` None: unset at this version)."""

    key: str
    value: Any
    version: int
    updated_at: float
    actor: str


def _setting_from(r: Any) -> SettingRow:
    return SettingRow(str(r.key), json.loads(str(r.valueJson)), int(r.version), float(r.updatedAt), str(r.actor))


# -- tenants, API keys, usage (issue 3) ----------------------------------------------------


@attrs.frozen
class TenantAdmission:
    """Requests of one tenant since the gateway started; ``in_flight`` includes queued ones."""

    tenant: str
    admitted: int
    queued: int
    shed: int
    in_flight: int
    share: float = 1.0  # this gateway's fraction of the tenant's limits (several control planes: docs/ha.md)


@attrs.frozen
class TenantRow:
    """A tenant: ``models`` it may use (None: all) and its limits (0: unlimited)."""

    name: str
    models: tuple[str, ...] | None
    max_concurrency: int
    rpm: int
    tpm: int
    created_at: float = 0.0
    updated_at: float = 0.0


@attrs.frozen
class KeyRow:
    """An API key (never its secret); ``revoked_at`` is None while it is active."""

    id: str
    tenant: str
    name: str
    created_at: float
    revoked_at: float | None


@attrs.frozen
class UsageRow:
    """Requests and tokens of one tenant on one model (stored totals plus what is not flushed yet)."""

    tenant: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


def _tenant_from(t: Any) -> TenantRow:
    return TenantRow(t.name, None if t.allModels else tuple(t.models), t.maxConcurrency, t.rpm, t.tpm,
                     t.createdAt, t.updatedAt)


def _key_from(k: Any) -> KeyRow:
    return KeyRow(k.id, k.tenant, k.name, k.createdAt, k.revokedAt or None)


class ClusterClient:
    """An admin session with one control plane. Create it with :func:`connect`."""

    def __init__(self, admin: Any, address: str) -> None:
        self._admin = admin
        self.address = address

    async def _call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        try:
            with trio.fail_after(timeout):
                return await getattr(self._admin, method)(*args)
        except trio.TooSlowError:
            raise ClientError(f"{self.address} did not answer {method} within {timeout:g}s") from None
        except capnp.KjException as exc:
            if exc.type == "DISCONNECTED":
                raise ClientError(f"lost the connection to {self.address}: {remote_reason(exc)}") from None
            raise ClientError(remote_reason(exc)) from None

    async def status(self) -> ClusterStatus:
        r = (await self._call("status")).status
        return ClusterStatus(
            r.version, r.nodesOnline, r.nodesLost, r.replicasReady, r.replicasTotal, r.models, r.gatewayUrl,
            tuple(r.unplaceable), r.servingStopped,
            tuple(TenantAdmission(a.tenant, a.admitted, a.queued, a.shed, a.inFlight, float(a.share))
                  for a in r.admission),
            tuple(r.kvAlarms),
            str(r.leader), int(r.epoch), float(r.leaderSince),
            tuple(ControlPlaneRow(str(p.name), str(p.rpcAddress), str(p.httpAddress), str(p.role), float(p.lastSeen),
                                  str(p.version))
                  for p in r.controlPlanes),
            str(r.routing),
        )

    # -- tenants, API keys, usage, serving (issue 3) --------------------------------------

    async def tenants(self) -> list[TenantRow]:
        """Return every tenant, ordered by name."""
        return [_tenant_from(t) for t in (await self._call("listTenants")).tenants]

    async def put_tenant(self, tenant: TenantRow, *, create: bool) -> TenantRow:
        """Add (``create``) or replace a tenant; returns it as stored. Fails naming a bad field,
        on a duplicate name (create) or an unknown one (update)."""
        wire = {"name": tenant.name, "allModels": tenant.models is None, "models": list(tenant.models or ()),
                "maxConcurrency": tenant.max_concurrency, "rpm": tenant.rpm, "tpm": tenant.tpm}
        return _tenant_from((await self._call("putTenant", wire, create)).tenant)

    async def remove_tenant(self, name: str) -> bool:
        """Remove a tenant and revoke its keys; returns whether it existed."""
        return bool((await self._call("removeTenant", name)).removed)

    async def create_key(self, tenant: str, name: str = "") -> tuple[KeyRow, str]:
        """Create an API key for ``tenant``; returns it and the key itself (shown this once)."""
        result = await self._call("createKey", tenant, name)
        return _key_from(result.key), str(result.secret)

    async def keys(self) -> list[KeyRow]:
        """Return every API key, revoked ones included, oldest first."""
        return [_key_from(k) for k in (await self._call("listKeys")).keys]

    async def revoke_key(self, key_id: str) -> KeyRow:
        """Revoke a key (at once, on this control plane's gateway); fails if there is none."""
        return _key_from((await self._call("revokeKey", key_id)).key)

    async def usage(self) -> list[UsageRow]:
        """Return requests and tokens per tenant and model."""
        return [UsageRow(u.tenant, u.model, u.requests, u.promptTokens, u.completionTokens)
                for u in (await self._call("usage")).rows]

    async def set_serving_stopped(self, stopped: bool) -> bool:
        """Stop (every POST under /v1/ answers 503) or resume serving; returns the new state."""
        return bool((await self._call("setServingStopped", stopped)).stopped)

    async def restart_cluster(self) -> dict[str, Any]:
        """Restart every agent, then every standby, then the leader (engines keep serving);
        returns ``{"agents", "standbys", "leader"}`` once the standbys are back (the leader
        restarts right after). Waits up to :data:`RESTART_TIMEOUT` for that."""
        r = await self._call("restartCluster", timeout=RESTART_TIMEOUT)
        return {"agents": int(r.agents), "standbys": int(r.standbys), "leader": str(r.leader)}

    # -- cluster settings (llmgw ctl config) ----------------------------------------------

    async def settings(self, key: str = "") -> list[SettingRow]:
        """Returns the current version of every setting (``key`` ""), or of the stored key
        ``key`` belongs to ([] when it is not set). Fails naming an unknown key."""
        return [_setting_from(s) for s in (await self._call("getSettings", key)).settings]

    async def set_setting(self, key: str, value: Any) -> SettingRow:
        """Set ``key`` (a stored key or a dotted key below one) to ``value`` (JSON-ready);
        returns the stored key's new version. Fails naming the key path and the reason."""
        return _setting_from((await self._call("setSetting", key, json.dumps(value), False)).setting)

    async def unset_setting(self, key: str) -> SettingRow:
        """Remove ``key``; returns the stored key's new version (value None: nothing is left)."""
        return _setting_from((await self._call("setSetting", key, "null", True)).setting)

    async def setting_history(self, key: str) -> list[SettingRow]:
        """Returns every version of the stored key ``key`` belongs to, oldest first."""
        return [_setting_from(s) for s in (await self._call("settingHistory", key)).versions]

    async def create_join_token(self, role: str, name: str, ttl: float,
                                overrides: NodeOverrides = NodeOverrides()) -> NewJoinToken:
        """Mint a one-time token for a machine to join as ``role`` ``name`` within ``ttl``
        seconds; a node joining with it writes ``overrides`` into its agent.yaml. Fails saying
        why (a name in use, a SQLite store, no CA key on the leader, a bad label or engine)."""
        r = await self._call("createJoinToken", role, name, ttl, labels.to_pairs(overrides.labels),
                             list(overrides.disabled_engines))
        return NewJoinToken(str(r.token), name, r.expiresAt, tuple(r.controlPlanes), overrides)

    async def join_tokens(self) -> list[JoinTokenRow]:
        """Returns every join token, oldest first."""
        return [JoinTokenRow(t.id, t.role, t.name, t.createdAt, t.createdBy, t.expiresAt, t.state, t.usedBy,
                             NodeOverrides(labels.parse_pairs(t.labels), tuple(t.disabledEngines)))
                for t in (await self._call("listJoinTokens")).tokens]

    async def remove_control_plane(self, name: str) -> bool:
        """Remove control plane ``name`` (its certificate and pending tokens revoked); returns
        whether there was anything to remove. Fails for the leader itself."""
        return bool((await self._call("removeControlPlane", name)).removed)

    async def remove_node(self, name: str) -> NodeRemoved:
        """Remove node ``name``: its certificates and pending join tokens revoked, its session
        ended, nothing placed there any more (its replicas are placed elsewhere)."""
        r = await self._call("removeNode", name)
        return NodeRemoved(name, bool(r.removed), int(r.certificatesRevoked), int(r.tokensRevoked))

    async def create_admin_token(self, name: str) -> tuple[AdminTokenRow, str]:
        """Make a bearer token of the HTTP admin API named ``name``; returns it with the token
        itself (shown this once)."""
        r = await self._call("createAdminToken", name)
        return _admin_token_from(r.view), str(r.token)

    async def admin_tokens(self) -> list[AdminTokenRow]:
        """Returns every admin token, revoked ones included, oldest first."""
        return [_admin_token_from(t) for t in (await self._call("listAdminTokens")).tokens]

    async def revoke_admin_token(self, token_id: str) -> AdminTokenRow:
        """Revoke admin token ``token_id`` (fails for an unknown one); returns it."""
        return _admin_token_from((await self._call("revokeAdminToken", token_id)).view)

    async def nodes(self) -> list[NodeRow]:
        result = await self._call("listNodes")
        return [
            NodeRow(
                n.id, n.address, n.state, convert.hardware_from(n.hardware),
                tuple(convert.engine_from(e) for e in n.engines), n.secondsSinceHeartbeat, n.shards, n.version,
                n.configProblem, labels.parse_pairs(n.labels), convert.telemetry_from(n.telemetry),
            )
            for n in result.nodes
        ]

    async def replicas(self) -> tuple[list[ReplicaRow], list[str]]:
        """Return every replica the cluster knows, and why any wanted replica could not be placed."""
        result = await self._call("listReplicas")
        rows = [
            ReplicaRow(r.id, r.model, r.nodeId, r.state, r.endpoint, r.pid, r.restarts, r.message,
                       tuple(r.lastOutput), convert.compute_from(r), r.computeSummary, r.fingerprint, r.outdated)
            for r in result.replicas
        ]
        return rows, list(result.unplaceable)

    async def models(self) -> list[ModelSpec]:
        result = await self._call("listModels")
        return [convert.model_from(m) for m in result.models]

    async def add_model(self, model: ModelSpec, *, replace: bool = False) -> ModelSpec:
        """Add (or with ``replace``, update) a catalog model; the control plane validates it."""
        return (await self.save_model(model, replace=replace))[0]

    async def save_model(self, model: ModelSpec, *, replace: bool = False) -> tuple[ModelSpec, Rollout]:
        """Like :meth:`add_model`; returns the model as stored and what happens to its running replicas."""
        result = await self._call("addModel", convert.model_dict(model), replace)
        r = result.rollout
        return convert.model_from(result.model), Rollout(r.kind, r.outdated, r.message)

    async def remove_model(self, name: str) -> bool:
        return bool((await self._call("removeModel", name)).removed)

    async def node_logs(self, node: str, source: str = "agent", lines: int = 100,
                        after: int = 0) -> tuple[list[str], list[str], int]:
        """Returns the last ``lines`` lines of ``source`` on ``node`` ("agent": its agent's log,
        redacted; a replica id: that engine's output), the sources the node has, and a cursor:
        passed back as ``after``, the next call returns only the lines added since."""
        r = await self._call("nodeLogs", node, source, lines, after)
        return [str(line) for line in r.lines], [str(s) for s in r.sources], int(r.cursor)

    # -- training jobs (issue 17) -------------------------------------------------------

    async def train_job(self, adapter: str, model: str, pairs: bytes, params: TrainingParams, *, weights: str = "",
                        node: str = "", gpu_mib: int = 0, register: bool = False) -> TrainingJob:
        """Queue a LoRA training job (``register``: add its result to the model as an adapter once
        it succeeds); returns it. Raises ClientError with the control plane's reason."""
        result = await self._call("trainJob", adapter, model, weights, node, gpu_mib,
                                  convert.training_params_dict(params), pairs, register)
        return convert.training_job_from(result.job)

    async def jobs(self) -> list[TrainingJob]:
        """Every training job, oldest first."""
        return [convert.training_job_from(j) for j in (await self._call("listJobs")).jobs]

    async def cancel_job(self, job_id: str) -> TrainingJob:
        return convert.training_job_from((await self._call("cancelJob", job_id)).job)

    async def job_logs(self, job_id: str, lines: int) -> list[str]:
        return [str(line) for line in (await self._call("jobLogs", job_id, lines)).lines]

    async def download_job(self, job_id: str, write: Callable[[bytes], None]) -> tuple[int, str, str]:
        """Fetch a finished job's result in pieces into ``write``; returns (bytes, sha256, format).
        Raises ClientError when the pieces do not add up to the SHA-256 the control plane keeps."""
        digest, offset, total, sha256, fmt = hashlib.sha256(), 0, None, "", ""
        while total is None or offset < total:
            r = await self._call("downloadJob", job_id, offset, 0)
            chunk, total, sha256, fmt = bytes(r.chunk), int(r.total), str(r.sha256), str(r.format)
            if not chunk and offset < total:
                raise ClientError(f"the control plane sent nothing at byte {offset} of {total}")
            write(chunk)
            digest.update(chunk)
            offset += len(chunk)
        if digest.hexdigest() != sha256:
            raise ClientError(f"the result of {job_id} arrived damaged (its SHA-256 does not match); download again")
        return offset, sha256, fmt

    async def upload_release(self, wheel: Path) -> str:
        """Upload the llmgw wheel at ``wheel`` to the control plane in pieces; return its SHA-256.

        Raises ClientError for a file that is not an llmgw wheel or cannot be read, or the
        control plane's reason."""
        async def piece(offset: int, chunk: bytes) -> int:
            return int((await self._call("uploadRelease", wheel.name, offset, chunk)).received)

        try:
            wheel_version(wheel.name)
            digest = sha256_file(wheel)
            await send_pieces(wheel, piece)
        except (ReleaseError, OSError) as exc:
            raise ClientError(str(exc)) from None
        return digest

    async def upgrade_node(self, node: str, name: str, sha256: str, rollback_after: float = 0.0) -> tuple[str, str]:
        """Have ``node`` install the uploaded wheel ``name`` and restart on it; return (release,
        previous). Not joined within ``rollback_after`` seconds (0: no limit), it goes back by itself."""
        r = await self._call("upgradeNode", node, name, sha256, int(rollback_after * 1000),
                             timeout=UPGRADE_CALL_TIMEOUT)
        return str(r.release), str(r.previous)

    async def upgrade_control_plane(self, name: str, release: str, sha256: str) -> tuple[str, str]:
        """Have control plane ``name`` install the uploaded wheel ``release`` and restart on it
        (the leader itself: after answering); return (release, previous)."""
        r = await self._call("upgradeControlPlane", name, release, sha256, timeout=UPGRADE_CALL_TIMEOUT)
        return str(r.release), str(r.previous)

    async def rollback_node(self, node: str) -> tuple[str, str]:
        """Have ``node`` put its previous release back and restart on it; return (release, previous)."""
        r = await self._call("rollbackNode", node, timeout=UPGRADE_CALL_TIMEOUT)
        return str(r.release), str(r.previous)

    async def replica_logs(self, replica_id: str, lines: int = 100) -> list[str]:
        return list((await self._call("replicaLogs", replica_id, lines)).lines)

    async def engine_check(self, node_id: str, engine: str) -> str:
        """Returns the output of ``engine``'s version and device check, run on ``node_id``.

        Raises :class:`ClientError` with the node's reason when the node is not connected,
        the engine is unknown there or its check cannot run.
        """
        return str((await self._call("checkEngine", node_id, engine)).output)


@contextlib.asynccontextmanager
async def connect(
    addresses: str | Sequence[str], *, tls_dir: str | Path | None = None, credentials: Any = None
) -> AsyncIterator[ClusterClient]:
    """Connect to the first reachable control plane of ``addresses`` as an admin.

    ``tls_dir`` holds ``ca.pem``, ``cert.pem`` and ``key.pem`` of an admin
    certificate (or pass ``credentials`` read with ``llmgw.rpc.tls.read_credentials``).
    Starts a capnp runtime for the block when none runs in this thread. Raises
    :class:`ClientError` when no address answers or the certificate is refused;
    the connection is closed on exit.
    """
    if isinstance(addresses, str):
        addresses = [addresses]
    if credentials is None:
        if tls_dir is None:
            raise ClientError("no admin credentials: pass tls_dir (ca.pem, cert.pem, key.pem)")
        try:
            credentials = read_credentials(tls_dir)
        except TLSFileError as exc:
            raise ClientError(str(exc)) from None
    context = client_ssl_context(credentials.ca_pem, credentials.cert_pem, credentials.key_pem)
    async with contextlib.AsyncExitStack() as stack:
        if not runtime_active():
            await stack.enter_async_context(capnp_runtime())
        try:
            address, stream = await net.connect_first(addresses, context)
        except net.ConnectError as exc:
            raise ClientError(str(exc)) from None
        client = await stack.enter_async_context(open_client(stream))
        cluster = client.bootstrap().cast_as(schema.load().Cluster)
        try:
            with trio.fail_after(CALL_TIMEOUT):
                admin = (await cluster.admin()).admin
        except trio.TooSlowError:
            raise ClientError(f"{address} did not answer within {CALL_TIMEOUT:g}s") from None
        except capnp.KjException as exc:
            if exc.type == "DISCONNECTED":
                raise ClientError(
                    f"{address} closed the connection on the first call: it refused this certificate "
                    "(issued by another cluster's CA, expired, or not an admin certificate)"
                ) from None
            raise ClientError(remote_reason(exc)) from None
        yield ClusterClient(admin, address)


def model_from_mapping(data: Mapping[str, Any]) -> ModelSpec:
    """Validate user input (CLI flags, YAML) into a ModelSpec, as the control plane will."""
    return validate_model(data)
