"""What pyproject.toml cannot say: the top-level schema/ and systemd/ ship as ``llmgw.schema``
and ``llmgw.systemd`` (the units ``llmgw server join`` installs).

The Cap'n Proto schemas stay at the top of the repository (DESIGN.md, Layout) and
travel inside the wheel as package data of ``llmgw.schema``, where
:mod:`llmgw.rpc.schema` finds them through :mod:`importlib.resources`, installed
or editable alike. Every directory under llmgw/ is a package, ``__init__.py`` or
not, as Python imports them (data-only ones such as ``llmgw.node.install.locks``
too), so the wheel holds what a checkout imports. Package data and everything
else about the distribution is in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["llmgw", "llmgw.*"], exclude=["*.__pycache__"]), "llmgw.schema",
              "llmgw.systemd"],
    package_dir={"llmgw.schema": "schema", "llmgw.systemd": "systemd"},
)
