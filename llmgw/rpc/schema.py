"""The compiled Cap'n Proto schema (schema/llmgw.capnp), loaded once."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import capnp

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schema"


@functools.cache
def load() -> Any:
    """Return the loaded ``llmgw.capnp`` module.

    The pycapnp include directory is on the import path so schemas may use
    ``-> stream`` methods (without it, pycapnp aborts the process).
    """
    include = str(Path(capnp.__file__).resolve().parent.parent)
    return capnp.load(str(SCHEMA_DIR / "llmgw.capnp"), imports=[include])
