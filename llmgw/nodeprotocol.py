"""What an agent and a control plane agree on before a session: the node protocol and features.

An agent's registration lists its features (``Registration.features``): ``protocol:N`` (the
node protocol it speaks: the schema's Agent, NodeDesk and ShardReporter as this release uses
them) and the calls it gained since (:data:`AGENT_FEATURES`). A control plane refuses an
agent of another protocol, naming both releases (:func:`refusal`), and asks an agent only
for what its features say it can do. An agent that names no protocol predates the marker:
protocol 1, which every release so far speaks.
"""

from __future__ import annotations

from typing import Iterable

#: The node protocol this release speaks.
NODE_PROTOCOL = 1
#: The protocols this release's control plane can drive (older agents keep working across an upgrade).
SUPPORTED_PROTOCOLS = frozenset({1})
#: A feature naming one call an agent answers, beyond its protocol's baseline.
LOGS = "logs"  # Agent.logs: `llmgw ctl logs NODE`
UPGRADE = "upgrade"  # Agent.receiveRelease, upgrade, rollback: `llmgw ctl upgrade`
FIREWALL = "firewall"  # Agent.firewall: the cluster setting firewall (an agent managing its nft table)
TRAINING = "training"  # Agent.startJob: LoRA training jobs (`llmgw ctl jobs train`)
#: What this release's agent says it can do (an agent that leaves its firewall to the operator
#: leaves out FIREWALL).
AGENT_FEATURES = (f"protocol:{NODE_PROTOCOL}", "adopt", "stop-grace", LOGS, UPGRADE, FIREWALL, TRAINING)


def protocol_of(features: Iterable[str]) -> int:
    """Returns the node protocol ``features`` name (1 where none is named; 0 for a malformed one)."""
    for feature in features:
        if feature.startswith("protocol:"):
            try:
                return int(feature.removeprefix("protocol:"))
            except ValueError:
                return 0
    return 1


def refusal(node_id: str, version: str, features: Iterable[str], ours: str) -> str | None:
    """Returns why a control plane of release ``ours`` cannot drive the agent of ``node_id``
    (release ``version``, ``features``), or None when it can."""
    protocol = protocol_of(features)
    if protocol in SUPPORTED_PROTOCOLS:
        return None
    newer = protocol > max(SUPPORTED_PROTOCOLS)
    fix = (f"upgrade the control planes to llmgw {version} or later" if newer
           else f"upgrade llmgw on {node_id} to {ours}")
    return (f"node {node_id} runs llmgw {version or '(unknown)'}, whose node protocol {protocol} this control plane "
            f"(llmgw {ours}, protocol {', '.join(map(str, sorted(SUPPORTED_PROTOCOLS)))}) cannot speak: {fix}")
