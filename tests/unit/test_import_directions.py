"""Dependency directions between llmgw's parts, read from the source with ast (nothing is imported).

Every ``import`` counts: at module level, inside functions and under ``if TYPE_CHECKING:``,
relative ones resolved, and ``importlib.import_module("...")`` with a literal name. A module
belongs to the part named by its first package below ``llmgw`` (``llmgw.control.plane`` is
in ``control``); every other module (``llmgw``, ``llmgw.spec``, ``llmgw.catalog``,
``llmgw.config``, ...) is *neutral*: any part may import it, and it imports only neutral
modules. :data:`RULES` says what each part may import besides its own modules.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Iterator

import attrs
import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "llmgw"

NEUTRAL = "neutral"
ANYTHING = "anything"
#: ``llmgw/__main__.py``: the one module outside cli/ that may import llmgw.cli.
MAIN = "main"
PARTS = ("cli", "client", "control", "node", "router", "rpc", "sim", "testing")


@attrs.frozen
class Rule:
    """What a part may import besides itself: ``allowed`` entries are :data:`ANYTHING`,
    :data:`NEUTRAL`, a part's name, or a dotted module (with its submodules); ``except_``
    lists modules refused even though ``allowed`` covers them."""

    allowed: frozenset[str]
    except_: frozenset[str] = frozenset()
    why: str = ""


def _rule(*allowed: str, except_: Iterable[str] = (), why: str = "") -> Rule:
    return Rule(frozenset(allowed), frozenset(except_), why)


RULES: dict[str, Rule] = {
    MAIN: _rule(ANYTHING, why="the entry point"),
    "cli": _rule(ANYTHING, why="the command line assembles every part"),
    "client": _rule(NEUTRAL, "rpc", why="the Cap'n Proto client library"),
    "control": _rule(NEUTRAL, "rpc", "client", "llmgw.router.interface",
                     why="the gateway only through its one interface; the HTTP admin API calls the Admin "
                         "capability through the client library, so it answers what ctl --json prints"),
    "node": _rule(NEUTRAL, "rpc"),
    "router": _rule(NEUTRAL),
    "rpc": _rule(NEUTRAL, except_=("llmgw.catalog",), why="converts values, never judges them"),
    "sim": _rule("llmgw.spec", "llmgw.kvhash", "llmgw.kvwire", "llmgw.hftokenizer", "llmgw.chattemplate",
                 why="a stand-in engine, runnable on its own; with --tokenizer it tokenizes as vLLM does, "
                     "with the code the gateway runs"),
    "testing": _rule(NEUTRAL),
    NEUTRAL: _rule(NEUTRAL, why="neutral modules import only neutral modules"),
}


@attrs.frozen
class Violation:
    path: str
    line: int
    source: str  # the importing module
    target: str  # the imported module

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {self.target}"


def part_of(module: str) -> str:
    """Returns the part ``module`` (a dotted name under llmgw) belongs to."""
    if module == "llmgw.__main__":
        return MAIN
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in PARTS:
        return parts[1]
    return NEUTRAL


def allowed(source: str, target: str) -> bool:
    """Returns whether module ``source`` may import module ``target`` (both under llmgw)."""
    mine, theirs = part_of(source), part_of(target)
    if mine == theirs and mine != NEUTRAL:
        return True
    rule = RULES[mine]
    if any(target == m or target.startswith(m + ".") for m in rule.except_):
        return False
    for entry in rule.allowed:
        if entry == ANYTHING or entry == theirs:
            return True
        if "." in entry and (target == entry or target.startswith(entry + ".")):
            return True
    return False


def imported_modules(tree: ast.AST, module: str, is_package: bool, known: frozenset[str]) -> Iterator[tuple[int, str]]:
    """Yields ``(line, dotted module)`` for every import in ``tree`` (the source of ``module``).

    ``from a import b`` yields ``a.b`` when that is a module in ``known``, else ``a``.
    Relative imports are resolved against ``module``'s package.
    """
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if sub in known else base
        elif isinstance(node, ast.Call) and _is_import_call(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield node.lineno, first.value


def _is_import_call(func: ast.expr) -> bool:
    """Returns whether ``func`` is ``importlib.import_module``, ``import_module`` or ``__import__``."""
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def check_source(source: str, module: str, path: str, *, is_package: bool = False,
                 known: frozenset[str] = frozenset()) -> list[Violation]:
    """Returns every forbidden import in ``source`` (the text of ``module``, shown as ``path``)."""
    tree = ast.parse(source, filename=path)
    return [
        Violation(path, line, module, target)
        for line, target in imported_modules(tree, module, is_package, known)
        if (target == "llmgw" or target.startswith("llmgw.")) and not allowed(module, target)
    ]


def _modules() -> dict[str, Path]:
    """Returns every module under llmgw/ by dotted name."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
        names = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        found[".".join(names)] = path
    return found


def violations(part: str) -> list[Violation]:
    """Returns every forbidden import made by a module of ``part``."""
    modules = _modules()
    known = frozenset(modules)
    found = []
    for module, path in modules.items():
        if part_of(module) != part:
            continue
        shown = str(path.relative_to(PACKAGE_DIR.parent))
        found += check_source(path.read_text(), module, shown, is_package=path.name == "__init__.py", known=known)
    return found


@pytest.mark.parametrize("part", sorted(RULES))
def test_part_imports_only_what_its_rule_allows(part: str) -> None:
    found = violations(part)
    rule = RULES[part]
    may = ", ".join(sorted(rule.allowed)) + (f" except {', '.join(sorted(rule.except_))}" if rule.except_ else "")
    why = f" ({rule.why})" if rule.why else ""
    assert not found, f"{part} may import only itself and {may}{why}:\n" + "\n".join(map(str, found))


def test_nothing_outside_cli_imports_cli() -> None:
    modules = _modules()
    known = frozenset(modules)
    found = []
    for module, path in modules.items():
        if part_of(module) in ("cli", MAIN):
            continue
        shown = str(path.relative_to(PACKAGE_DIR.parent))
        tree = ast.parse(path.read_text(), filename=shown)
        found += [
            f"{shown}:{line}: {module} imports {target}"
            for line, target in imported_modules(tree, module, path.name == "__init__.py", known)
            if target == "llmgw.cli" or target.startswith("llmgw.cli.")
        ]
    assert not found, "only llmgw/__main__.py and llmgw/cli/ may import llmgw.cli:\n" + "\n".join(found)


def test_every_module_has_a_rule() -> None:
    assert {part_of(m) for m in _modules()} <= set(RULES)


# -- the checker itself ------------------------------------------------------------------------

PLANTED = '''\
from __future__ import annotations
from typing import TYPE_CHECKING
import trio
from llmgw.spec import ModelSpec
from llmgw.router.interface import GatewayInterface
from ..router import interface
if TYPE_CHECKING:
    from llmgw.router.app import Gateway

def later():
    from llmgw.node import fetch
    import llmgw.cli.main
    importlib.import_module("llmgw.sim.server")
'''


def test_the_checker_finds_planted_violations_with_their_lines() -> None:
    known = frozenset({"llmgw.node.fetch", "llmgw.router.interface"})
    found = check_source(PLANTED, "llmgw.control.planted", "llmgw/control/planted.py", known=known)
    assert [(v.line, v.target) for v in found] == [
        (8, "llmgw.router.app"),
        (11, "llmgw.node.fetch"),
        (12, "llmgw.cli.main"),
        (13, "llmgw.sim.server"),
    ]
    assert str(found[0]) == "llmgw/control/planted.py:8: llmgw.control.planted imports llmgw.router.app"


def test_relative_imports_resolve_against_the_package() -> None:
    known = frozenset({"llmgw.router.errors", "llmgw.node.fetch"})
    assert check_source("from .errors import GatewayError\n", "llmgw.router.auth", "x.py", known=known) == []
    assert [v.target for v in check_source("from . import errors\n", "llmgw.node", "x.py", is_package=True,
                                           known=frozenset({"llmgw.node.errors"}))] == []
    found = check_source("from ..node import fetch\n", "llmgw.router.auth", "x.py", known=known)
    assert [v.target for v in found] == ["llmgw.node.fetch"]


def test_the_rules_read_as_the_design_says() -> None:
    assert allowed("llmgw.control.plane", "llmgw.router.interface")
    assert not allowed("llmgw.control.plane", "llmgw.router.app")
    assert allowed("llmgw.node.fetch", "llmgw.catalog.sources")
    assert not allowed("llmgw.node.agent", "llmgw.control.plane")
    assert not allowed("llmgw.rpc.convert", "llmgw.catalog")
    assert allowed("llmgw.rpc.convert", "llmgw.spec")
    assert allowed("llmgw.sim.cache", "llmgw.kvwire")
    assert not allowed("llmgw.sim.config", "llmgw.catalog")
    assert not allowed("llmgw.spec", "llmgw.rpc.convert")
    assert allowed("llmgw.__main__", "llmgw.cli.main")
    assert not allowed("llmgw.router.app", "llmgw.cli")
