"""``llmgw ctl stop|start|restart``: stop and resume serving (the setting ``serving.stopped``),
restart every process of the cluster."""

from __future__ import annotations

import click

from llmgw.cli.ctl.common import call, json_option


def _set_serving_stopped(ctx: click.Context, as_json: bool, stopped: bool, done: str) -> None:
    """Set ``serving.stopped`` to ``stopped``; print ``done``, or the new value as JSON."""
    call(ctx, as_json, lambda c: c.set_serving_stopped(stopped), as_data=lambda now: {"serving_stopped": now})
    click.echo(done)


@click.command()
@json_option
@click.pass_context
def stop(ctx: click.Context, as_json: bool) -> None:
    """Stop serving: every POST under /v1/ answers 503 system_stopped and every replica is
    stopped (GPUs freed); models, control planes and agents stay (setting serving.stopped)."""
    _set_serving_stopped(ctx, as_json, True,
                         "serving stopped: the gateway answers 503 system_stopped and every replica is being "
                         "stopped, until `llmgw ctl start`")


@click.command()
@json_option
@click.pass_context
def start(ctx: click.Context, as_json: bool) -> None:
    """Resume serving after `llmgw ctl stop`: every model is placed again."""
    _set_serving_stopped(ctx, as_json, False, "serving resumed: every model is being placed again")


@click.command()
@json_option
@click.pass_context
def restart(ctx: click.Context, as_json: bool) -> None:
    """Restart every agent, then every standby control plane, then the leader; engines keep serving."""
    done = call(ctx, as_json, lambda c: c.restart_cluster())
    click.echo(f"restarted {done['agents']} agent(s) and {done['standbys']} standby control plane(s); "
               f"the leader {done['leader']} is restarting now (another may lead for a while: `llmgw ctl status`)")
