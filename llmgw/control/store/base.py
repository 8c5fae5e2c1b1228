"""The control plane's store: the one interface both backends implement.

``Store`` is what the rest of the control plane calls. Every method is async and safe to
call from any number of trio tasks at once; the backends run the blocking database driver
in a worker thread and serialise access to their single connection.

Cancellation: a call that is cancelled while its statement runs in the worker thread
waits for that statement to finish (every statement is bounded by the backend's
timeouts, so this wait is bounded too); a transaction that did not commit is rolled
back. Nothing is half-written.
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Any, Iterable, Mapping, Self

import attrs

from llmgw.jointoken import NodeOverrides
from llmgw.spec import ModelSpec


class StoreError(Exception):
    """Base class of every error the store raises."""


class ConflictError(StoreError):
    """The write would overwrite something that already exists (e.g. a duplicate model name)."""


class StoreUnavailableError(StoreError):
    """The database cannot be reached or opened; the message names it and what to check."""


class StoreTimeoutError(StoreUnavailableError):
    """A statement or lock wait ran past the store's timeout; the message says which database."""


class SchemaTooNewError(StoreError):
    """The database was migrated by a newer llmgw than this one."""


class StoreClosedError(StoreError):
    """The store was used after ``close()``."""


class FencedError(StoreError):
    """A write made on behalf of leadership was refused: this control plane no longer leads
    (another took the lead at a later epoch). Nothing was written."""


class JoinTokenRefused(StoreError):
    """A join token was unknown, wrong, used, expired or revoked; the message says which."""


class CertificateRevokedError(StoreError):
    """A certificate an operator revoked (``llmgw ctl servers remove``) tried to act."""


@attrs.frozen
class ControlPlaneRecord:
    """A control plane that has run on this store, by its certificate's name. Times are Unix
    seconds; ``serial`` is its certificate's serial number (hex) when it last started."""

    name: str
    rpc_address: str
    http_address: str
    first_seen: float
    last_seen: float
    serial: str = ""


@attrs.frozen
class ControlPlaneRemoval:
    """What removing a control plane did: its row (None: it had none) and how many of its
    join tokens that could still have been used were revoked."""

    record: ControlPlaneRecord | None
    tokens_revoked: int


@attrs.frozen
class NodeRemoval:
    """What removing a node did: whether the store knew it, how many of its certificates and
    of its join tokens that could still have been used were revoked."""

    known: bool
    certificates_revoked: int
    tokens_revoked: int


@attrs.frozen
class JoinTokenRecord:
    """A one-time join token (without its secret). Times are Unix seconds; ``used_at``,
    ``used_by`` (the address it was redeemed from) and ``revoked_at`` are None until then."""

    id: str
    role: str
    name: str
    created_at: float
    created_by: str
    expires_at: float
    used_at: float | None = None
    used_by: str | None = None
    revoked_at: float | None = None
    #: What a node joining with it writes into its agent.yaml (labels, disabled engines).
    overrides: NodeOverrides = NodeOverrides()

    def state(self, now: float) -> str:
        """Returns ``used``, ``revoked``, ``expired`` or ``pending`` at Unix time ``now``."""
        if self.used_at is not None:
            return "used"
        if self.revoked_at is not None:
            return "revoked"
        return "expired" if now >= self.expires_at else "pending"


@attrs.frozen
class NodeRecord:
    """A node that has joined at least once. Times are Unix seconds."""

    id: str
    address: str
    first_seen: float
    last_seen: float
    labels: Mapping[str, str] = attrs.field(factory=dict, converter=lambda d: dict(d))


@attrs.frozen
class AuditEntry:
    """One audit record. ``id`` grows with insertion order; ``ts`` is Unix seconds."""

    id: int
    ts: float
    actor: str
    action: str
    target: str
    detail: Mapping[str, Any] = attrs.field(factory=dict, converter=lambda d: dict(d))


@attrs.frozen
class SettingVersion:
    """One version of a cluster setting. Versions of a key count up from 1 without gaps."""

    key: str
    value: Any
    version: int
    updated_at: float
    actor: str


# -- tenants, API keys, usage (migration 2) ------------------------------------------------


class NotFoundError(StoreError):
    """The record the write refers to does not exist (e.g. an API key for an unknown tenant)."""


@attrs.frozen
class TenantRecord:
    """A tenant: ``models`` it may use (None: every model) and its limits (0: unlimited)."""

    name: str
    models: tuple[str, ...] | None = None
    max_concurrency: int = 0
    rpm: int = 0
    tpm: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0


@attrs.frozen
class ApiKeyRecord:
    """An API key as stored: never the key itself, only the SHA-256 of its secret (hex)."""

    id: str
    tenant: str
    name: str
    secret_sha256: str
    created_at: float = 0.0
    revoked_at: float | None = None


@attrs.frozen
class AdminTokenRecord:
    """A bearer token of the HTTP admin API as stored: only the SHA-256 of its secret (hex)."""

    id: str
    name: str
    secret_sha256: str
    created_by: str = ""
    created_at: float = 0.0
    revoked_at: float | None = None


@attrs.frozen
class UsageRecord:
    """Requests and tokens of one tenant on one model, added up over every gateway."""

    tenant: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    updated_at: float = 0.0


class Store(abc.ABC):
    """The control plane's persistent state, behind one interface for SQLite and PostgreSQL.

    Get one with :func:`llmgw.control.store.open_store`; it is an async context manager
    that closes the store on exit. Every method raises :class:`StoreUnavailableError`
    (or its subclass :class:`StoreTimeoutError`) when the database cannot be reached or
    a statement times out, and :class:`StoreClosedError` after :meth:`close`.
    """

    #: Where the data lives, for messages and logs (a path, or a DSN without the password).
    description: str

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the connection. Idempotent; waits for an operation in flight to finish."""

    @abc.abstractmethod
    async def schema_version(self) -> int:
        """Return the highest migration version applied to the database."""

    # -- leadership (migration 5) --------------------------------------------------------

    @abc.abstractmethod
    def set_fence(self, epoch: int | None) -> None:
        """From now on, refuse every write made on behalf of leadership (catalog, tenants,
        keys, settings, nodes) with :class:`FencedError` unless the store's leadership epoch
        is still ``epoch``, checked in the write's own transaction. None: no check (a store
        no election runs on). Usage and audit writes are never fenced."""

    @abc.abstractmethod
    async def record_control_plane(
        self, name: str, rpc_address: str, http_address: str, serial: str = ""
    ) -> ControlPlaneRecord:
        """Record that control plane ``name`` runs (its addresses as others reach it, the
        serial of its certificate). Raises :class:`CertificateRevokedError` when that
        certificate was revoked (the control plane was removed)."""

    @abc.abstractmethod
    async def list_control_planes(self) -> list[ControlPlaneRecord]:
        """Return every control plane that has run on this store, by name."""

    # -- joining and revocation (migration 6) ----------------------------------------------

    @abc.abstractmethod
    async def create_join_token(self, token: JoinTokenRecord, secret_sha256: str) -> JoinTokenRecord:
        """Store a new join token (fenced); return it. Raises :class:`ConflictError` if its id exists."""

    @abc.abstractmethod
    async def list_join_tokens(self) -> list[JoinTokenRecord]:
        """Return every join token, oldest first."""

    @abc.abstractmethod
    async def redeem_join_token(self, token_id: str, secret_sha256: str, used_by: str,
                                now: float | None = None, role: str = "") -> JoinTokenRecord:
        """Mark token ``token_id`` used by ``used_by`` if its secret hashes to
        ``secret_sha256``, it is for ``role`` ("": any) and it is pending at ``now``
        (default: the clock), in one transaction, so a token is redeemed at most once even
        by racing control planes. Returns it as used. Raises :class:`JoinTokenRefused`
        saying why otherwise (a token for another role stays unused). Not fenced: any
        control plane may answer a join."""

    @abc.abstractmethod
    async def remove_control_plane(self, name: str, actor: str) -> ControlPlaneRemoval:
        """Forget control plane ``name`` (fenced), in one transaction: delete its row, revoke
        the certificate it last ran with and every pending join token for it. Returns what
        was removed (no row where no control plane has that name)."""

    @abc.abstractmethod
    async def record_node_certificate(self, node_id: str, serial: str) -> None:
        """Remember that node ``node_id`` holds the certificate ``serial`` (issued to it, or
        connected with), so that removing the node revokes it. Not fenced: any control plane
        answers joins."""

    @abc.abstractmethod
    async def remove_node(self, node_id: str, actor: str) -> NodeRemoval:
        """Forget node ``node_id`` (fenced), in one transaction: revoke every certificate it
        was issued or connected with and every pending join token for it, and delete its row."""

    @abc.abstractmethod
    async def is_certificate_revoked(self, serial: str) -> bool:
        """Return whether the certificate with serial ``serial`` (hex) was revoked."""

    # -- models (the catalog) ------------------------------------------------------------

    @abc.abstractmethod
    async def put_model(self, spec: ModelSpec, *, create_only: bool) -> ModelSpec:
        """Store a catalog entry and return it as stored.

        With ``create_only`` an existing entry of the same name raises :class:`ConflictError`;
        without it the entry is replaced (its ``created_at`` is kept). The spec is expected
        to have passed :func:`llmgw.catalog.validate_model` already.
        """

    @abc.abstractmethod
    async def get_model(self, name: str) -> ModelSpec | None:
        """Return the catalog entry named ``name``, or None if there is none."""

    @abc.abstractmethod
    async def list_models(self) -> list[ModelSpec]:
        """Return every catalog entry, ordered by name."""

    @abc.abstractmethod
    async def delete_model(self, name: str) -> bool:
        """Delete the entry named ``name``; return whether there was one."""

    # -- nodes ---------------------------------------------------------------------------

    @abc.abstractmethod
    async def record_node_seen(self, node_id: str, address: str) -> NodeRecord:
        """Record that ``node_id`` is (or was just) connected from ``address``; return the record.

        The first call sets ``first_seen``; every call updates ``last_seen`` and the address.
        """

    @abc.abstractmethod
    async def list_known_nodes(self) -> list[NodeRecord]:
        """Return every node that has ever joined, ordered by id."""

    # -- audit ---------------------------------------------------------------------------

    @abc.abstractmethod
    async def audit(
        self, actor: str, action: str, target: str, detail: Mapping[str, Any] | None = None
    ) -> AuditEntry:
        """Append one audit record and return it.

        ``detail`` must be JSON data; anything else raises TypeError or ValueError and
        writes nothing.
        """

    @abc.abstractmethod
    async def list_audit(self, limit: int = 100) -> list[AuditEntry]:
        """Return the newest ``limit`` audit records, newest first."""

    # -- settings ------------------------------------------------------------------------

    @abc.abstractmethod
    async def get_setting(self, key: str) -> SettingVersion | None:
        """Return the current version of setting ``key``, or None if it was never set."""

    @abc.abstractmethod
    async def list_settings(self) -> list[SettingVersion]:
        """Return the current version of every stored setting, by key (an unset one has value None)."""

    @abc.abstractmethod
    async def set_setting(self, key: str, value: Any, actor: str) -> int:
        """Set ``key`` to ``value`` and return the new version number.

        ``value`` must be JSON data (None, bool, int, finite float, str, lists, string-keyed
        dicts); anything else raises TypeError or ValueError and writes nothing.

        Concurrent writers (tasks or whole control planes) each get a distinct version;
        the history keeps every value.
        """

    @abc.abstractmethod
    async def setting_history(self, key: str) -> list[SettingVersion]:
        """Return every version of ``key``, oldest first (empty if it was never set)."""

    # -- tenants, API keys, usage (migration 2) ------------------------------------------
    # Not abstract, so a Store implementation without them still works for everything else.

    async def put_tenant(self, tenant: TenantRecord, *, create_only: bool) -> TenantRecord:
        """Store ``tenant`` and return it as stored (with its times).

        With ``create_only`` an existing tenant of that name raises :class:`ConflictError`;
        without it the tenant must exist (:class:`NotFoundError` otherwise) and is replaced,
        keeping ``created_at``.
        """
        raise NotImplementedError

    async def list_tenants(self) -> list[TenantRecord]:
        """Return every tenant, ordered by name."""
        raise NotImplementedError

    async def delete_tenant(self, name: str) -> bool:
        """Delete tenant ``name`` and revoke its keys; return whether there was one."""
        raise NotImplementedError

    async def create_api_key(self, key: ApiKeyRecord) -> ApiKeyRecord:
        """Store a new key of an existing tenant (:class:`NotFoundError` if it does not exist)."""
        raise NotImplementedError

    async def list_api_keys(self) -> list[ApiKeyRecord]:
        """Return every key, revoked ones included, oldest first."""
        raise NotImplementedError

    async def revoke_api_key(self, key_id: str) -> ApiKeyRecord | None:
        """Revoke key ``key_id`` (no-op if already revoked); return it, or None if unknown."""
        raise NotImplementedError

    async def create_admin_token(self, token: AdminTokenRecord) -> AdminTokenRecord:
        """Store a new admin token (:class:`ConflictError` if its id exists); returns it as stored."""
        raise NotImplementedError

    async def list_admin_tokens(self) -> list[AdminTokenRecord]:
        """Return every admin token, revoked ones included, oldest first."""
        raise NotImplementedError

    async def get_admin_token(self, token_id: str) -> AdminTokenRecord | None:
        """Return admin token ``token_id`` (revoked or not), or None if unknown."""
        raise NotImplementedError

    async def revoke_admin_token(self, token_id: str) -> AdminTokenRecord | None:
        """Revoke admin token ``token_id`` (no-op if already revoked); return it, or None if unknown."""
        raise NotImplementedError

    async def add_usage(self, rows: list[UsageRecord], *, marks: Mapping[str, int] | None = None) -> None:
        """Add ``rows``' counts to the stored totals of each (tenant, model), in one transaction.

        ``marks`` (usage journal id -> sequence) are raised, in the same transaction, to at
        least the given sequence: the rows hold that journal's usage up to it
        (:mod:`llmgw.usage_journal`). A mark never goes down.
        """
        raise NotImplementedError

    async def usage_marks(self) -> dict[str, int]:
        """Return every usage journal's mark (the highest sequence whose usage is stored)."""
        raise NotImplementedError

    async def forget_usage_marks(self, journals: Iterable[str]) -> None:
        """Delete the marks of ``journals`` (their files are gone: nothing can replay them)."""
        raise NotImplementedError

    async def list_usage(self) -> list[UsageRecord]:
        """Return the stored totals, ordered by tenant and model."""
        raise NotImplementedError
