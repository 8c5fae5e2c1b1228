"""``server.yaml``: one control plane (and its gateway).

:func:`load_server_config` reads the file, lays overrides over it, checks every key and
returns a frozen :class:`ServerConfig`; its gateway sections are in :mod:`.sections`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import attrs

from . import defaults
from .dsn import redact_dsn, store_backend
from .sections import (
    AuthConfig, GatewayConfig, MetricsConfig, RoutingConfig, ServingConfig, TracingConfig, read_auth, read_gateway,
    read_metrics, read_routing, read_serving, read_tracing,
)
from .values import (
    ENGINE_NAME, ENGINE_NAME_RULE, Address, frozen_mapping, parse_address, parse_duration, parse_host, parse_log_level,
    parse_str, positive,
)
from .yaml_reader import MISSING, Reader, open_config

__all__ = ["ServerConfig", "StoreConfig", "load_server_config"]

_RPC_LISTEN = Address(defaults.DEFAULT_LISTEN_HOST, defaults.DEFAULT_RPC_PORT)
_HTTP_LISTEN = Address(defaults.DEFAULT_LISTEN_HOST, defaults.DEFAULT_HTTP_PORT)


@attrs.frozen
class StoreConfig:
    """Where the control plane keeps its state: a SQLite file, or a PostgreSQL database."""

    backend: str  # "sqlite" or "postgresql"
    path: Path | None = None  # the SQLite file (backend "sqlite")
    #: libpq connection string or URL (backend "postgresql"); shown without its password.
    dsn: str | None = attrs.field(default=None, repr=lambda dsn: repr(dsn and redact_dsn(dsn)))

    @classmethod
    def sqlite(cls, path: Path) -> StoreConfig:
        return cls("sqlite", path=path)

    @classmethod
    def default_in(cls, state_dir: Path) -> StoreConfig:
        """The SQLite file ``state_dir`` holds when ``store:`` does not say otherwise."""
        return cls.sqlite(state_dir / defaults.DEFAULT_SQLITE_NAME)

    @property
    def url(self) -> str:
        """The store as one string: ``sqlite:////abs/path`` or the PostgreSQL DSN (with its
        password: give it to :func:`llmgw.control.store.open_store`, never to a log)."""
        return f"sqlite:///{self.path}" if self.backend == "sqlite" else str(self.dsn)


def _default_store(config: ServerConfig) -> StoreConfig:
    return StoreConfig.default_in(config.state_dir)


@attrs.frozen
class ServerConfig:
    """``server.yaml``: one control plane (and its gateway)."""

    state_dir: Path = defaults.DEFAULT_SERVER_STATE_DIR
    rpc_listen: Address = _RPC_LISTEN
    http_listen: Address = _HTTP_LISTEN
    advertise_hosts: tuple[str, ...] = ()
    store: StoreConfig = attrs.field(default=attrs.Factory(_default_store, takes_self=True))
    heartbeat_interval: float = defaults.DEFAULT_HEARTBEAT_INTERVAL
    node_lost_after: float = defaults.DEFAULT_NODE_LOST_AFTER
    replace_grace: float = defaults.DEFAULT_REPLACE_GRACE
    leader_lease: float = defaults.DEFAULT_LEADER_LEASE
    engines: Mapping[str, str] = attrs.field(factory=dict, converter=frozen_mapping)
    log_level: str = defaults.DEFAULT_LOG_LEVEL
    gateway: GatewayConfig = GatewayConfig()
    tracing: TracingConfig = TracingConfig()
    auth: AuthConfig = AuthConfig()
    serving: ServingConfig = ServingConfig()
    routing: RoutingConfig = RoutingConfig()
    metrics: MetricsConfig = MetricsConfig()

    @property
    def ca_dir(self) -> Path:
        """Where the cluster CA lives on this control plane (``<state_dir>/ca``)."""
        return self.state_dir / "ca"


def load_server_config(
    path: Path | str | None = None, overrides: Mapping[str, Any] | None = None
) -> ServerConfig:
    """Read ``server.yaml`` at ``path`` (``None``: no file, all defaults), apply
    ``overrides`` over it, and return the validated :class:`ServerConfig`.

    ``overrides`` holds nested mappings or dotted keys, e.g. ``{"state_dir": "/tmp/x",
    "store.url": "postgresql://db/llmgw"}``; they are validated like file values, and
    a key derived from another (the SQLite file from ``state_dir``) follows an overridden
    one. Raises :class:`ConfigError` naming the file, key path and reason.
    """
    reader, top = open_config(path, overrides, "server.yaml")
    state_dir = top.get_path("state_dir", defaults.DEFAULT_SERVER_STATE_DIR)
    config = ServerConfig(
        state_dir=state_dir,
        rpc_listen=top.get("rpc_listen", lambda v: parse_address(v, listen=True), _RPC_LISTEN),
        http_listen=top.get("http_listen", lambda v: parse_address(v, listen=True), _HTTP_LISTEN),
        advertise_hosts=top.get_list("advertise_hosts", parse_host, ()),
        store=_read_store(reader, top.raw("store"), state_dir),
        heartbeat_interval=top.get("heartbeat_interval", positive(parse_duration),
                                   defaults.DEFAULT_HEARTBEAT_INTERVAL),
        node_lost_after=top.get("node_lost_after", positive(parse_duration),
                                defaults.DEFAULT_NODE_LOST_AFTER),
        replace_grace=top.get("replace_grace", parse_duration, defaults.DEFAULT_REPLACE_GRACE),
        leader_lease=top.get("leader_lease", positive(parse_duration), defaults.DEFAULT_LEADER_LEASE),
        engines=reader.named_values(top.raw("engines"), "engines", ENGINE_NAME, ENGINE_NAME_RULE, _parse_version),
        log_level=top.get("log_level", parse_log_level, defaults.DEFAULT_LOG_LEVEL),
        gateway=read_gateway(reader, top.raw("gateway")),
        tracing=read_tracing(reader, top.raw("tracing")),
        auth=read_auth(reader, top.raw("auth")),
        serving=read_serving(reader, top.raw("serving")),
        routing=read_routing(reader, top.raw("routing")),
        metrics=read_metrics(reader, top.raw("metrics")),
    )
    top.finish()
    if config.node_lost_after <= config.heartbeat_interval:
        raise reader.error(
            "node_lost_after",
            f"must be longer than heartbeat_interval ({config.node_lost_after:g}s <= "
            f"{config.heartbeat_interval:g}s), or every node is lost between two heartbeats",
        )
    return config


def _read_store(reader: Reader, raw: Any, state_dir: Path) -> StoreConfig:
    default = StoreConfig.default_in(state_dir)
    if raw is MISSING:
        return default
    section = reader.section(raw, "store")
    url = section.get("url", parse_str, None)
    dsn = section.get("dsn", parse_str, None)
    section.finish()
    if url is not None and dsn is not None:
        raise reader.error("store", "give url or dsn, not both")
    key, text = ("store.dsn", dsn) if dsn is not None else ("store.url", url)
    if text is None:
        return default
    try:
        backend, location = store_backend(text)
    except ValueError as exc:
        raise reader.error(key, str(exc)) from None
    if backend == "postgresql":
        return StoreConfig("postgresql", dsn=location)
    if key == "store.dsn":
        raise reader.error(
            key, "is for PostgreSQL (a postgresql:// URL or libpq key=value, e.g. host=db1 dbname=llmgw): "
            "a SQLite file goes in store.url as sqlite:///PATH or a path",
        )
    file_path = Path(location).expanduser()
    if not file_path.is_absolute():
        file_path = state_dir / file_path
    return StoreConfig.sqlite(file_path)


def _parse_version(name: str, value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ValueError(
            f"expected a version string, got the number {value} (YAML reads an unquoted "
            f'version as a number, 0.10 as 0.1): quote it, e.g. {name}: "0.10.2"'
        )
    try:
        return parse_str(value)
    except ValueError as exc:
        raise ValueError(f"version: {exc}") from None
