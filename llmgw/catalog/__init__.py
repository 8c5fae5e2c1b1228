"""What every part of llmgw agrees on about the catalog, as plain rules: no I/O, no imports
of the control plane, the node, the router or the RPC layer (any of them may import this).

- :mod:`llmgw.catalog.models`: model validation (:func:`validate_model`) and the namespace
  rule (:func:`namespace_conflict`); :func:`model_to_dict` is the inverse (from
  :mod:`llmgw.spec`, which the RPC layer shares);
- :mod:`llmgw.catalog.sources`: what a weights ``source`` names (:func:`parse_source`);
- :mod:`llmgw.catalog.engine_options`: which engine arguments and environment variables a
  profile may set (checked when a model is added, and again by the node before start);
- :mod:`llmgw.catalog.access`: tenant validation and the API key format.
- :mod:`llmgw.catalog.fingerprint`: the fingerprint of a model definition, which each shard
  carries so a rollout knows which replicas run an older one.
"""

from llmgw.catalog.access import AccessError, TenantSpec, check_key_name, generate_key, validate_tenant
from llmgw.catalog.models import KNOWN_ENGINES, CatalogError, check_engine_args, namespace_conflict, validate_model
from llmgw.catalog.sources import SourceError, WeightsSource, is_remote, parse_source
from llmgw.spec import model_to_dict

__all__ = [
    "KNOWN_ENGINES",
    "AccessError",
    "CatalogError",
    "SourceError",
    "TenantSpec",
    "WeightsSource",
    "check_engine_args",
    "check_key_name",
    "generate_key",
    "is_remote",
    "model_to_dict",
    "namespace_conflict",
    "parse_source",
    "validate_model",
    "validate_tenant",
]
