"""The classified option tables: every option of an engine version, safe or refused with the reason.

A profile may pass an engine only options its table classifies as safe (tuning, limits,
features that name no path, address, credential or code). Everything else is refused with
the reason: options classified as refused, and options the table does not know (a newer
engine version's new options stay refused until a maintainer classifies them with
:mod:`llmgw.cli.engine_flags`).

One module per engine holds its table (:data:`TABLE`: a :class:`Table` made from the
version named in it): :mod:`.vllm`, :mod:`.llamacpp`, :mod:`.sglang`, :mod:`.sim`.
:func:`table_for` returns it; :mod:`llmgw.catalog.engine_flags.reader` reads a profile's
arguments the way the engine's own parser does and checks them against it.
"""

from __future__ import annotations

import importlib
from typing import Mapping, Union

import attrs

__all__ = ["ANY", "MANY", "OPTIONAL", "Opt", "Table", "table_for", "TABLE_MODULES"]

#: ``Opt.values``: how many values an option takes. An int is exactly that many (0: a flag);
#: these are argparse's ``nargs``: zero or one, one or more, zero or more.
OPTIONAL = "?"
MANY = "+"
ANY = "*"
Arity = Union[int, str]

# Reasons shared by the tables (each table adds its own where these do not say it).
AGENT = "the agent sets it itself"
CODE = "it imports or runs code the profile names"
READS = "it reads a file or directory the profile names"
WRITES = "it writes files where the profile says"
NETWORK = "it names a network address or opens a port of its own"
CREDENTIAL = "it carries a credential"
WEIGHTS = "it downloads or loads weights from somewhere else; llmgw fetches weights itself"
UNREVIEWED_JSON = "its JSON is not classified field by field and may name paths, addresses or classes"
GPUS = "it changes which or how many devices the engine uses; the placement decides that"
EXITS = "it prints something and exits instead of serving"
CLIENTS = "it lets API clients make the engine read, fetch or run what they send"
TLS = "the agent talks plain HTTP to the engine on loopback"
REMOVED = "this engine version refuses it (the option was removed)"
#: What the refresh script writes for an option it found: refused until a maintainer decides.
UNCLASSIFIED = "it is not classified yet: nobody has reviewed what it reads, writes, loads or connects to"


@attrs.frozen
class Opt:
    """One option of an engine: every spelling of it, how many values it takes, its verdict.

    ``names``: the option and its aliases (``--x``, ``--no-x``, ``-x``); ``values``: an int, or
    :data:`OPTIONAL`/:data:`MANY`/:data:`ANY`; ``refused``: why it is refused (None: safe);
    ``allowed_values``: for a safe option, the only values it may take (None: any); ``env``:
    the environment variable the engine also reads it from (llama.cpp's ``LLAMA_ARG_*``).
    """

    names: tuple[str, ...]
    values: Arity = 1
    refused: str | None = None
    allowed_values: tuple[str, ...] | None = None
    env: str | None = None

    @property
    def name(self) -> str:
        """The option's canonical spelling: its first long name (else its first name)."""
        return next((n for n in self.names if n.startswith("--")), self.names[0])


def opt(*names: str, values: Arity = 1, refused: str | None = None,
        allowed: tuple[str, ...] | None = None, env: str | None = None) -> Opt:
    """Returns an :class:`Opt` (the tables' shorthand)."""
    return Opt(tuple(names), values, refused, allowed, env)


@attrs.frozen
class Table:
    """An engine's classified options, made from ``version`` of it.

    ``style``: how its parser reads a command line: ``"argparse"`` (Python's argparse:
    ``--opt=value``, abbreviations, values that look like options end an option's values),
    ``"vllm"`` (argparse after vLLM's own pass: ``_`` and ``-`` alike in names,
    ``--opt.key value`` JSON keys, ``-O3``), or ``"llama"`` (llama.cpp: exact names only,
    ``_`` read as ``-`` in long names, the next argument always the value).
    """

    engine: str
    version: str
    style: str
    options: tuple[Opt, ...]
    by_name: Mapping[str, Opt] = attrs.field(init=False)
    by_env: Mapping[str, Opt] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        by_name: dict[str, Opt] = {}
        for option in self.options:
            for name in option.names:
                if name in by_name:
                    raise ValueError(f"{self.engine} table: {name} is classified twice")
                by_name[name] = option
        object.__setattr__(self, "by_name", by_name)
        object.__setattr__(self, "by_env", {o.env: o for o in self.options if o.env})

    def describe(self, running: str | None = None) -> str:
        """Returns "vllm 0.33.0 (llmgw's table was made from vllm 0.32.0)" or "vllm 0.32.0"."""
        made = f"{self.engine} {self.version}"
        if running and running != self.version:
            return f"{self.engine} {running} (llmgw's table was made from {made})"
        return made


#: Engine name -> the module holding its :data:`TABLE`.
TABLE_MODULES: Mapping[str, str] = {
    "vllm": "llmgw.catalog.engine_flags.vllm",
    "llama.cpp": "llmgw.catalog.engine_flags.llamacpp",
    "sglang": "llmgw.catalog.engine_flags.sglang",
    "sim": "llmgw.catalog.engine_flags.sim",
}


def table_for(engine: str) -> Table | None:
    """Returns the classified table of ``engine``, or None for an engine llmgw has none of."""
    module = TABLE_MODULES.get(engine)
    return None if module is None else importlib.import_module(module).TABLE
