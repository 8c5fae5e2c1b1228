"""Reads an installed engine's own parser and says which of its options llmgw has not classified.

Run it after installing a new engine version::

    python -m llmgw.cli.engine_flags vllm            # the installed vLLM (llmgw's engine cache)
    python -m llmgw.cli.engine_flags vllm --python /opt/vllm/bin/python
    python -m llmgw.cli.engine_flags llama.cpp [--binary /path/to/llama-server]
    python -m llmgw.cli.engine_flags sim

It prints every option the parser knows that the table (``llmgw/catalog/engine_flags/<engine>.py``)
does not, as lines to classify and paste into the table (refused until someone decides), and the
table's options the parser no longer knows. Exit status: 0 when everything is classified, 1 when
something is not, 2 when the engine cannot be read.

The parsers are read with the engine's own code: vLLM's and SGLang's argparse parsers built by the
engine's interpreter (:data:`ARGPARSE_DUMPERS`), llama-server's ``--help`` (:func:`parse_llama_help`),
the simulator's parser in this process.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import attrs

from llmgw.catalog.engine_flags import ANY, MANY, OPTIONAL, Table, table_for

__all__ = ["Found", "installed", "main", "parse_llama_help", "read_parser", "unclassified"]

#: Importing vLLM or SGLang loads torch: tens of seconds on a busy machine.
PARSER_TIMEOUT = 600.0
#: Run by the engine's interpreter: prints its server parser's options as JSON.
_DUMP = """
import json, sys
def dump(parser):
    out = []
    for a in parser._actions:
        if a.option_strings:
            out.append({"names": list(a.option_strings), "nargs": a.nargs, "help": (a.help or "")[:200]})
    json.dump(out, sys.stdout)
"""
ARGPARSE_DUMPERS = {
    "vllm": _DUMP + """
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
dump(make_arg_parser(FlexibleArgumentParser()))
""",
    "sglang": _DUMP + """
import argparse
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
dump(parser)
""",
}


@attrs.frozen
class Found:
    """An option as the engine's parser knows it: its spellings, how many values, its help."""

    names: tuple[str, ...]
    values: int | str
    help: str = ""
    env: str | None = None


def _arity(nargs: Any) -> int | str:
    if nargs is None:
        return 1
    if nargs in (OPTIONAL, MANY, ANY):
        return str(nargs)
    return int(nargs)


def read_argparse_dump(text: str) -> list[Found]:
    """Returns the options of a JSON dump made by :data:`ARGPARSE_DUMPERS`."""
    return [Found(tuple(o["names"]), _arity(o["nargs"]), o.get("help") or "") for o in json.loads(text)]


_HELP_NAMES = re.compile(r"^(-[^\s,]+(?:,\s+-[^\s,]+)*)(?: (\S.*?))?(?:\s{2,}(.*))?$")
_ENV = re.compile(r"\(env: ([A-Z0-9_]+)\)")
#: A value hint naming two values (``START END``): llama.cpp's two-value options.
_TWO_VALUES = re.compile(r"^[A-Z][A-Z0-9_]* [A-Z][A-Z0-9_]*$")


def parse_llama_help(text: str) -> list[Found]:
    """Returns the options of ``llama-server --help`` output: names, value count, env variable.

    An option line starts in the first column with its names (``-c,    --ctx-size N``); a value
    hint after the last name means one value (two for ``START END``); ``(env: NAME)`` on a
    following line is the variable llama-server also reads it from.
    """
    found: list[Found] = []
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        if line.startswith("-") and not line.startswith("-----"):
            match = _HELP_NAMES.match(line.rstrip())
            if match is None:
                continue
            if current is not None:
                found.append(Found(**current))
            names = tuple(n.strip() for n in match.group(1).split(","))
            hint = (match.group(2) or "").strip()
            values = 0 if not hint else (2 if _TWO_VALUES.match(hint) else 1)
            current = {"names": names, "values": values, "help": (match.group(3) or "").strip()}
        elif current is not None:
            env = _ENV.search(line)
            if env:
                current["env"] = env.group(1)
            elif not current["help"]:
                current["help"] = line.strip()
    if current is not None:
        found.append(Found(**current))
    return found


def installed(engine: str) -> tuple[str, str] | None:
    """Returns (version, the program to read the parser with) of ``engine`` in llmgw's engine cache.

    The program: the environment's Python for vLLM/SGLang, the llama-server binary, "" for the
    simulator (llmgw's own code). None: not installed here.
    """
    if engine == "sim":
        from llmgw import __version__
        return __version__, ""
    if engine == "llama.cpp":
        from llmgw.node.install import llamacpp
        inst = llamacpp.find_installed()
        return None if inst is None else (inst.version, str(inst.binary))
    from llmgw.node.install import python_env
    spec = python_env.PYTHON_ENGINES.get(engine)
    found = python_env.find_installed(spec) if spec is not None else None
    if found is None:
        return None
    directory, marker = found
    return str(marker.get("version", "")), str(python_env.engine_python(directory))


def read_parser(engine: str, program: str, *, timeout: float = PARSER_TIMEOUT) -> list[Found]:
    """Returns every option ``engine``'s parser knows, read with ``program`` (see :func:`installed`).

    Raises RuntimeError saying why when the parser cannot be read.
    """
    if engine == "sim":
        from llmgw.sim.config import build_parser
        return [Found(tuple(a.option_strings), _arity(a.nargs), a.help or "")
                for a in build_parser()._actions if a.option_strings]
    if engine == "llama.cpp":
        argv = [program, "--help"]
    elif engine in ARGPARSE_DUMPERS:
        argv = [program, "-c", ARGPARSE_DUMPERS[engine]]
    else:
        raise RuntimeError(f"llmgw cannot read the parser of engine {engine!r}")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{argv[0]}: {exc}") from None
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} exited {done.returncode}: {done.stderr.strip()[-1000:]}")
    return parse_llama_help(done.stdout + done.stderr) if engine == "llama.cpp" else read_argparse_dump(done.stdout)


def unclassified(table: Table, found: Sequence[Found]) -> tuple[list[Found], list[str]]:
    """Returns (the parser's options with a spelling the table does not know, table names the parser lacks)."""
    missing = [f for f in found if any(n not in table.by_name for n in f.names)]
    known = {n for f in found for n in f.names}
    gone = sorted(n for n in table.by_name if n not in known)
    return missing, gone


def draft_line(found: Found) -> str:
    """Returns a table line for ``found``, refused until a maintainer classifies it."""
    names = ", ".join(repr(n) for n in found.names)
    extra = f", env={found.env!r}" if found.env else ""
    note = f"  # {found.help[:80]}" if found.help else ""
    return f"    opt({names}, values={found.values!r}, refused=UNCLASSIFIED{extra}),{note}"


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m llmgw.cli.engine_flags", description=__doc__.split("\n")[0])
    parser.add_argument("engine", choices=["vllm", "sglang", "llama.cpp", "sim"])
    parser.add_argument("--python", help="the engine environment's interpreter (vLLM, SGLang)")
    parser.add_argument("--binary", help="the llama-server binary")
    parser.add_argument("--version", dest="engine_version", help="the engine version (default: the install marker's)")
    args = parser.parse_args(argv)
    table = table_for(args.engine)
    assert table is not None
    program = args.python or args.binary
    version = args.engine_version or ""
    if program is None:
        found_install = installed(args.engine)
        if found_install is None:
            print(f"{args.engine} is not installed in llmgw's engine cache; name it with --python or --binary",
                  file=sys.stderr)
            return 2
        version, program = found_install
    try:
        options = read_parser(args.engine, program)
    except RuntimeError as exc:
        print(f"cannot read {args.engine}'s parser: {exc}", file=sys.stderr)
        return 2
    missing, gone = unclassified(table, options)
    print(f"{args.engine} {version or '(version unknown)'}: {len(options)} options; "
          f"table made from {table.describe()}: {len(missing)} not classified, {len(gone)} no longer known")
    for found in missing:
        print(draft_line(found))
    for name in gone:
        print(f"    # {name}: classified, but this version's parser does not know it")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
