"""Packages that re-export heavy names load them only when read (llmgw/lazy.py).

The control plane imports :mod:`llmgw.router.interface` and nothing else of the router,
and :mod:`llmgw.catalog` (so ``llmgw ctl``) reads :mod:`llmgw.config.defaults`: neither
may drag in the HTTP stack or every config section through its package's ``__init__``.
Checked in a fresh interpreter, since this one has imported everything long ago.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from llmgw.lazy import lazy_exports

#: Seconds a fresh interpreter may take to import a few modules (generous for slow CI machines).
SUBPROCESS_TIMEOUT = 120


def loaded_after(statement: str) -> set[str]:
    """Returns the names in ``sys.modules`` of a fresh interpreter after running ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_gateway_interface_loads_no_http_stack() -> None:
    loaded = loaded_after("import llmgw.router.interface")
    assert not {"quart", "hypercorn", "httpx", "llmgw.router.app", "llmgw.router.http"} & loaded


def test_config_defaults_load_no_yaml_or_sections() -> None:
    loaded = loaded_after("import llmgw.config.defaults")
    assert not {"yaml", "llmgw.config.server", "llmgw.config.agent", "llmgw.config.sections"} & loaded


def test_reexported_names_still_resolve() -> None:
    loaded = loaded_after("from llmgw.router import create_app, serve_gateway\n"
                          "from llmgw.config import ServerConfig, load_agent_config")
    assert {"llmgw.router.app", "llmgw.router.http.serve", "llmgw.config.server", "llmgw.config.agent"} <= loaded


def test_lazy_exports_imports_on_first_read_and_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    package = types.ModuleType("fakepkg")
    package.__path__ = []  # a package, so "fakepkg.sub" is a submodule name
    sub = types.ModuleType("fakepkg.sub")
    sub.VALUE = object()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fakepkg", package)
    getattr_ = lazy_exports("fakepkg", {"VALUE": "sub"})
    with pytest.raises(ModuleNotFoundError):
        getattr_("VALUE")  # the submodule is imported only now, and does not exist yet
    monkeypatch.setitem(sys.modules, "fakepkg.sub", sub)
    assert getattr_("VALUE") is sub.VALUE
    assert package.VALUE is sub.VALUE  # cached in the package: later reads skip __getattr__
    with pytest.raises(AttributeError, match="has no attribute 'OTHER'"):
        getattr_("OTHER")
