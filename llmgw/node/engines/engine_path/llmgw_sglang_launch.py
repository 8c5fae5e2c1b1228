"""Starts SGLang's server with the shard's secret, which never appears on the command line.

SGLang takes its key only as ``--api-key``, and a process's command line is readable by every
local user in ``/proc/PID/cmdline``. The agent therefore starts a keyed SGLang shard as
``python -m llmgw_sglang_launch <SGLang's usual arguments>`` with this directory on its
``PYTHONPATH`` and the secret in :data:`API_KEY_ENV`. This module takes the secret out of the
environment (SGLang's own processes never inherit it), appends ``--api-key SECRET`` to
``sys.argv`` inside this process, and runs ``sglang.launch_server`` as ``__main__``, which
parses ``sys.argv[1:]``. The kernel's copy of the command line (``/proc/PID/cmdline``) keeps
the arguments the process was started with, without the secret.

It runs in SGLang's own interpreter, so it imports nothing but the standard library.
"""

from __future__ import annotations

import os
import runpy
import sys

try:
    import llmgw_undumpable  # beside this module on the engine path
except ImportError:  # imported as part of the llmgw package (its tests)
    from . import llmgw_undumpable

__all__ = ["API_KEY_ENV", "API_KEY_OPTION", "SERVER_MODULE", "main"]

#: The variable the agent puts the secret in (llmgw.catalog.engine_options.API_KEY_ENV["sglang"]).
API_KEY_ENV = "LLMGW_SGLANG_API_KEY"
#: SGLang's option for its key.
API_KEY_OPTION = "--api-key"
#: SGLang's server entry point, run as ``__main__``.
SERVER_MODULE = "sglang.launch_server"
#: Exit status when started without a secret (argparse's status for a usage error).
USAGE_ERROR = 2


def main() -> None:
    """Moves the secret from the environment to ``sys.argv`` and runs SGLang's server.

    Exits with status :data:`USAGE_ERROR` and a message if :data:`API_KEY_ENV` is unset or empty
    (an unkeyed shard is started as ``python -m sglang.launch_server`` directly); otherwise
    returns or raises what SGLang's server does.
    """
    llmgw_undumpable.apply()  # before anything: its environment holds the secret
    key = os.environ.pop(API_KEY_ENV, "")  # also unset for every process SGLang starts
    if not key:
        sys.stderr.write(
            f"llmgw_sglang_launch: {API_KEY_ENV} is not set; this launcher is for a shard with a "
            f"secret (start an unkeyed one with `python -m {SERVER_MODULE}`)\n"
        )
        sys.exit(USAGE_ERROR)
    sys.argv += [API_KEY_OPTION, key]  # last: argparse keeps the last value of an option
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
