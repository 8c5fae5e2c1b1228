"""The ``llmgw`` command: server, agent, up, ctl."""

from __future__ import annotations

import click

from llmgw import __version__
from llmgw.cli.ctl import ctl
from llmgw.cli.daemons import agent, server
from llmgw.cli.up import up


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="llmgw")
def main() -> None:
    """llmgw: run LLM inference on your own machines behind one OpenAI-compatible endpoint."""


main.add_command(up)
main.add_command(server)
main.add_command(agent)
main.add_command(ctl)

if __name__ == "__main__":
    main()
