"""``llmgw doctor``: check this node and say what is wrong and how to fix it, most serious first.

It reads the node as its agent would (agent.yaml, default /etc/llmgw/agent.yaml where it
exists): GPUs and their MIG mode and instances, driver and CUDA, processes other than llmgw's
engines on the cards, ECC errors and the kernel's XID lines, CPU vector extensions, memory,
the disk where weights go, the agent unit's memlock limit, the engines' user and its access to
the GPUs, the engines installed and whether each runs, the control planes reachable with this
node's certificate, and whether the clock is synchronised. ``--json`` writes every finding and
every fact it concluded from. Exits 1 when something fails, 0 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from llmgw.cli.agent_join import DEFAULT_AGENT_CONFIG
from llmgw.cli.output import print_json
from llmgw.config import AgentConfig, ConfigError, load_agent_config


#: How each severity is shown, as wide as the widest.
LABELS = {"fail": "FAIL", "warn": "WARN", "info": "INFO", "ok": " ok "}


def run_doctor(config: AgentConfig, *, config_problem: str = "", check_engines: bool = True,
               quiet: bool = False):  # type: ignore[no-untyped-def]
    """Returns the :class:`~llmgw.node.doctor.report.Report` on this machine (progress on stderr unless ``quiet``)."""
    import trio

    from llmgw.node.doctor.checks import diagnose
    from llmgw.node.doctor.gather import gather

    def progress(step: str) -> None:
        if not quiet:
            click.echo(f"doctor: {step} ...", err=True)

    facts = trio.run(lambda: gather(config, config_problem=config_problem, check_engines=check_engines,
                                    progress=progress))
    return diagnose(facts)


def print_findings(report, *, indent: str = "", only_serious: bool = False) -> None:  # type: ignore[no-untyped-def]
    """Prints ``report``'s findings, one per line with its fix under it."""
    for finding in report.findings:
        if only_serious and finding.severity.value not in ("fail", "warn"):
            continue
        click.echo(f"{indent}{LABELS[finding.severity.value]}  {finding.topic}: {finding.message}")
        if finding.fix:
            click.echo(f"{indent}      fix: {finding.fix}")


def load_config(config_path: Path | None) -> tuple[AgentConfig, str]:
    """Returns agent.yaml (``config_path``, else /etc/llmgw/agent.yaml where it exists, else the
    defaults) and why it does not load ("" when it does: then the defaults stand in)."""
    path = config_path if config_path is not None else DEFAULT_AGENT_CONFIG
    if config_path is None and not path.exists():
        return load_agent_config(None), ""
    try:
        return load_agent_config(path), ""
    except ConfigError as exc:
        return load_agent_config(None), str(exc)


@click.command()
@click.option("--config", "-c", "config_path", type=click.Path(path_type=Path), default=None,
              help="The agent's agent.yaml [/etc/llmgw/agent.yaml where it exists].")
@click.option("--no-engine-checks", is_flag=True, help="Do not run each installed engine's check (vLLM's is slow).")
@click.option("--json", "as_json", is_flag=True, help="Print every finding and fact as JSON.")
def doctor(config_path: Path | None, no_engine_checks: bool, as_json: bool) -> None:
    """Check this node: what is wrong and how to fix it, most serious first (exit 1 on a failure)."""
    config, problem = load_config(config_path)
    report = run_doctor(config, config_problem=problem, check_engines=not no_engine_checks, quiet=as_json)
    if as_json:
        print_json(report.to_json())
    else:
        print_findings(report)
        fails, warns = report.counts()
        click.echo(f"\n{fails} failure(s), {warns} warning(s)" + ("" if fails else ": this node can run engines"))
    sys.exit(1 if report.failed else 0)
