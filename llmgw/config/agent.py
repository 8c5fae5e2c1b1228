"""``agent.yaml``: the agent on one node.

:func:`load_agent_config` reads the file, lays overrides over it, checks every key and
returns a frozen :class:`AgentConfig`.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any, Mapping

import attrs

from llmgw.credentials import CA_CERT_FILE, CERT_FILE, KEY_FILE
from llmgw.labels import check_labels

from . import defaults
from .values import (
    ENGINE_NAME, ENGINE_NAME_RULE, Address, frozen_mapping, parse_address, parse_duration, parse_host, parse_log_level,
    parse_bool, parse_node_id, parse_url_or_empty, positive, show,
)
from .yaml_reader import MISSING, Reader, open_config

__all__ = ["ENGINE_PATH_KEYS", "AgentConfig", "AgentTLS", "load_agent_config"]

#: agent.yaml ``engines.<engine>.<key>``: the one path an operator names per engine, and what it is.
#: vLLM and SGLang are Python packages (the interpreter of their environment is named);
#: llama.cpp is one binary (llama-server).
ENGINE_PATH_KEYS: Mapping[str, tuple[str, str]] = {
    "llama.cpp": ("server", "the llama-server binary"),
    "sglang": ("python", "the Python interpreter of an environment where sglang imports"),
    "vllm": ("python", "the Python interpreter of an environment where vllm imports"),
}
#: Other spellings of an engine under ``engines:``: "llamacpp" (as in ``llamacpp.threads``) is
#: also the only one an override (``--set engines.llamacpp.server=...``) can write, since
#: overrides split keys at dots.
ENGINE_ALIASES: Mapping[str, str] = {"llamacpp": "llama.cpp"}
#: What ``disabled_engines`` may name: every engine an agent installs or runs.
RUNNABLE_ENGINES = frozenset({*ENGINE_PATH_KEYS, "sim"})

#: The control plane on this machine (``llmgw up``, a single-machine install).
_CONTROL_PLANE = Address(defaults.DEFAULT_LISTEN_HOST, defaults.DEFAULT_RPC_PORT)


@attrs.frozen
class AgentTLS:
    """The agent's mutual-TLS files: cluster CA certificate, its certificate, its key."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: Path) -> AgentTLS:
        """The files :func:`llmgw.rpc.tls.write_credentials` writes into ``directory``."""
        return cls(directory / CA_CERT_FILE, directory / CERT_FILE, directory / KEY_FILE)


def _default_agent_tls(config: AgentConfig) -> AgentTLS:
    return AgentTLS.in_dir(config.state_dir / "tls")


@attrs.frozen
class AgentConfig:
    """``agent.yaml``: the agent on one node."""

    node_id: str = attrs.field(factory=socket.gethostname)
    control_planes: tuple[Address, ...] = (_CONTROL_PLANE,)
    state_dir: Path = defaults.DEFAULT_AGENT_STATE_DIR
    tls: AgentTLS = attrs.field(default=attrs.Factory(_default_agent_tls, takes_self=True))
    engine_host: str | None = None  # None: the address on the route to the control plane
    heartbeat_interval: float = defaults.DEFAULT_HEARTBEAT_INTERVAL
    reconnect_backoff_max: float = defaults.DEFAULT_RECONNECT_BACKOFF_MAX
    log_level: str = defaults.DEFAULT_LOG_LEVEL
    weights_dir: Path = attrs.field(default=attrs.Factory(lambda c: c.state_dir / "weights", takes_self=True))
    install_dir: Path = attrs.field(default=attrs.Factory(lambda c: c.state_dir / "engines", takes_self=True))
    cache_dir: Path = attrs.field(default=attrs.Factory(lambda c: c.state_dir / "cache", takes_self=True))
    engine_urls: Mapping[str, str] = attrs.field(factory=dict, converter=frozen_mapping)
    pypi_index: str = ""
    hf_endpoint: str = defaults.DEFAULT_HF_ENDPOINT
    llamacpp_threads: int | None = None  # llamacpp.threads: None = half this node's CPUs
    #: ``engines.<engine>.<python|server>``: engine name -> the path the operator named; it wins
    #: over any installed engine (and is never replaced by one).
    engine_paths: Mapping[str, Path] = attrs.field(factory=dict, converter=frozen_mapping)
    #: Whether the agent keeps llmgw's nft table on this node (docs/operations.md, Firewall);
    #: false leaves the node's firewall to the operator.
    firewall: bool = True
    #: ``labels``: what profiles' ``node_labels`` select this node by (``ctl nodes add --labels``).
    labels: Mapping[str, str] = attrs.field(factory=dict, converter=frozen_mapping)
    #: ``disabled_engines``: engines this node never installs or runs (``ctl nodes add --disable-engine``).
    disabled_engines: frozenset[str] = frozenset()
    #: ``engine_user``: who engines run as (llmgw/node/engine_user.py); None = the default
    #: (``llmgw-engine`` for an agent running as root), "" = the agent's own user.
    engine_user: str | None = None


def load_agent_config(
    path: Path | str | None = None, overrides: Mapping[str, Any] | None = None
) -> AgentConfig:
    """Read ``agent.yaml`` at ``path`` (``None``: no file, all defaults), apply
    ``overrides`` over it (as for :func:`~llmgw.config.load_server_config`), and return the
    validated :class:`AgentConfig`. The TLS files default to ``<state_dir>/tls/``.

    Raises :class:`ConfigError` naming the file, key path and reason, including when the
    default node id (the host name) cannot name a certificate.
    """
    reader, top = open_config(path, overrides, "agent.yaml")
    state_dir = top.get_path("state_dir", defaults.DEFAULT_AGENT_STATE_DIR)
    node_id = top.get("node_id", parse_node_id, MISSING)
    if node_id is MISSING:
        hostname = socket.gethostname()
        try:
            node_id = parse_node_id(hostname)
        except ValueError as exc:
            raise reader.error("node_id", f"the host name cannot be the default: {exc}; "
                                          "set node_id") from None
    control_planes = top.get_list("control_planes", parse_address, (_CONTROL_PLANE,))
    if not control_planes:
        raise reader.error("control_planes", 'at least one "host:port" is needed')
    config = AgentConfig(
        node_id=node_id,
        control_planes=control_planes,
        state_dir=state_dir,
        tls=_read_agent_tls(reader, top.raw("tls"), state_dir),
        engine_host=top.get("engine_host", parse_host, None),
        heartbeat_interval=top.get("heartbeat_interval", positive(parse_duration),
                                   defaults.DEFAULT_HEARTBEAT_INTERVAL),
        reconnect_backoff_max=top.get("reconnect_backoff_max", positive(parse_duration),
                                      defaults.DEFAULT_RECONNECT_BACKOFF_MAX),
        log_level=top.get("log_level", parse_log_level, defaults.DEFAULT_LOG_LEVEL),
        firewall=top.get("firewall", parse_bool, True),
        weights_dir=top.get_path("weights_dir", state_dir / "weights"),
        install_dir=top.get_path("install_dir", state_dir / "engines"),
        cache_dir=top.get_path("cache_dir", state_dir / "cache"),
        # engine name -> download URL template (a mirror for air-gapped sites)
        engine_urls=reader.named_values(top.raw("engine_urls"), "engine_urls", ENGINE_NAME, ENGINE_NAME_RULE,
                                        lambda _name, value: parse_url_or_empty(value)),
        pypi_index=top.get("pypi_index", parse_url_or_empty, ""),
        hf_endpoint=(top.get("hf_endpoint", parse_url_or_empty, defaults.DEFAULT_HF_ENDPOINT)
                     or defaults.DEFAULT_HF_ENDPOINT),
        llamacpp_threads=_read_llamacpp_threads(reader, top.raw("llamacpp")),
        engine_paths=_read_engine_paths(reader, top.raw("engines")),
        labels=top.get("labels", check_labels, {}),
        disabled_engines=frozenset(top.get_list("disabled_engines", parse_engine_name, ())),
        engine_user=top.get("engine_user", parse_user_name, None),
    )
    top.finish()
    return config


#: A user name as useradd takes it (or "": the agent's own user).
_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


def parse_user_name(value: Any) -> str:
    """Returns the user name ``value`` (``engine_user``); "" is the agent's own user. Raises ValueError otherwise."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not _USER_NAME.fullmatch(value):
        raise ValueError(f"{show(value)} is not a user name (lower-case letters, digits, '_' and '-'), "
                         'or "" for the agent\'s own user')
    return value


def parse_engine_name(value: Any) -> str:
    """Returns the engine ``value`` names (``llamacpp`` spelt ``llama.cpp``); raises ValueError for
    one llmgw does not run."""
    name = ENGINE_ALIASES.get(str(value), str(value))
    if not isinstance(value, str) or name not in RUNNABLE_ENGINES:
        raise ValueError(f"{show(value)} is not an engine llmgw runs (one of: {', '.join(sorted(RUNNABLE_ENGINES))})")
    return name


def _read_llamacpp_threads(reader: Reader, raw: Any) -> int | None:
    """``llamacpp.threads``: threads of this node's CPU llama.cpp replicas (a profile's cpu_cores wins)."""
    if raw is MISSING:
        return None
    section = reader.section(raw, "llamacpp")
    value = section.raw("threads") if "threads" in section.data else None
    for key in section.data:
        if key != "threads":
            raise reader.error(f"llamacpp.{key}", "unknown key (known keys: threads)")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise reader.error("llamacpp.threads", f"expected a whole number >= 1, got {show(value)}")
    return value


def _read_engine_paths(reader: Reader, raw: Any) -> dict[str, Path]:
    """``engines:``: per engine, the path the operator installed it at (see :data:`ENGINE_PATH_KEYS`).

    Returns ``{engine: path}`` (relative paths resolved against agent.yaml's directory).
    Raises ConfigError naming the key for an unknown engine, an unknown or missing key, or a
    value that is not a path. Whether the path runs is the agent's check, reported per node.
    """
    if raw is MISSING:
        return {}
    section = reader.section(raw, "engines")
    known = ", ".join(sorted(ENGINE_PATH_KEYS))
    paths: dict[str, Path] = {}
    for engine in list(section.data):
        where = section.key_path(engine)
        name = ENGINE_ALIASES.get(engine, engine)
        if name not in ENGINE_PATH_KEYS:
            raise reader.error(where, f"unknown engine {engine!r} (engines named here: {known})")
        if name in paths:
            raise reader.error(where, f"{name} is named twice (as {name!r} and {engine!r}); keep one")
        key, what = ENGINE_PATH_KEYS[name]
        entry = reader.section(section.raw(engine), where)
        value = entry.raw(key)
        entry.finish()  # a misspelt key is named as such, before "missing"
        if value is MISSING or value is None or value == "":
            raise reader.error(f"{where}.{key}", f"missing: name {what}, or remove {where}")
        paths[name] = entry.get_path(key, Path())
    return paths


def _read_agent_tls(reader: Reader, raw: Any, state_dir: Path) -> AgentTLS:
    default = AgentTLS.in_dir(state_dir / "tls")
    if raw is MISSING:
        return default
    section = reader.section(raw, "tls")
    result = AgentTLS(
        ca=section.get_path("ca", default.ca),
        cert=section.get_path("cert", default.cert),
        key=section.get_path("key", default.key),
    )
    section.finish()
    return result
