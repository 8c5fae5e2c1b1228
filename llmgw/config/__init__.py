"""``server.yaml`` and ``agent.yaml``: loading, validation and defaults.

:func:`load_server_config` and :func:`load_agent_config` read a YAML file (or nothing),
lay the caller's overrides (command-line options, ``llmgw up``) over it, check every key,
and return a frozen attrs object. Anything wrong is a :class:`ConfigError` whose message
starts with the file and the key's path, then the reason::

    agent.yaml: control_planes[1]: expected "host:port", got "x"
    server.yaml: store: unknown key 'dns' (did you mean 'dsn'?)

An empty or absent file gives a working configuration: every key has a default, defined
once in :mod:`llmgw.config.defaults` (which parts that run without a file import too).
``docs/config.md`` is the reference of every key.

The modules: :mod:`.defaults` (every default and its reason), :mod:`.values` (value types
and parsers), :mod:`.yaml_reader` (the file, overrides, key checking), :mod:`.sections`
(the gateway's sections of server.yaml), :mod:`.server` and :mod:`.agent` (one per file).
This package is neutral: it imports no other part of llmgw but :mod:`llmgw.credentials`.
Reading is blocking file I/O of a small file, done once at start-up.
"""

from __future__ import annotations

from .agent import AgentConfig, AgentTLS, load_agent_config
from .errors import ConfigError
from .sections import ROUTING_POLICIES, AuthConfig, GatewayConfig, RoutingConfig, ServingConfig, TracingConfig
from .server import ServerConfig, StoreConfig, load_server_config
from .values import LOG_LEVELS, Address, parse_address, parse_duration

__all__ = [
    "LOG_LEVELS",
    "ROUTING_POLICIES",
    "Address",
    "AgentConfig",
    "AgentTLS",
    "AuthConfig",
    "ConfigError",
    "GatewayConfig",
    "RoutingConfig",
    "ServerConfig",
    "ServingConfig",
    "StoreConfig",
    "TracingConfig",
    "load_agent_config",
    "load_server_config",
    "parse_address",
    "parse_duration",
]
