"""Helpers shared by the llmgw subcommands: logging, running trio, well-known paths."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

import click
import trio

from llmgw.logbook import RedactingFormatter

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
#: The file `llmgw up` writes into its state directory (its RPC address and admin
#: certificate) and `llmgw ctl` reads to find that cluster.
UP_FILE = "up.json"


def setup_logging(level: str) -> None:
    """Log at ``level`` to stderr, every line redacted (llmgw/logbook.py: no secret is written)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(RedactingFormatter(LOG_FORMAT))
    # httpx logs every request at INFO: far too chatty for health polls.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("hypercorn.access").setLevel(logging.WARNING)


def run_trio(main: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``main`` under trio; Ctrl-C exits quietly with status 130."""
    try:
        return trio.run(main)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)


def default_up_dir() -> Path:
    """Where `llmgw up` keeps its cluster (and where `llmgw ctl` looks for it)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "llmgw" / "up"
