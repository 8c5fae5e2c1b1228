"""Package attributes loaded on first use (PEP 562 module ``__getattr__``).

A package whose ``__init__`` re-exports names from heavy submodules makes every import of
any of its submodules pay for all of them. :func:`lazy_exports` gives such a package a
``__getattr__`` that imports a name's submodule only when the name is first read.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """Return a module ``__getattr__`` for ``package`` (its ``__name__``).

    ``exports`` maps each public name to the submodule, relative to ``package``, that
    defines it. The returned function imports that submodule on first access, caches the
    value in the package's namespace (later reads do not call it again) and returns it; a
    name not in ``exports`` raises ``AttributeError`` as a plain module would. Errors from
    importing the submodule propagate unchanged.
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return __getattr__
