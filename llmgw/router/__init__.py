"""The OpenAI-compatible gateway: replica table, routing policy, upstream client, HTTP app.

Typical use inside the server's nursery::

    table = ReplicaTable()
    app = create_app(table)
    port = await nursery.start(serve_gateway, app, "0.0.0.0", 8080)
    table.set_model_replicas("llama", [Replica("s1", "llama", "http://10.0.0.5:9000", "node-a")])

The names below are loaded on first use (PEP 562), so importing one light submodule, such
as :mod:`llmgw.router.interface` from the control plane, does not load Quart, Hypercorn
and the whole gateway.
"""

from __future__ import annotations

from llmgw.lazy import lazy_exports

#: Public name -> the submodule that defines it.
_EXPORTS = {
    "Gateway": "app",
    "create_app": "app",
    "gateway_of": "app",
    "GatewayError": "errors",
    "CatalogModel": "replicas",
    "LeastOutstanding": "replicas",
    "Lease": "replicas",
    "LoadTracker": "replicas",
    "Replica": "replicas",
    "ReplicaTable": "replicas",
    "RequestInfo": "replicas",
    "RoutingPolicy": "replicas",
    "serve_gateway": "http.serve",
    "UpstreamClient": "http.upstream",
    "UpstreamTimeouts": "http.upstream",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
