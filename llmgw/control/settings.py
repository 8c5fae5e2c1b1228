"""Cluster settings: which keys exist, what values they take, and how a dotted key edits one.

Settings live in the store, one row per key with every version kept (``ctl config``).
The keys are:

* ``serving.stopped`` (bool): ``llmgw ctl stop``/``start``;
* ``routing`` (a mapping): server.yaml's ``routing:`` keys, over every control plane's own
  server.yaml, applied live by every gateway (``routing.policy`` switches the policy);
* ``agents.default`` (a mapping): what every agent.yaml can say, for every node;
* ``agents.nodes.<node id>`` (a mapping): the same for one node, over ``agents.default``;
* ``firewall`` (a mapping): ``enabled`` (default true) and ``networks`` (addresses and CIDR
  networks): llmgw's nft table on every node and control plane (docs/operations.md, Firewall).

An agent mapping may hold anything agent.yaml can say except what names the node and how it
is reached: :data:`AGENT_KEYS_REFUSED`. It is checked by loading it as agent.yaml overrides,
so a bad value is refused with its key path and the reason, before anything is stored.

A dotted key below a mapping's key edits one entry of it: ``routing.policy`` sets ``policy``
in ``routing``, ``agents.default.log_level`` sets ``log_level`` in ``agents.default``;
``agents.nodes.gpu-7.engines.vllm.python`` a nested one. :func:`edit` returns the whole new
value of the stored key.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import attrs

from llmgw.config import ConfigError, RoutingConfig, load_agent_config
from llmgw.config.sections import RETIRED_ROUTING_KEYS, read_routing
from llmgw.config.values import parse_node_id
from llmgw.config.yaml_reader import Reader
from llmgw.nftables import check_firewall_setting

SERVING_STOPPED = "serving.stopped"
ROUTING = "routing"
FIREWALL = "firewall"
#: The settings every gateway applies (through AccessSync), not the agents.
GATEWAY_SETTINGS = (SERVING_STOPPED, ROUTING)
AGENTS_DEFAULT = "agents.default"
AGENTS_NODES = "agents.nodes."
#: What only the node's own agent.yaml may say: its identity, where its control planes and
#: certificate are, the address its engines are reached at, and where its state lives
#: (the settings themselves are kept there).
AGENT_KEYS_REFUSED = ("node_id", "control_planes", "engine_host", "tls", "state_dir")
#: The node id agent mappings are checked under (any valid one would do).
_CHECK_NODE_ID = "settings-check"


class SettingError(ValueError):
    """A key that does not exist, or a value it cannot take; the message names the key path."""


@attrs.frozen
class SettingKey:
    """A key as given: the stored key it belongs to and the path below it ("" path: the whole)."""

    stored: str
    path: tuple[str, ...] = ()

    def __str__(self) -> str:
        return ".".join((self.stored, *self.path))


def parse_key(key: str) -> SettingKey:
    """Returns where ``key`` lives; raises SettingError for a key that does not exist."""
    if key == SERVING_STOPPED:
        return SettingKey(SERVING_STOPPED)
    for mapping in (ROUTING, FIREWALL, AGENTS_DEFAULT):
        if key == mapping or key.startswith(mapping + "."):
            return SettingKey(mapping, _path(key, key[len(mapping) + 1:]))
    if key.startswith(AGENTS_NODES):
        node, _, rest = key[len(AGENTS_NODES):].partition(".")
        try:
            parse_node_id(node)
        except ValueError as exc:
            raise SettingError(f"{key}: not a node id: {exc}") from None
        return SettingKey(AGENTS_NODES + node, _path(key, rest))
    raise SettingError(
        f"unknown setting {key!r}: the settings are {SERVING_STOPPED}, {ROUTING}[.KEY], {FIREWALL}[.KEY], "
        f"{AGENTS_DEFAULT}[.KEY...] and "
        f"{AGENTS_NODES}NODE_ID[.KEY...]"
    )


def _path(key: str, rest: str) -> tuple[str, ...]:
    parts = tuple(rest.split(".")) if rest else ()
    if any(not p for p in parts):
        raise SettingError(f"{key}: empty part in the key")
    return parts


def edit(current: Any, key: SettingKey, value: Any, *, unset: bool = False) -> Any:
    """Returns the stored key's new value after setting ``value`` at ``key``'s path (or
    removing what is there, with ``unset``; None: nothing is left), checked (SettingError)."""
    if not key.path:
        new = None if unset else value
    else:
        new = copy.deepcopy(current) if isinstance(current, dict) else {}
        node = new
        for part in key.path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                if unset:
                    raise SettingError(f"{key}: is not set")
                child = node[part] = {}
            node = child
        if unset:
            if key.path[-1] not in node:
                raise SettingError(f"{key}: is not set")
            del node[key.path[-1]]
            _prune(new)
        else:
            node[key.path[-1]] = value
        new = new or None
    if new is not None:
        check(key.stored, new)
    return new


def _prune(mapping: dict[str, Any]) -> None:
    """Drops the mappings an unset left empty, at every depth."""
    for name in list(mapping):
        if isinstance(mapping[name], dict):
            _prune(mapping[name])
            if not mapping[name]:
                del mapping[name]


def check(stored: str, value: Any) -> None:
    """Raises SettingError unless ``value`` may be stored at ``stored`` (a stored key)."""
    if stored == SERVING_STOPPED:
        if not isinstance(value, bool):
            raise SettingError(f"{SERVING_STOPPED}: expected true or false, got {value!r}")
        return
    if stored == ROUTING:
        routing_overrides(value)
        return
    if stored == FIREWALL:
        try:
            check_firewall_setting(value)
        except ValueError as exc:
            raise SettingError(str(exc)) from None
        return
    if not isinstance(value, dict):
        raise SettingError(f"{stored}: expected a mapping of agent.yaml keys, got {value!r}")
    refused = [k for k in AGENT_KEYS_REFUSED if k in value]
    if refused:
        raise SettingError(
            f"{stored}.{refused[0]}: only the node's own agent.yaml may set it (cluster settings cannot say "
            f"{', '.join(AGENT_KEYS_REFUSED)})"
        )
    try:
        load_agent_config(None, overrides={**value, "node_id": _CHECK_NODE_ID})
    except ConfigError as exc:
        raise SettingError(_reworded(str(exc), stored)) from None


def routing_overrides(value: Any) -> dict[str, Any]:
    """Returns the stored ``routing`` setting as :class:`~llmgw.config.RoutingConfig` field
    values (durations in seconds), only the keys it names; raises SettingError naming the key
    and the reason for a value server.yaml's ``routing:`` would refuse, or a retired key."""
    if not isinstance(value, dict):
        raise SettingError(f"{ROUTING}: expected a mapping of server.yaml routing: keys, got {value!r}")
    retired = [k for k in RETIRED_ROUTING_KEYS if k in value]
    if retired:
        raise SettingError(f"{ROUTING}.{retired[0]}: no longer used (the gateway prices each replica by its "
                           "predicted time to first token; docs/gateway.md)")
    try:
        parsed = read_routing(Reader("cluster setting", Path("."), set()), value)
    except ConfigError as exc:
        raise SettingError(str(exc).removeprefix("cluster setting: ")) from None
    fields = attrs.fields_dict(RoutingConfig)
    return {name: getattr(parsed, name) for name in value if name in fields}


def _reworded(message: str, stored: str) -> str:
    """The agent loader's message about overrides, as one about the setting ``stored``."""
    message = message.removesuffix(" (from an override)")
    head, sep, rest = message.partition(": ")
    if sep and head == "agent.yaml":
        message = rest
    if message.startswith("unknown key "):
        return f"{stored}: {message}"
    return f"{stored}.{message}"


def agent_layer(settings: dict[str, Any], node_id: str) -> dict[str, Any]:
    """Returns the cluster's agent settings for ``node_id``: ``agents.default`` with
    ``agents.nodes.<node_id>`` over it (nested mappings merged), from the stored values."""
    merged: dict[str, Any] = {}
    for layer in (settings.get(AGENTS_DEFAULT), settings.get(AGENTS_NODES + node_id)):
        if isinstance(layer, dict):
            _merge(merged, layer)
    return merged


def _merge(into: dict[str, Any], layer: dict[str, Any]) -> None:
    for name, value in layer.items():
        if isinstance(value, dict) and isinstance(into.get(name), dict):
            _merge(into[name], value)
        else:
            into[name] = copy.deepcopy(value)

