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
(the gateway's sections of server.yaml), :mod:`.server` and :mod:`.agent` (one per file),
:mod:`.dsn` (which backend a store location names; DSNs and messages without passwords).
This package is neutral: it imports no other part of llmgw but :mod:`llmgw.credentials`.
Reading is blocking file I/O of a small file, done once at start-up. The names below load
on first use (PEP 562), so a part that needs only :mod:`.defaults` does not load YAML and
every section.
"""

from __future__ import annotations

from llmgw.lazy import lazy_exports

#: Public name -> the module that defines it.
_EXPORTS = {
    "AgentConfig": "agent",
    "AgentTLS": "agent",
    "load_agent_config": "agent",
    "ConfigError": "errors",
    "ROUTING_POLICIES": "sections",
    "AuthConfig": "sections",
    "GatewayConfig": "sections",
    "MetricsConfig": "sections",
    "RoutingConfig": "sections",
    "ServingConfig": "sections",
    "TracingConfig": "sections",
    "ServerConfig": "server",
    "StoreConfig": "server",
    "load_server_config": "server",
    "LOG_LEVELS": "values",
    "Address": "values",
    "parse_address": "values",
    "parse_duration": "values",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
