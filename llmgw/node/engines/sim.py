"""The simulated engine: ``python -m llmgw.sim``, shipped with llmgw itself.

It is always installed (it is part of this package) and its version is llmgw's.
It answers GET /health with 200 as soon as it listens, so its startup deadline is short.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from llmgw.node.engines import DEFAULT_HEALTH_PATH, check_refused
from llmgw.spec import EngineInfo, ShardSpec

# The simulator loads nothing, so a few seconds is plenty even on a busy node;
# anything slower is a broken start, better retried than waited for.
SIM_STARTUP_TIMEOUT = 60.0

# The directory holding the llmgw package, so ``-m llmgw.sim`` resolves to this same
# llmgw even when it runs from a source checkout that is not installed.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])


def _llmgw_version() -> str:
    """Returns llmgw's installed version, or "0+unknown" when running uninstalled."""
    try:
        return importlib.metadata.version("llmgw")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class SimEngine:
    """Adapter for the simulated engine (see :class:`llmgw.node.engines.Engine`)."""

    name = "sim"
    health_path = DEFAULT_HEALTH_PATH
    startup_timeout = SIM_STARTUP_TIMEOUT

    def probe(self) -> EngineInfo:
        """Returns installed=True with llmgw's version: the simulator ships with llmgw."""
        return EngineInfo(name=self.name, installed=True, version=_llmgw_version(), detail="built into llmgw")

    def argv(self, spec: ShardSpec, host: str, port: int) -> list[str]:
        """Returns ``python -m llmgw.sim --host H --port P --model NAME`` plus the profile's args."""
        return [sys.executable, "-m", "llmgw.sim", "--host", host, "--port", str(port), "--model", spec.model, *spec.args]

    def env(self, spec: ShardSpec) -> dict[str, str]:
        """Returns the profile's env plus unbuffered output and a PYTHONPATH that finds llmgw."""
        inherited = os.environ.get("PYTHONPATH", "")
        pythonpath = _PACKAGE_ROOT + (os.pathsep + inherited if inherited else "")
        return {"PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath, **spec.env}

    def check_args(self, spec: ShardSpec) -> None:
        """Raises :class:`~llmgw.node.engines.EngineRefused` for refused args/env."""
        check_refused(spec)
