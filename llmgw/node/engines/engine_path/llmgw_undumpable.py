"""Makes an engine process non-dumpable, so other engines of the same user cannot read its secret.

Every engine on a node runs as the one engines' user (llmgw/node/engine_user.py), and a
process's environment (``/proc/PID/environ``, where its secret is) and memory are readable by
other processes of its user. A non-dumpable process (``prctl(PR_SET_DUMPABLE, 0)``) has them
owned by root: the agent still reads them, another engine does not. The agent asks for it with
:data:`FLAG_ENV` when it started the engine as another user (it is root then); an engine run as
the agent's own user stays dumpable, so the agent can still find it by its environment.

It runs in the engine's own interpreter, so it imports nothing but the standard library.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["FLAG_ENV", "apply"]

#: Set to "1" by the agent for an engine it started as the engines' user.
FLAG_ENV = "LLMGW_ENGINE_UNDUMPABLE"
#: prctl option (linux/prctl.h).
PR_SET_DUMPABLE = 4


def apply() -> bool:
    """Makes this process non-dumpable when :data:`FLAG_ENV` asks for it; returns whether it is
    now. Nothing happens (False) where the flag is unset or prctl is unavailable."""
    if os.environ.get(FLAG_ENV) != "1":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False
