"""The OpenAI-compatible gateway: replica table, routing policy, upstream client, HTTP app.

Typical use inside the server's nursery::

    table = ReplicaTable()
    app = create_app(table)
    port = await nursery.start(serve_gateway, app, "0.0.0.0", 8080)
    table.set_model_replicas("llama", [Replica("s1", "llama", "http://10.0.0.5:9000", "node-a")])
"""

from .app import Gateway, create_app, gateway_of
from .errors import GatewayError
from .replicas import (
    CatalogModel,
    LeastOutstanding,
    Lease,
    LoadTracker,
    Replica,
    ReplicaTable,
    RequestInfo,
    RoutingPolicy,
)
from .http.serve import serve_gateway
from .http.upstream import UpstreamClient, UpstreamTimeouts

__all__ = [
    "CatalogModel",
    "Gateway",
    "GatewayError",
    "LeastOutstanding",
    "Lease",
    "LoadTracker",
    "Replica",
    "ReplicaTable",
    "RequestInfo",
    "RoutingPolicy",
    "UpstreamClient",
    "UpstreamTimeouts",
    "create_app",
    "gateway_of",
    "serve_gateway",
]
