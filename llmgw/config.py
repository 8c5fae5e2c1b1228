"""``server.yaml`` and ``agent.yaml``: loading, validation and defaults.

:func:`load_server_config` and :func:`load_agent_config` read a YAML file (or nothing),
lay the caller's overrides (command-line options, ``llmgw up``) over it, check every key,
and return a frozen attrs object. Anything wrong is a :class:`ConfigError` whose message
starts with the file and the key's path, then the reason::

    agent.yaml: control_planes[1]: expected "host:port", got "x"
    server.yaml: store: unknown key 'dns' (did you mean 'dsn'?)

An empty or absent file gives a working configuration: every key has a default.
``docs/config.md`` is the reference of every key.

Reading is blocking file I/O of a small file, done once at start-up.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import socket
import types
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import attrs
import yaml

from llmgw.rpc import tls

__all__ = [
    "AgentConfig",
    "AgentTLS",
    "AuthConfig",
    "ServingConfig",
    "RoutingConfig",
    "Address",
    "ConfigError",
    "LOG_LEVELS",
    "ServerConfig",
    "StoreConfig",
    "load_agent_config",
    "load_server_config",
    "parse_address",
    "parse_duration",
]

# --- defaults (the reasons are in docs/config.md too) -----------------------------------

DEFAULT_SERVER_STATE_DIR = Path("/var/lib/llmgw")
DEFAULT_AGENT_STATE_DIR = Path("/var/lib/llmgw-agent")
#: Loopback by default: a fresh install exposes nothing until the operator says where.
DEFAULT_RPC_LISTEN = "127.0.0.1:7070"
DEFAULT_HTTP_LISTEN = "127.0.0.1:8080"
DEFAULT_SQLITE_NAME = "llmgw.db"
#: Agents send a heartbeat this often (seconds)...
DEFAULT_HEARTBEAT_INTERVAL = 2.0
#: ...and a node that has sent none for this long is lost: five missed heartbeats, so one
#: slow network moment does not flap a node.
DEFAULT_NODE_LOST_AFTER = 10.0
#: A lost node's replicas are placed elsewhere only after this grace: an agent restart or
#: short network cut must not trigger a fleet-wide reshuffle.
DEFAULT_REPLACE_GRACE = 30.0
#: An agent that cannot reach any control plane retries with exponential backoff capped here.
DEFAULT_RECONNECT_BACKOFF_MAX = 30.0
#: Where Hugging Face repositories (hf://org/repo) are fetched from; a mirror can replace it.
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
DEFAULT_LOG_LEVEL = "info"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_ENGINE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file (or override) is unreadable or has a wrong key or value.
    The message is ``<file>: <key path>: <reason>``, ready to show to the operator."""


# --- value types ------------------------------------------------------------------------


@attrs.frozen
class Address:
    """A ``host:port`` pair; ``str()`` gives it back in that form (IPv6 in brackets)."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@attrs.frozen
class StoreConfig:
    """Where the control plane keeps its state: a SQLite file, or a PostgreSQL database."""

    backend: str  # "sqlite" or "postgresql"
    path: Path | None = None  # the SQLite file (backend "sqlite")
    dsn: str | None = None  # libpq connection string or URL (backend "postgresql")

    @classmethod
    def sqlite(cls, path: Path) -> StoreConfig:
        return cls("sqlite", path=path)

    @property
    def url(self) -> str:
        """The store as one string: ``sqlite:////abs/path`` or the PostgreSQL DSN."""
        return f"sqlite:///{self.path}" if self.backend == "sqlite" else str(self.dsn)


def _default_store(config: ServerConfig) -> StoreConfig:
    return StoreConfig.sqlite(config.state_dir / DEFAULT_SQLITE_NAME)


def _frozen_mapping(value: Mapping[str, str]) -> Mapping[str, str]:
    return types.MappingProxyType(dict(value))


# --- gateway observability and upstream deadlines (server.yaml `gateway:`, `tracing:`) ---
# The deadline defaults equal llmgw.router.upstream's constants (the reasons are there);
# they are repeated here so loading a config does not import the gateway.
DEFAULT_UPSTREAM_CONNECT_TIMEOUT = 5.0
DEFAULT_UPSTREAM_FIRST_BYTE_TIMEOUT = 600.0
DEFAULT_UPSTREAM_CHUNK_TIMEOUT = 60.0
DEFAULT_TRACING_SERVICE_NAME = "llmgw-gateway"


@attrs.frozen
class GatewayConfig:
    """``gateway:``: how the gateway talks to engine replicas (deadlines, in seconds)."""

    connect_timeout: float = DEFAULT_UPSTREAM_CONNECT_TIMEOUT
    first_byte_timeout: float = DEFAULT_UPSTREAM_FIRST_BYTE_TIMEOUT
    chunk_timeout: float = DEFAULT_UPSTREAM_CHUNK_TIMEOUT
    #: Gateway processes on the HTTP port (1: in the server process; N > 1: N worker
    #: processes with SO_REUSEPORT, fed by the control plane; docs/gateway.md).
    workers: int = 1


@attrs.frozen
class TracingConfig:
    """``tracing:``: OpenTelemetry export over OTLP/HTTP; an empty endpoint turns it off."""

    endpoint: str = ""
    service_name: str = DEFAULT_TRACING_SERVICE_NAME
    sample_ratio: float = 1.0


# --- API keys and admission (server.yaml `auth:`, `serving:`) -----------------------------
# Defaults equal llmgw.router.admission's / llmgw.control.keys' constants (reasons there).
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_INFLIGHT_PER_REPLICA = 256
DEFAULT_QUEUE_SIZE = 1024
DEFAULT_QUEUE_TIMEOUT = 30.0
DEFAULT_USAGE_FLUSH_INTERVAL = 10.0


@attrs.frozen
class AuthConfig:
    """``auth:``: whether the gateway requires API keys (off only for loopback demos)."""

    enabled: bool = True


@attrs.frozen
class ServingConfig:
    """``serving:``: request size limit, per-model admission queue, usage flushing."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_inflight_per_replica: int = DEFAULT_MAX_INFLIGHT_PER_REPLICA
    queue_size: int = DEFAULT_QUEUE_SIZE
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT
    usage_flush_interval: float = DEFAULT_USAGE_FLUSH_INTERVAL


# --- routing (server.yaml `routing:`) -----------------------------------------------------
# The defaults of llmgw.router.kvrouting and llmgw.router.tokens (docs/gateway.md).
ROUTING_POLICIES = ("kv", "least-load", "round-robin")
#: Least extra in-flight requests, over the least-loaded candidate, that a warm replica
#: may carry and still be chosen for its cache (measured: 2 let a hot tenant's replica take
#: 1.55x the mean request count in bench/routing.py; 1 keeps it under 1.5x).
DEFAULT_LOAD_GATE_MIN = 1
#: ...and the gate as a share of the mean in-flight count, for busy fleets: at 40 in
#: flight per replica, a warm one may carry up to 10 more than the coolest (so no replica
#: runs much past 1.25x the mean).
DEFAULT_LOAD_GATE_SHARE = 0.25
#: Seconds a routed-but-unconfirmed block counts as held by the replica it was sent to
#: (llm-d's speculative entries): long enough for prefill plus the agent's event relay,
#: short enough that a request that failed does not attract its prefix for long.
DEFAULT_UNCONFIRMED_TTL = 2.0
#: Seconds allowed for one ``/tokenize`` call. A loopback call to vLLM takes a few
#: milliseconds (bench/tokenize.py); past this the replica is busy, and routing
#: approximately now beats a precise decision later.
DEFAULT_TOKENIZE_TIMEOUT = 0.5
#: Seconds after a routed request within which the replica is expected to report some of
#: its leading blocks. Covers prefill of a long prompt plus the agent's batching.
DEFAULT_AGREEMENT_WINDOW = 10.0
#: Consecutive routed requests whose blocks the replica did not report while it reported
#: others, before the alarm is raised (one failed request is not a disagreement).
DEFAULT_MISMATCH_ALARM_AFTER = 3


@attrs.frozen
class RoutingConfig:
    """``routing:``: how the gateway picks a replica (KV-cache aware by default)."""

    policy: str = "kv"
    load_gate_min: int = DEFAULT_LOAD_GATE_MIN
    load_gate_share: float = DEFAULT_LOAD_GATE_SHARE
    unconfirmed_ttl: float = DEFAULT_UNCONFIRMED_TTL
    tokenize_timeout: float = DEFAULT_TOKENIZE_TIMEOUT
    agreement_window: float = DEFAULT_AGREEMENT_WINDOW
    mismatch_alarm_after: int = DEFAULT_MISMATCH_ALARM_AFTER


@attrs.frozen
class ServerConfig:
    """``server.yaml``: one control plane (and its gateway)."""

    state_dir: Path = DEFAULT_SERVER_STATE_DIR
    rpc_listen: Address = Address("127.0.0.1", 7070)
    http_listen: Address = Address("127.0.0.1", 8080)
    advertise_hosts: tuple[str, ...] = ()
    store: StoreConfig = attrs.field(default=attrs.Factory(_default_store, takes_self=True))
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    node_lost_after: float = DEFAULT_NODE_LOST_AFTER
    replace_grace: float = DEFAULT_REPLACE_GRACE
    engines: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_mapping)
    log_level: str = DEFAULT_LOG_LEVEL
    gateway: GatewayConfig = GatewayConfig()
    tracing: TracingConfig = TracingConfig()
    auth: AuthConfig = AuthConfig()
    serving: ServingConfig = ServingConfig()
    routing: RoutingConfig = RoutingConfig()

    @property
    def ca_dir(self) -> Path:
        """Where the cluster CA lives on this control plane (``<state_dir>/ca``)."""
        return self.state_dir / "ca"

    @property
    def tls_dir(self) -> Path:
        """Where this control plane's own certificate lives (``<state_dir>/tls``)."""
        return self.state_dir / "tls"


@attrs.frozen
class AgentTLS:
    """The agent's mutual-TLS files: cluster CA certificate, its certificate, its key."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: Path) -> AgentTLS:
        """The files :func:`llmgw.rpc.tls.write_credentials` writes into ``directory``."""
        return cls(directory / tls.CA_CERT_FILE, directory / tls.CERT_FILE,
                   directory / tls.KEY_FILE)


def _default_agent_tls(config: AgentConfig) -> AgentTLS:
    return AgentTLS.in_dir(config.state_dir / "tls")


@attrs.frozen
class AgentConfig:
    """``agent.yaml``: the agent on one node."""

    node_id: str = attrs.field(factory=socket.gethostname)
    control_planes: tuple[Address, ...] = (Address("127.0.0.1", 7070),)
    state_dir: Path = DEFAULT_AGENT_STATE_DIR
    tls: AgentTLS = attrs.field(default=attrs.Factory(_default_agent_tls, takes_self=True))
    engine_host: str | None = None  # None: the address on the route to the control plane
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    reconnect_backoff_max: float = DEFAULT_RECONNECT_BACKOFF_MAX
    log_level: str = DEFAULT_LOG_LEVEL
    weights_dir: Path = attrs.field(default=attrs.Factory(lambda c: c.state_dir / "weights", takes_self=True))
    install_dir: Path = attrs.field(default=attrs.Factory(lambda c: c.state_dir / "engines", takes_self=True))
    cache_dir: Path = attrs.field(default=attrs.Factory(lambda c: c.state_dir / "cache", takes_self=True))
    engine_urls: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_mapping)
    pypi_index: str = ""
    hf_endpoint: str = DEFAULT_HF_ENDPOINT
    llamacpp_threads: int | None = None  # llamacpp.threads: None = half this node's CPUs


# --- value parsers (raise ValueError with the reason; the loader adds file and key) -----


def _show(value: Any) -> str:
    """A value as the operator wrote it: strings in double quotes, the rest as YAML would."""
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'
    if value is None:
        return "null (empty)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return str(value)


def parse_duration(value: Any) -> float:
    """Return seconds from a number (seconds) or a string such as ``"10s"``, ``"2m"``,
    ``"500ms"``, ``"1h"``, ``"1m30s"`` or ``"10"``. Raises :class:`ValueError` for anything
    else, for negative or infinite values."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f'expected a duration like 10, "10s", "2m" or "500ms", got {_show(value)}')
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            compact = text.replace(" ", "")
            parts = list(_DURATION_PART.finditer(compact))
            if not parts or "".join(p.group(0) for p in parts) != compact:
                raise ValueError(
                    f'expected a duration like 10, "10s", "2m" or "500ms", got {_show(value)}'
                ) from None
            seconds = sum(float(p.group(1)) * _DURATION_UNITS[p.group(2)] for p in parts)
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"expected a duration of 0 seconds or more, got {_show(value)}")
    return seconds


def _check_host(host: str) -> str:
    """Return ``host`` if it is an IP address or a DNS name; raise ValueError otherwise."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if not host or len(host) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"{_show(host)} is neither an IP address nor a host name")
    return host


def parse_address(value: Any, *, listen: bool = False) -> Address:
    """Return an :class:`Address` from ``"host:port"`` (``"[::1]:7070"`` for IPv6).

    With ``listen`` the port may be 0 (the system picks one). Raises :class:`ValueError`
    with the reason otherwise.
    """
    expected = f'expected "host:port", got {_show(value)}'
    if not isinstance(value, str):
        raise ValueError(expected)
    text = value.strip()
    bracketed = re.fullmatch(r"\[([^\]]*)\]:([^:]*)", text)
    if bracketed:
        host, port_text = bracketed.groups()
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise ValueError(f"{_show(host)} in brackets is not an IPv6 address") from None
    else:
        if ":" not in text:
            raise ValueError(expected)
        host, port_text = text.rsplit(":", 1)
        if ":" in host:
            raise ValueError(f'IPv6 addresses go in brackets, e.g. "[{host}]:{port_text}"; '
                             f"got {_show(value)}")
        if not host:
            hint = ' (use "0.0.0.0:PORT" to listen on every address)' if listen else ""
            raise ValueError(f"missing host in {_show(value)}{hint}")
        host = _check_host(host)
    if not port_text.isdigit():
        raise ValueError(f"port {_show(port_text)} is not a number, in {_show(value)}")
    port = int(port_text)
    lowest = 0 if listen else 1
    if not lowest <= port <= 65535:
        raise ValueError(f"port {port} is out of range {lowest}-65535, in {_show(value)}")
    return Address(host, port)


def _parse_str(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty string, got {_show(value)}")
    return value.strip()


def _parse_log_level(value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() in LOG_LEVELS:
        return value.strip().lower()
    raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {_show(value)}")


def _parse_node_id(value: Any) -> str:
    try:
        return tls.check_name(value)
    except ValueError as exc:
        raise ValueError(f"{exc} (node ids name the node's certificate)") from None


def _parse_host(value: Any) -> str:
    return _check_host(_parse_str(value).strip("[]"))


def _positive(parse: Callable[[Any], float]) -> Callable[[Any], float]:
    def checked(value: Any) -> float:
        seconds = parse(value)
        if seconds <= 0:
            raise ValueError(f"must be more than 0 seconds, got {_show(value)}")
        return seconds

    return checked


# --- the reader -------------------------------------------------------------------------

_MISSING: Any = object()


class _DuplicateKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""


def _construct_mapping(loader: _DuplicateKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


_DuplicateKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


class _Reader:
    """Walks the merged file + override data of one config file; every error it raises
    names the file, the key path, and (for overridden keys) that it came from an override."""

    def __init__(self, source: str, base_dir: Path, overridden: set[str]) -> None:
        self.source = source
        self.base_dir = base_dir
        self.overridden = overridden

    def error(self, path: str, reason: str) -> ConfigError:
        plain = re.sub(r"\[\d+\]", "", path)
        if any(plain == o or plain.startswith(o + ".") for o in self.overridden):
            reason += " (from an override)"
        where = f"{path}: " if path else ""
        return ConfigError(f"{self.source}: {where}{reason}")

    def section(self, data: Any, path: str) -> _Section:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise self.error(path, f"expected a mapping of keys, got {_show(data)}")
        for key in data:
            if not isinstance(key, str):
                raise self.error(path, f"keys must be strings, got {_show(key)}")
        return _Section(self, data, path)

    def path_value(self, value: Any, path: str) -> Path:
        """A path; relative ones are resolved against the config file's directory, or the
        current directory for overrides and when there is no file."""
        text = _parse_str(value) if not isinstance(value, os.PathLike) else os.fspath(value)
        path_obj = Path(text).expanduser()
        if path_obj.is_absolute():
            return path_obj
        plain = re.sub(r"\[\d+\]", "", path)
        base = Path.cwd() if plain in self.overridden else self.base_dir
        return base / path_obj


class _Section:
    def __init__(self, reader: _Reader, data: Mapping[str, Any], path: str) -> None:
        self.reader = reader
        self.data = data
        self.path = path
        self.used: set[str] = set()

    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def raw(self, key: str) -> Any:
        self.used.add(key)
        return self.data.get(key, _MISSING)

    def get(self, key: str, parse: Callable[[Any], T], default: T) -> T:
        """The parsed value of ``key``, or ``default`` when it is absent."""
        value = self.raw(key)
        if value is _MISSING:
            return default
        try:
            return parse(value)
        except ValueError as exc:
            raise self.reader.error(self.key_path(key), str(exc)) from None

    def get_list(
        self, key: str, parse: Callable[[Any], T], default: tuple[T, ...]
    ) -> tuple[T, ...]:
        value = self.raw(key)
        if value is _MISSING:
            return default
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise self.reader.error(self.key_path(key), f"expected a list, got {_show(value)}")
        items = []
        for index, item in enumerate(value):
            try:
                items.append(parse(item))
            except ValueError as exc:
                raise self.reader.error(f"{self.key_path(key)}[{index}]", str(exc)) from None
        return tuple(items)

    def get_path(self, key: str, default: Path) -> Path:
        value = self.raw(key)
        if value is _MISSING:
            return default
        try:
            return self.reader.path_value(value, self.key_path(key))
        except ValueError as exc:
            raise self.reader.error(self.key_path(key), str(exc)) from None

    def finish(self) -> None:
        """Refuse keys nobody asked for, suggesting the closest known key."""
        for key in self.data:
            if key in self.used:
                continue
            # A truncated or lengthened key ("certificate" for "cert") is as likely a slip as
            # a misspelt one, but difflib's ratio misses it when the lengths differ a lot.
            close = [k for k in sorted(self.used)
                     if key and (key.startswith(k) or k.startswith(key))]
            close = close or difflib.get_close_matches(key, sorted(self.used), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else (
                f" (known keys: {', '.join(sorted(self.used))})"
            )
            where = self.path or ""
            raise self.reader.error(where, f"unknown key {key!r}{hint}")


# --- loading ------------------------------------------------------------------------------


def _merge(base: dict[str, Any], overrides: Mapping[str, Any], prefix: str,
           overridden: set[str]) -> None:
    """Lay ``overrides`` (nested mappings and/or dotted keys) over ``base`` in place,
    recording each overridden key path in ``overridden``."""
    for raw_key, value in overrides.items():
        first, _, rest = str(raw_key).partition(".")
        full = f"{prefix}.{first}" if prefix else first
        if rest:
            value = {rest: value}
        if isinstance(value, Mapping):
            current = base.get(first)
            child = dict(current) if isinstance(current, Mapping) else {}
            _merge(child, value, full, overridden)
            base[first] = child
        else:
            base[first] = value
            overridden.add(full)


def _read_yaml(path: Path | None, default_name: str) -> tuple[str, Path, dict[str, Any]]:
    if path is None:
        return default_name, Path.cwd(), {}
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, not a file") from None
    except PermissionError:
        raise ConfigError(f"{source}: not readable by this user (uid {os.getuid()})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text ({exc.reason})") from None
    try:
        data = yaml.load(text, Loader=_DuplicateKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{source}: {where}invalid YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top, got {_show(data)}")
    return source, path.parent.absolute(), data


def _prepare(path: Path | None, overrides: Mapping[str, Any] | None,
             default_name: str) -> tuple[_Reader, _Section]:
    source, base_dir, data = _read_yaml(path, default_name)
    overridden: set[str] = set()
    merged = dict(data)
    _merge(merged, overrides or {}, "", overridden)
    reader = _Reader(source, base_dir, overridden)
    return reader, reader.section(merged, "")


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
    reader, top = _prepare(Path(path) if path is not None else None, overrides, "server.yaml")
    state_dir = top.get_path("state_dir", DEFAULT_SERVER_STATE_DIR)
    config = ServerConfig(
        state_dir=state_dir,
        rpc_listen=top.get("rpc_listen", lambda v: parse_address(v, listen=True),
                           parse_address(DEFAULT_RPC_LISTEN)),
        http_listen=top.get("http_listen", lambda v: parse_address(v, listen=True),
                            parse_address(DEFAULT_HTTP_LISTEN)),
        advertise_hosts=top.get_list("advertise_hosts", _parse_host, ()),
        store=_read_store(reader, top.raw("store"), state_dir),
        heartbeat_interval=top.get("heartbeat_interval", _positive(parse_duration),
                                   DEFAULT_HEARTBEAT_INTERVAL),
        node_lost_after=top.get("node_lost_after", _positive(parse_duration),
                                DEFAULT_NODE_LOST_AFTER),
        replace_grace=top.get("replace_grace", parse_duration, DEFAULT_REPLACE_GRACE),
        engines=_read_engines(reader, top.raw("engines")),
        log_level=top.get("log_level", _parse_log_level, DEFAULT_LOG_LEVEL),
        gateway=_read_gateway(reader, top.raw("gateway")),
        tracing=_read_tracing(reader, top.raw("tracing")),
        auth=_read_auth(reader, top.raw("auth")),
        serving=_read_serving(reader, top.raw("serving")),
        routing=_read_routing(reader, top.raw("routing")),
    )
    top.finish()
    if config.node_lost_after <= config.heartbeat_interval:
        raise reader.error(
            "node_lost_after",
            f"must be longer than heartbeat_interval ({config.node_lost_after:g}s <= "
            f"{config.heartbeat_interval:g}s), or every node is lost between two heartbeats",
        )
    return config


def _read_store(reader: _Reader, raw: Any, state_dir: Path) -> StoreConfig:
    default = StoreConfig.sqlite(state_dir / DEFAULT_SQLITE_NAME)
    if raw is _MISSING:
        return default
    section = reader.section(raw, "store")
    url = section.get("url", _parse_str, None)
    dsn = section.get("dsn", _parse_str, None)
    section.finish()
    if url is not None and dsn is not None:
        raise reader.error("store", "give url or dsn, not both")
    if dsn is not None:
        return StoreConfig("postgresql", dsn=dsn)
    if url is None:
        return default
    scheme, sep, rest = url.partition("://")
    if sep and scheme in ("postgresql", "postgres"):
        return StoreConfig("postgresql", dsn=url)
    if sep and scheme != "sqlite":
        raise reader.error(
            "store.url",
            f"unsupported scheme {scheme!r}: use a SQLite file path, sqlite:///PATH, "
            "or a postgresql:// URL",
        )
    file_text = rest if sep else url
    if not file_text:
        raise reader.error("store.url", "the SQLite URL names no file")
    file_path = Path(file_text).expanduser()
    if not file_path.is_absolute():
        file_path = state_dir / file_path
    return StoreConfig.sqlite(file_path)


def _read_gateway(reader: _Reader, raw: Any) -> GatewayConfig:
    if raw is _MISSING:
        return GatewayConfig()
    section = reader.section(raw, "gateway")
    seconds = _positive(parse_duration)
    config = GatewayConfig(
        connect_timeout=section.get("connect_timeout", seconds, DEFAULT_UPSTREAM_CONNECT_TIMEOUT),
        first_byte_timeout=section.get("first_byte_timeout", seconds, DEFAULT_UPSTREAM_FIRST_BYTE_TIMEOUT),
        chunk_timeout=section.get("chunk_timeout", seconds, DEFAULT_UPSTREAM_CHUNK_TIMEOUT),
        workers=section.get("workers", _count(1), 1),
    )
    section.finish()
    return config


def _parse_otlp_endpoint(value: Any) -> str:
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise ValueError(f"expected an http(s) URL or empty, got {_show(value)}")
    parsed = urllib.parse.urlsplit(value.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(
            f"expected the http(s) URL of an OTLP/HTTP collector, e.g. \"http://collector:4318\", "
            f"got {_show(value)}"
        )
    return value.strip()


def _parse_ratio(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"expected a number from 0 to 1, got {_show(value)}")
    return float(value)


def _read_tracing(reader: _Reader, raw: Any) -> TracingConfig:
    if raw is _MISSING:
        return TracingConfig()
    section = reader.section(raw, "tracing")
    config = TracingConfig(
        endpoint=section.get("endpoint", _parse_otlp_endpoint, ""),
        service_name=section.get("service_name", _parse_str, DEFAULT_TRACING_SERVICE_NAME),
        sample_ratio=section.get("sample_ratio", _parse_ratio, 1.0),
    )
    section.finish()
    return config


def _parse_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {_show(value)}")
    return value


def _count(minimum: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected a whole number >= {minimum}, got {_show(value)}")
        return value

    return parse


def _read_auth(reader: _Reader, raw: Any) -> AuthConfig:
    if raw is _MISSING:
        return AuthConfig()
    section = reader.section(raw, "auth")
    config = AuthConfig(enabled=section.get("enabled", _parse_bool, True))
    section.finish()
    return config


def _read_serving(reader: _Reader, raw: Any) -> ServingConfig:
    if raw is _MISSING:
        return ServingConfig()
    section = reader.section(raw, "serving")
    config = ServingConfig(
        max_request_bytes=section.get("max_request_bytes", _count(1), DEFAULT_MAX_REQUEST_BYTES),
        max_inflight_per_replica=section.get("max_inflight_per_replica", _count(1),
                                             DEFAULT_MAX_INFLIGHT_PER_REPLICA),
        queue_size=section.get("queue_size", _count(0), DEFAULT_QUEUE_SIZE),
        queue_timeout=section.get("queue_timeout", _positive(parse_duration), DEFAULT_QUEUE_TIMEOUT),
        usage_flush_interval=section.get("usage_flush_interval", _positive(parse_duration),
                                         DEFAULT_USAGE_FLUSH_INTERVAL),
    )
    section.finish()
    return config


def _parse_policy(value: Any) -> str:
    if value not in ROUTING_POLICIES:
        raise ValueError(f"expected one of {', '.join(ROUTING_POLICIES)}, got {_show(value)}")
    return str(value)


def _read_routing(reader: _Reader, raw: Any) -> RoutingConfig:
    if raw is _MISSING:
        return RoutingConfig()
    section = reader.section(raw, "routing")
    seconds = _positive(parse_duration)
    config = RoutingConfig(
        policy=section.get("policy", _parse_policy, "kv"),
        load_gate_min=section.get("load_gate_min", _count(0), DEFAULT_LOAD_GATE_MIN),
        load_gate_share=section.get("load_gate_share", _parse_ratio, DEFAULT_LOAD_GATE_SHARE),
        unconfirmed_ttl=section.get("unconfirmed_ttl", seconds, DEFAULT_UNCONFIRMED_TTL),
        tokenize_timeout=section.get("tokenize_timeout", seconds, DEFAULT_TOKENIZE_TIMEOUT),
        agreement_window=section.get("agreement_window", seconds, DEFAULT_AGREEMENT_WINDOW),
        mismatch_alarm_after=section.get("mismatch_alarm_after", _count(1), DEFAULT_MISMATCH_ALARM_AFTER),
    )
    section.finish()
    return config


def _read_engines(reader: _Reader, raw: Any) -> dict[str, str]:
    if raw is _MISSING:
        return {}
    section = reader.section(raw, "engines")
    engines: dict[str, str] = {}
    for name in list(section.data):
        if not _ENGINE_NAME.fullmatch(name):
            raise reader.error(
                f"engines.{name}",
                "engine names are lower-case letters, digits, '.', '_' and '-'",
            )
        value = section.raw(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise reader.error(
                f"engines.{name}",
                f"expected a version string, got the number {value} (YAML reads an unquoted "
                f'version as a number, 0.10 as 0.1): quote it, e.g. {name}: "0.10.2"',
            )
        try:
            engines[name] = _parse_str(value)
        except ValueError as exc:
            raise reader.error(f"engines.{name}", f"version: {exc}") from None
    return engines


def load_agent_config(
    path: Path | str | None = None, overrides: Mapping[str, Any] | None = None
) -> AgentConfig:
    """Read ``agent.yaml`` at ``path`` (``None``: no file, all defaults), apply
    ``overrides`` over it (as for :func:`load_server_config`), and return the validated
    :class:`AgentConfig`. The TLS files default to ``<state_dir>/tls/``.

    Raises :class:`ConfigError` naming the file, key path and reason, including when the
    default node id (the host name) cannot name a certificate.
    """
    reader, top = _prepare(Path(path) if path is not None else None, overrides, "agent.yaml")
    state_dir = top.get_path("state_dir", DEFAULT_AGENT_STATE_DIR)
    node_id = top.get("node_id", _parse_node_id, _MISSING)
    if node_id is _MISSING:
        hostname = socket.gethostname()
        try:
            node_id = _parse_node_id(hostname)
        except ValueError as exc:
            raise reader.error("node_id", f"the host name cannot be the default: {exc}; "
                                          "set node_id") from None
    control_planes = top.get_list("control_planes", parse_address,
                                  (parse_address(DEFAULT_RPC_LISTEN),))
    if not control_planes:
        raise reader.error("control_planes", 'at least one "host:port" is needed')
    config = AgentConfig(
        node_id=node_id,
        control_planes=control_planes,
        state_dir=state_dir,
        tls=_read_agent_tls(reader, top.raw("tls"), state_dir),
        engine_host=top.get("engine_host", _parse_host, None),
        heartbeat_interval=top.get("heartbeat_interval", _positive(parse_duration),
                                   DEFAULT_HEARTBEAT_INTERVAL),
        reconnect_backoff_max=top.get("reconnect_backoff_max", _positive(parse_duration),
                                      DEFAULT_RECONNECT_BACKOFF_MAX),
        log_level=top.get("log_level", _parse_log_level, DEFAULT_LOG_LEVEL),
        weights_dir=top.get_path("weights_dir", state_dir / "weights"),
        install_dir=top.get_path("install_dir", state_dir / "engines"),
        cache_dir=top.get_path("cache_dir", state_dir / "cache"),
        engine_urls=_read_engine_urls(reader, top.raw("engine_urls")),
        pypi_index=top.get("pypi_index", _parse_url_or_empty, ""),
        hf_endpoint=top.get("hf_endpoint", _parse_url_or_empty, DEFAULT_HF_ENDPOINT) or DEFAULT_HF_ENDPOINT,
        llamacpp_threads=_read_llamacpp_threads(reader, top.raw("llamacpp")),
    )
    top.finish()
    return config


def _parse_url_or_empty(value: Any) -> str:
    text = _parse_str(value) if value not in (None, "") else ""
    if text and not text.startswith(("http://", "https://")):
        raise ValueError(f"expected an http(s) URL, got {_show(value)}")
    return text.rstrip("/")


def _read_llamacpp_threads(reader: _Reader, raw: Any) -> int | None:
    """``llamacpp.threads``: threads of this node's CPU llama.cpp replicas (a profile's cpu_cores wins)."""
    if raw is _MISSING:
        return None
    section = reader.section(raw, "llamacpp")
    value = section.raw("threads") if "threads" in section.data else None
    for key in section.data:
        if key != "threads":
            raise reader.error(f"llamacpp.{key}", "unknown key (known keys: threads)")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise reader.error("llamacpp.threads", f"expected a whole number >= 1, got {_show(value)}")
    return value


def _read_engine_urls(reader: _Reader, raw: Any) -> dict[str, str]:
    """``engine_urls``: engine name -> download URL template (a mirror for air-gapped sites)."""
    if raw is _MISSING:
        return {}
    section = reader.section(raw, "engine_urls")
    urls: dict[str, str] = {}
    for name in list(section.data):
        if not _ENGINE_NAME.fullmatch(name):
            raise reader.error(f"engine_urls.{name}", "engine names are lower-case letters, digits, '.', '_' and '-'")
        try:
            urls[name] = _parse_url_or_empty(section.raw(name))
        except ValueError as exc:
            raise reader.error(f"engine_urls.{name}", str(exc)) from None
    return urls


def _read_agent_tls(reader: _Reader, raw: Any, state_dir: Path) -> AgentTLS:
    default = AgentTLS.in_dir(state_dir / "tls")
    if raw is _MISSING:
        return default
    section = reader.section(raw, "tls")
    result = AgentTLS(
        ca=section.get_path("ca", default.ca),
        cert=section.get_path("cert", default.cert),
        key=section.get_path("key", default.key),
    )
    section.finish()
    return result
