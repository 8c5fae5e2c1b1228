"""How a shard's secret (``ShardSpec.api_key``) reaches its engine, and the agent's own calls to it.

The control plane mints the secret when it places the shard; the gateway sends it as a Bearer
token on every request, so an engine answers nobody else even where its port is reachable.
The agent hands it over in the engine's environment (:func:`secret_env`), never on the command
line: ``/proc/PID/cmdline`` is readable by every local user, ``/proc/PID/environ`` only by the
engine's own user and root. The variable is the engine's own (see
:data:`llmgw.catalog.engine_options.API_KEY_ENV`), or for SGLang, which takes its key only on
its command line, llmgw's launcher's (``llmgw_sglang_launch``, which moves it to SGLang's argv
inside the process; see :mod:`llmgw.node.engines.sglang`).
"""

from __future__ import annotations

from llmgw.catalog.engine_options import API_KEY_ENV
from llmgw.spec import ShardSpec

__all__ = ["auth_headers", "secret_env"]


def secret_env(spec: ShardSpec) -> dict[str, str]:
    """Returns the variable that gives ``spec``'s engine its secret ({} without a secret, or for
    an engine that cannot read one from its environment)."""
    name = API_KEY_ENV.get(spec.engine)
    return {name: spec.api_key} if name and spec.api_key else {}


def auth_headers(spec: ShardSpec) -> dict[str, str]:
    """Returns the headers the agent's own calls to ``spec``'s engine carry ({} without a secret)."""
    return {"authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
