"""The compiled Cap'n Proto schema (schema/llmgw.capnp), loaded once."""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path
from typing import Any

import capnp

#: The package holding the ``.capnp`` files: the repository's top-level schema/,
#: installed as ``llmgw.schema`` (setup.py) so a wheel carries it as package data.
SCHEMA_PACKAGE = "llmgw.schema"
#: The one schema llmgw speaks (control plane, agents, ``llmgw ctl``).
SCHEMA_FILE = "llmgw.capnp"


@functools.cache
def load() -> Any:
    """Return the loaded ``llmgw.capnp`` module.

    The file comes from :data:`SCHEMA_PACKAGE` through :mod:`importlib.resources`
    (an installed wheel, an editable install or a checkout alike). The pycapnp
    include directory is on the import path so schemas may use ``-> stream``
    methods (without it, pycapnp aborts the process).

    Raises:
      ModuleNotFoundError: llmgw was installed without its schema package.
      OSError: the schema file is missing from that package.
    """
    include = str(Path(capnp.__file__).resolve().parent.parent)
    resource = importlib.resources.files(SCHEMA_PACKAGE) / SCHEMA_FILE
    # as_file: a real path even if the package were imported from a zip; capnp reads it now.
    with importlib.resources.as_file(resource) as path:
        return capnp.load(str(path), imports=[include])
