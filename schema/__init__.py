"""The Cap'n Proto schemas, installed as the package ``llmgw.schema`` (see setup.py).

Only data lives here: :mod:`llmgw.rpc.schema` loads ``llmgw.capnp`` from this
package with :mod:`importlib.resources`.
"""
