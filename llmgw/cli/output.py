"""Printing for the llmgw command: aligned tables for people, JSON for programs."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, NoReturn, Sequence

import click

from llmgw.jsonable import to_jsonable


def local_time(ts: float | None) -> str:
    """Returns Unix time ``ts`` as local ``YYYY-MM-DD HH:MM:SS``, or ``-`` for none (None or 0)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def print_json(value: Any) -> None:
    click.echo(json.dumps(to_jsonable(value), indent=2, sort_keys=True))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, empty: str = "(none)") -> None:
    """Print ``rows`` under ``headers``, columns aligned; ``empty`` when there are no rows."""
    if not rows:
        click.echo(empty)
        return
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        line = "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
        click.echo(click.style(line, bold=True) if n == 0 and sys.stdout.isatty() else line)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``message`` as an error on stderr and exit with ``code``."""
    click.echo(click.style("error: ", fg="red", bold=True) + message, err=True)
    sys.exit(code)
