"""The ``llmgw`` command: server, agent, up, ctl.

Each command's module is imported only when that command runs or shows its help:
``llmgw ctl`` must not pay for (or be patched by) the gateway, the control plane and
the agent that ``up``, ``server`` and ``agent`` load.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping, NamedTuple

import click

from llmgw import __version__


class LazyCommand(NamedTuple):
    """A command known by where it is defined and the line ``llmgw --help`` shows for it."""

    module: str
    attribute: str
    #: The first sentence of the command's docstring (the listing must not import it to read it).
    summary: str


class LazyGroup(click.Group):
    """A click group whose commands are imported on first use.

    ``llmgw --help`` lists them from their :attr:`LazyCommand.summary`; running a command or
    asking for its help imports its module and adds the command to the group, once.
    """

    def __init__(self, *args: Any, lazy_commands: Mapping[str, LazyCommand], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """Returns the command named ``cmd_name``, importing its module the first time; None if unknown."""
        lazy = self.lazy_commands.get(cmd_name)
        if cmd_name not in self.commands and lazy is not None:
            command = getattr(importlib.import_module(lazy.module), lazy.attribute)
            if not isinstance(command, click.Command):
                raise TypeError(f"{lazy.module}.{lazy.attribute} is not a click command")
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Write the commands section as click does, from summaries for commands not yet imported."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            command = self.commands.get(name)
            if command is None:
                # A stand-in shortens the summary exactly as click shortens a command's help.
                summary = click.Command(name, help=self.lazy_commands[name].summary).get_short_help_str(limit)
            elif command.hidden:
                continue
            else:
                summary = command.get_short_help_str(limit)
            rows.append((name, summary))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


#: The subcommands of ``llmgw``: name -> where it is defined and its summary.
COMMANDS = {
    "up": LazyCommand("llmgw.cli.up", "up",
                      "Start a one-machine cluster: control plane, gateway and an agent, on 127.0.0.1."),
    "server": LazyCommand("llmgw.cli.daemons", "server",
                          "Run the control plane and gateway (`llmgw server init` first)."),
    "agent": LazyCommand("llmgw.cli.daemons", "agent",
                         "Run the node agent: join the control plane and supervise engines."),
    "ctl": LazyCommand("llmgw.cli.ctl", "ctl", "Operate a cluster: nodes, replicas, models, logs."),
    "wipe": LazyCommand("llmgw.cli.wipe", "wipe",
                        "Remove llmgw from this machine, after listing exactly what goes and asking for the..."),
    "service": LazyCommand("llmgw.cli.service", "service",
                           "This machine's llmgw units (systemd): status, start, stop, restart."),
    "doctor": LazyCommand("llmgw.cli.doctor", "doctor",
                          "Check this node: what is wrong and how to fix it, most serious first (exit 1 on a..."),
    "firewall": LazyCommand("llmgw.cli.firewall", "firewall",
                            "llmgw's nft table on this machine (a control plane's; agents keep their own)."),
}


@click.group(cls=LazyGroup, lazy_commands=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="llmgw")
def main() -> None:
    """llmgw: run LLM inference on your own machines behind one OpenAI-compatible endpoint."""


if __name__ == "__main__":
    main()
