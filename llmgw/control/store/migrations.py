"""Versioned schema migrations, the same logical schema on SQLite and PostgreSQL.

Each :class:`Migration` is applied at most once, in its own transaction, and recorded in
``schema_migrations``. Statements are written once with type placeholders (``{json}``,
``{ts}``, ``{id_pk}``) that each dialect fills in; everything else is SQL both accept.

To change the schema, append a migration with the next version number. Never edit or
reorder one that has shipped: databases in the field have already applied it.
"""

from __future__ import annotations

from typing import Sequence

import attrs


@attrs.frozen
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]


@attrs.frozen
class Dialect:
    """How one backend spells the column types the schema uses."""

    name: str
    json: str  # a JSON document; the store always reads and writes it as JSON text
    ts: str  # Unix seconds as a float (the same on both backends; no time-zone surprises)
    id_pk: str  # an integer primary key the database assigns in insertion order
    blob: str  # bytes (result files, training pairs)
    #: Appended to a SELECT to hold its rows against concurrent updates until COMMIT
    #: ("" where the transaction already excludes every other writer, as SQLite's does).
    for_share: str = ""

    def render(self, statement: str) -> str:
        """Return ``statement`` with this dialect's types in place of the placeholders."""
        return statement.format(json=self.json, ts=self.ts, id_pk=self.id_pk, blob=self.blob)


SQLITE = Dialect(
    name="sqlite",
    json="TEXT",
    ts="REAL",
    # AUTOINCREMENT: ids are never reused, even after the newest rows are deleted.
    id_pk="INTEGER PRIMARY KEY AUTOINCREMENT",
    blob="BLOB",
)
POSTGRES = Dialect(
    name="postgres",
    json="JSONB",
    ts="DOUBLE PRECISION",
    id_pk="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
    blob="BYTEA",
    for_share=" FOR SHARE",
)

#: Created before anything else, outside the numbered migrations.
SCHEMA_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    applied_at {ts} NOT NULL
)
"""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        version=1,
        name="catalog, nodes, audit, settings",
        statements=(
            """
            CREATE TABLE models (
                name TEXT PRIMARY KEY,
                engine TEXT NOT NULL,
                source TEXT NOT NULL,
                profile {json} NOT NULL,
                created_at {ts} NOT NULL,
                updated_at {ts} NOT NULL
            )
            """,
            """
            CREATE TABLE nodes (
                id TEXT PRIMARY KEY,
                address TEXT NOT NULL,
                first_seen {ts} NOT NULL,
                last_seen {ts} NOT NULL,
                labels {json} NOT NULL
            )
            """,
            """
            CREATE TABLE audit (
                id {id_pk},
                ts {ts} NOT NULL,
                actor TEXT NOT NULL,
                action TEXT NOT NULL,
                target TEXT NOT NULL,
                detail {json} NOT NULL
            )
            """,
            "CREATE INDEX audit_ts ON audit (ts)",
            # The current value of each setting; its row lock is what hands out versions.
            """
            CREATE TABLE settings (
                key TEXT PRIMARY KEY,
                value {json} NOT NULL,
                version INTEGER NOT NULL,
                updated_at {ts} NOT NULL,
                actor TEXT NOT NULL
            )
            """,
            """
            CREATE TABLE setting_history (
                key TEXT NOT NULL,
                version INTEGER NOT NULL,
                value {json} NOT NULL,
                updated_at {ts} NOT NULL,
                actor TEXT NOT NULL,
                PRIMARY KEY (key, version)
            )
            """,
        ),
    ),
    Migration(
        version=2,
        name="tenants, api keys, usage",
        statements=(
            # models: a JSON list of catalog model names, or JSON null for every model.
            # Limits: 0 means unlimited.
            """
            CREATE TABLE tenants (
                name TEXT PRIMARY KEY,
                models {json} NOT NULL,
                max_concurrency INTEGER NOT NULL,
                rpm INTEGER NOT NULL,
                tpm BIGINT NOT NULL,
                created_at {ts} NOT NULL,
                updated_at {ts} NOT NULL
            )
            """,
            # Only the SHA-256 of a key's secret is kept; id is the key's public prefix.
            """
            CREATE TABLE api_keys (
                id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                name TEXT NOT NULL,
                secret_sha256 TEXT NOT NULL,
                created_at {ts} NOT NULL,
                revoked_at {ts}
            )
            """,
            "CREATE INDEX api_keys_tenant ON api_keys (tenant)",
            # Requests and tokens per tenant and model, added to by every gateway's flush.
            """
            CREATE TABLE usage (
                tenant TEXT NOT NULL,
                model TEXT NOT NULL,
                requests BIGINT NOT NULL,
                prompt_tokens BIGINT NOT NULL,
                completion_tokens BIGINT NOT NULL,
                updated_at {ts} NOT NULL,
                PRIMARY KEY (tenant, model)
            )
            """,
        ),
    ),
    Migration(
        version=3,
        name="LoRA adapters of catalog models",
        statements=(
            # adapters: a JSON list of {"name", "source"}; max_loaded_adapters: 0 = all loaded at start.
            "ALTER TABLE models ADD COLUMN adapters {json} NOT NULL DEFAULT '[]'",
            "ALTER TABLE models ADD COLUMN max_loaded_adapters INTEGER NOT NULL DEFAULT 0",
        ),
    ),
    Migration(
        version=4,
        name="usage journal marks",
        statements=(
            # Per gateway usage journal (llmgw/usage_journal.py), the highest sequence whose
            # usage the usage table holds: written in the same transaction as that usage,
            # so replaying a journal after a crash never counts a request twice.
            """
            CREATE TABLE usage_journals (
                journal TEXT PRIMARY KEY,
                seq BIGINT NOT NULL,
                updated_at {ts} NOT NULL
            )
            """,
        ),
    ),
    Migration(
        version=5,
        name="leadership and control planes",
        statements=(
            # The one row naming who leads. epoch is the fencing token: it grows by one each
            # time a control plane takes the lead, and every write made on behalf of
            # leadership checks it (llmgw/control/store/election.py, llmgw/control/leader.py).
            # renewed_at is the database's clock; backend_pid the PostgreSQL session holding
            # the leader's advisory lock (0 on SQLite).
            """
            CREATE TABLE leadership (
                id INTEGER PRIMARY KEY CHECK (id = 1),
                epoch BIGINT NOT NULL,
                leader TEXT NOT NULL,
                rpc_address TEXT NOT NULL,
                http_address TEXT NOT NULL,
                since {ts} NOT NULL,
                renewed_at {ts} NOT NULL,
                backend_pid BIGINT NOT NULL
            )
            """,
            # Every control plane that has run on this store, by its certificate's name: the
            # leader accepts peer sessions only from these (and standbys find each other here).
            """
            CREATE TABLE control_planes (
                name TEXT PRIMARY KEY,
                rpc_address TEXT NOT NULL,
                http_address TEXT NOT NULL,
                first_seen {ts} NOT NULL,
                last_seen {ts} NOT NULL
            )
            """,
        ),
    ),
    Migration(
        version=6,
        name="join tokens and revoked certificates",
        statements=(
            # One-time tokens a new control plane (role control) or node redeems once for a
            # certificate named `name` (`llmgw ctl servers add`). Only the SHA-256 of the secret
            # is kept; used_at/used_by say who redeemed it, revoked_at that an operator withdrew it.
            """
            CREATE TABLE join_tokens (
                id TEXT PRIMARY KEY,
                secret_sha256 TEXT NOT NULL,
                role TEXT NOT NULL,
                name TEXT NOT NULL,
                created_at {ts} NOT NULL,
                created_by TEXT NOT NULL,
                expires_at {ts} NOT NULL,
                used_at {ts},
                used_by TEXT,
                revoked_at {ts}
            )
            """,
            # Certificates refused from now on, by serial (hex): those of a removed control
            # plane (`llmgw ctl servers remove`). Every connection is checked against it.
            """
            CREATE TABLE revoked_certificates (
                serial TEXT PRIMARY KEY,
                role TEXT NOT NULL,
                name TEXT NOT NULL,
                revoked_at {ts} NOT NULL,
                actor TEXT NOT NULL
            )
            """,
            # The serial of the certificate each control plane last ran with, so removing it
            # revokes exactly that certificate.
            "ALTER TABLE control_planes ADD COLUMN serial TEXT NOT NULL DEFAULT ''",
        ),
    ),
    Migration(
        version=7,
        name="admin tokens",
        statements=(
            # Bearer tokens for the HTTP admin API (/api/v1/*, `llmgw ctl admin-tokens`): only the
            # SHA-256 of the secret is kept; the name is the actor in the audit log.
            """
            CREATE TABLE admin_tokens (
                id TEXT PRIMARY KEY,
                name TEXT NOT NULL,
                secret_sha256 TEXT NOT NULL,
                created_at {ts} NOT NULL,
                created_by TEXT NOT NULL,
                revoked_at {ts}
            )
            """,
        ),
    ),
    Migration(
        version=8,
        name="node certificates",
        statements=(
            # Every certificate serial a node was issued (`llmgw agent join`) or connected with,
            # so `llmgw ctl nodes remove` revokes each of them.
            """
            CREATE TABLE node_certificates (
                serial TEXT PRIMARY KEY,
                node TEXT NOT NULL,
                seen_at {ts} NOT NULL
            )
            """,
        ),
    ),
    Migration(
        version=9,
        name="node join overrides",
        statements=(
            # What a node joining with the token writes into its agent.yaml (`llmgw ctl nodes
            # add --labels ... --disable-engine ...`): llmgw.jointoken.NodeOverrides as JSON.
            "ALTER TABLE join_tokens ADD COLUMN overrides TEXT NOT NULL DEFAULT '{{}}'",
        ),
    ),
    Migration(
        version=10,
        name="training jobs",
        statements=(
            # LoRA training jobs (issue 17, llmgw/training.py): what to train, where it trains and
            # how far it got. params and progress are JSON (llmgw.training.TrainingParams; step,
            # steps, loss, first_loss, peak_memory_bytes, device).
            """
            CREATE TABLE training_jobs (
                id TEXT PRIMARY KEY,
                adapter TEXT NOT NULL,
                model TEXT NOT NULL,
                weights TEXT NOT NULL,
                node TEXT NOT NULL,
                gpu_mib BIGINT NOT NULL,
                params TEXT NOT NULL,
                state TEXT NOT NULL,
                message TEXT NOT NULL,
                assigned_node TEXT NOT NULL,
                gpu INTEGER NOT NULL,
                progress TEXT NOT NULL,
                pairs INTEGER NOT NULL,
                created_by TEXT NOT NULL,
                created_at {ts} NOT NULL,
                updated_at {ts} NOT NULL,
                result_bytes BIGINT NOT NULL,
                result_sha256 TEXT NOT NULL,
                result_format TEXT NOT NULL
            )
            """,
            # A job's files in pieces: its pairs (kind "pairs") and its result ("result"), each
            # piece with the SHA-256 of its bytes, so a damaged piece is found when it is read.
            """
            CREATE TABLE training_files (
                job_id TEXT NOT NULL,
                kind TEXT NOT NULL,
                seq INTEGER NOT NULL,
                data {blob} NOT NULL,
                sha256 TEXT NOT NULL,
                PRIMARY KEY (job_id, kind, seq)
            )
            """,
        ),
    ),
    Migration(
        version=11,
        name="training jobs that register their adapter",
        statements=(
            # `llmgw ctl jobs train --register`: once the job succeeds, its result is added to the
            # model as an adapter (1) or left for `ctl models adapters add --from-job` (0).
            "ALTER TABLE training_jobs ADD COLUMN register INTEGER NOT NULL DEFAULT 0",
        ),
    ),
)


def latest_version(migrations: Sequence[Migration]) -> int:
    """Return the highest version in ``migrations`` (0 for none)."""
    return max((m.version for m in migrations), default=0)


def check_migrations(migrations: Sequence[Migration]) -> None:
    """Raise ValueError unless ``migrations`` are numbered 1, 2, 3, ... in order."""
    for expected, migration in enumerate(migrations, start=1):
        if migration.version != expected:
            raise ValueError(
                f"migration {migration.name!r} has version {migration.version}, expected {expected}"
            )


check_migrations(MIGRATIONS)
