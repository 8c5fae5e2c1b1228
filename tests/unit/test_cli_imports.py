"""``llmgw ctl`` and ``llmgw --help`` load only what they use.

Each check runs in a fresh interpreter (a subprocess), since this one has imported the
gateway long ago: importing :mod:`llmgw.cli.ctl`, every ``--help`` of ``llmgw`` and
``llmgw ctl``, and a ``ctl`` call that fails to find its certificate must load none of
the server side (Quart, Hypercorn, psycopg, the gateway, the control plane, the agent)
and leave Hypercorn unpatched. The lazy ``llmgw --help`` listing must read exactly as
click writes it for the imported commands.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import click

from llmgw.cli.main import COMMANDS, LazyGroup, main

#: Top-level packages and llmgw parts `llmgw ctl` must never load.
FORBIDDEN = ("quart", "hypercorn", "psycopg", "psycopg_pool", "llmgw.router", "llmgw.control", "llmgw.node")
#: Seconds a fresh interpreter may take to import the ctl and print every help (generous: CI machines are slow).
SUBPROCESS_TIMEOUT = 120

#: Run in the fresh interpreter; prints {"forbidden": [...], "patched": [...], "exits": {...}} as JSON.
PROBE = textwrap.dedent("""
    import json, sys
    import click
    from click.testing import CliRunner

    STEP = sys.argv[1]
    exits = {}
    if STEP == "import":
        import llmgw.cli.ctl
    else:
        from llmgw.cli.main import main
        runner = CliRunner()

        def run(*args):
            exits[" ".join(args)] = runner.invoke(main, list(args), prog_name="llmgw").exit_code

        run("--help")
        run("ctl", "--help")
        ctl = main.get_command(click.Context(main), "ctl")

        def walk(group, path):
            for name in group.list_commands(click.Context(group)):
                command = group.get_command(click.Context(group), name)
                run(*path, name, "--help")
                if isinstance(command, click.Group):
                    walk(command, [*path, name])

        walk(ctl, ["ctl"])
        run("ctl", "--server", "127.0.0.1:1", "--tls-dir", sys.argv[2], "nodes")

    forbidden = sorted(m for m in sys.modules if m.startswith(FORBIDDEN_PREFIXES))
    # Loaded only now, so whatever it holds was not patched by the command above.
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.trio.tcp_server import TCPServer
    patched = [f"{cls.__name__}.{name}" for cls in (TCPServer, H11Protocol) for name, value in vars(cls).items()
               if callable(value) and not getattr(value, "__module__", "hypercorn").startswith("hypercorn")]
    print(json.dumps({"forbidden": forbidden, "patched": patched, "exits": exits}))
""")


def probe(step: str, tmp_path: Path) -> dict[str, object]:
    """Returns what a fresh interpreter loaded after ``step`` ("import" or "commands")."""
    prefixes = tuple(p for name in FORBIDDEN for p in (name, name + "."))
    code = f"FORBIDDEN_PREFIXES = {prefixes!r}\n{PROBE}"
    out = subprocess.run([sys.executable, "-c", code, step, str(tmp_path / "no-such-tls-dir")],
                         capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_importing_ctl_loads_no_server_side(tmp_path: Path) -> None:
    result = probe("import", tmp_path)
    assert result["forbidden"] == [], f"import llmgw.cli.ctl loaded {result['forbidden']}"
    assert result["patched"] == []


def test_help_and_ctl_commands_load_no_server_side(tmp_path: Path) -> None:
    result = probe("commands", tmp_path)
    exits = result["exits"]
    assert isinstance(exits, dict)
    assert {args: code for args, code in exits.items() if args.endswith("--help") and code != 0} == {}
    assert exits[f"ctl --server 127.0.0.1:1 --tls-dir {tmp_path / 'no-such-tls-dir'} nodes"] == 1
    assert "ctl models add --help" in exits and "ctl certs issue --help" in exits
    assert result["forbidden"] == [], f"llmgw --help / ctl commands loaded {result['forbidden']}"
    assert result["patched"] == []


def test_lazy_listing_reads_as_click_writes_it() -> None:
    lazy = LazyGroup(name="llmgw", help=main.help, lazy_commands=COMMANDS)
    eager = click.Group(name="llmgw", help=main.help)
    for name in COMMANDS:
        eager.add_command(main.get_command(click.Context(main), name), name)

    def listing(group: click.Group) -> str:
        return group.get_help(click.Context(group, info_name="llmgw", max_content_width=110))

    assert listing(lazy) == listing(eager)
    assert lazy.commands == {}, "listing the commands imported one"


def test_lazy_group_runs_the_imported_command() -> None:
    ctx = click.Context(main)
    assert main.get_command(ctx, "ctl") is main.get_command(ctx, "ctl")
    assert main.get_command(ctx, "no-such-command") is None
    assert sorted(main.list_commands(ctx)) == sorted(COMMANDS)
