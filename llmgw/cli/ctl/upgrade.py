"""``llmgw ctl upgrade``: a new llmgw release on every control plane, then every node, one at a time.

The release is a wheel file the operator gives, or a version fetched from the package
index (``pip download llmgw==VERSION``). It is uploaded to the leader, which installs it on
the standbys (through the feed each one holds), then on itself (it answers, exits 75 and
its service manager starts the new release; a standby may lead meanwhile), then sends it to
each agent over its session; each installs it beside the running release, switches its
``current`` link and restarts on it, engines kept (llmgw/releases.py). A control plane is
done when it is back on the new version (leading or attached as a standby).
A node is done when it is back on the new version, online, with as many ready replicas
as before; a node that is not, within ``--timeout``, stops the run before the next one
(a bad release reaches one machine), and ``--rollback NODE`` puts its previous release
back. Nodes already on the version are skipped, so running the command again resumes.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import trio

from llmgw.cli.common import run_trio
from llmgw.cli.ctl.common import Target, json_option, target_of
from llmgw.cli.output import fail, print_json
from llmgw.client import ClientError, ClusterClient, connect
from llmgw.releasefiles import ReleaseError, wheel_version

#: Seconds between looks at a node coming back (one small call each).
POLL_S = 1.0
#: Seconds `pip download` may take to fetch a release from the index.
DOWNLOAD_TIMEOUT_S = 300.0


def parse_duration(text: str) -> float:
    """Return seconds for "90", "90s", "10m" or "1h"; raises click.BadParameter otherwise."""
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a duration (90s, 10m, 1h)") from None
    if value <= 0:
        raise click.BadParameter("must be above 0")
    return value


def fetch_release(version: str, into: Path) -> Path:
    """Download llmgw ``version``'s wheel from the package index into ``into``; return its path.

    pip checks the index's hashes on the way; fails (exits) with pip's reason when it cannot."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
             "--dest", str(into), f"llmgw=={version}"],
            capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        fail(f"downloading llmgw {version} took over {DOWNLOAD_TIMEOUT_S:.0f} s")
    if done.returncode != 0:
        fail(f"cannot download llmgw {version} from the package index:\n" + (done.stdout + done.stderr).strip()[-2000:])
    wheels = sorted(into.glob("llmgw-*.whl"))
    if not wheels:
        fail(f"pip downloaded no wheel of llmgw {version} into {into}")
    return wheels[0]


async def _ready_on(client: ClusterClient, node: str) -> int:
    replicas, _ = await client.replicas()
    return sum(1 for r in replicas if r.node_id == node and r.state == "ready")


async def _wait_back(client: ClusterClient, node: str, version: str, ready_before: int, timeout: float) -> str:
    """Wait until ``node`` is online on ``version`` with ``ready_before`` ready replicas;
    return "" then, or what it was short of when ``timeout`` ran out."""
    short = f"it did not come back on {version}"
    with trio.move_on_after(timeout):
        while True:
            await trio.sleep(POLL_S)
            try:
                row = next((n for n in await client.nodes() if n.id == node), None)
                if row is None or row.state != "online" or row.version != version:
                    short = (f"it is {row.state} on llmgw {row.version or '?'}" if row is not None
                             else "it is not in the cluster")
                    continue
                ready = await _ready_on(client, node)
            except ClientError as exc:  # a control plane restarting: ask again
                short = str(exc)
                continue
            if ready >= ready_before:
                return ""
            short = f"{ready} of its {ready_before} replicas are ready"
    return short


async def _plane_back(target: Target, name: str, version: str, roles: tuple[str, ...], timeout: float) -> str:
    """Wait until control plane ``name`` runs ``version`` in one of ``roles`` (a new connection
    each look: the one asked may be the leader, restarting); return "" then, else what it was
    short of when ``timeout`` ran out."""
    short = f"it did not come back on {version}"
    with trio.move_on_after(timeout):
        while True:
            await trio.sleep(POLL_S)
            try:
                async with connect(target.servers, tls_dir=target.tls_dir) as client:
                    row = next((p for p in (await client.status()).control_planes if p.name == name), None)
            except ClientError as exc:  # restarting, or no leader yet
                short = str(exc)
                continue
            if row is not None and row.version == version and row.role in roles:
                return ""
            short = f"it is {row.role} on llmgw {row.version or '?'}" if row is not None else "it is not listed"
    return short


def _upgrade_control_planes(target: Target, wheel: Path, version: str, timeout: float, say: Any,
                            results: list[dict[str, Any]]) -> str:
    """Upgrade the standbys, then the leader; return "" or why the run stops."""

    def failed(name: str, error: ClientError, before: str) -> str:
        results.append({"control_plane": name, "result": "failed", "error": str(error)})
        return f"control plane {name}: {error}\nstopped before {before}"

    def back(name: str, short: str) -> str:
        if short:
            results.append({"control_plane": name, "result": "not back", "error": short})
            return f"control plane {name} is not back on {version} within {timeout:g}s: {short}"
        results.append({"control_plane": name, "result": "upgraded", "version": version})
        say(f"control plane {name}: back on {version}")
        return ""

    async def standbys(client: ClusterClient) -> tuple[str, str]:
        digest = await client.upload_release(wheel)
        say(f"release {wheel.name} (sha256 {digest[:16]}...) uploaded")
        status = await client.status()
        planes = sorted(status.control_planes, key=lambda p: (p.name == status.leader, p.name))
        for plane in planes:
            if plane.version == version:
                results.append({"control_plane": plane.name, "result": "skipped", "version": version})
                say(f"control plane {plane.name}: already on {version}")
                continue
            if plane.role not in ("leader", "standby"):
                return (f"control plane {plane.name} is {plane.role}: bring it back (or `llmgw ctl servers remove` "
                        "it, or pass --nodes-only) and run this again"), digest
            if plane.name == status.leader:
                return "", digest  # the leader last, after this connection
            say(f"control plane {plane.name}: {plane.version or '?'} -> {version}: installing ...")
            try:
                await client.upgrade_control_plane(plane.name, wheel.name, digest)
            except ClientError as exc:
                return failed(plane.name, exc, "the next one"), digest
            problem = back(plane.name, await _plane_back(target, plane.name, version, ("standby",), timeout))
            if problem:
                return problem, digest
        return "done", digest

    problem, digest = target.run(standbys)
    if problem != "":
        return "" if problem == "done" else problem

    async def leader(client: ClusterClient) -> tuple[str, str]:
        name = (await client.status()).leader
        say(f"control plane {name} (leading): -> {version}: installing; it restarts on it ...")
        try:
            await client.upgrade_control_plane(name, wheel.name, digest)
        except ClientError as exc:
            return name, failed(name, exc, "the nodes")
        return name, ""

    name, problem = target.run(leader)
    if problem:
        return problem
    return back(name, run_trio(lambda: _plane_back(target, name, version, ("leader", "standby"), timeout)))


async def _nodes_rejoined(client: ClusterClient, known: set[str], timeout: float) -> list[Any]:
    """Return the nodes once every node of ``known`` is listed again (a restarted leader knows
    them as they rejoin), or what is listed when ``timeout`` runs out."""
    nodes = await client.nodes()
    with trio.move_on_after(timeout):
        while not known <= {n.id for n in nodes}:
            await trio.sleep(POLL_S)
            nodes = await client.nodes()
    return nodes


@click.command()
@click.argument("release", required=False)
@click.option("--node", "only", multiple=True, metavar="NODE", help="Only these nodes (repeatable); default: all.")
@click.option("--timeout", default="10m", show_default=True, metavar="DURATION",
              help="How long each control plane and node may take to come back on the new release.")
@click.option("--rollback", metavar="NODE", help="Put NODE's previous release back (and restart its agent on it).")
@click.option("--nodes-only", is_flag=True, help="Leave the control planes as they are (or --node was given).")
@json_option
@click.pass_context
def upgrade(ctx: click.Context, release: str | None, only: tuple[str, ...], timeout: str, rollback: str | None,
            nodes_only: bool, as_json: bool) -> None:
    """Upgrade the cluster to RELEASE (a wheel file, or a version from the package index).

    Control planes first (the standbys, then the leader), then one node at a time: each gets
    the release, installs it beside the one it runs, restarts on it (engines kept), and must
    be back on the new version (a node with as many ready replicas as before) within
    --timeout; otherwise the run stops there. Those already on the version are skipped (run
    it again to resume). --node NAME (or --nodes-only) upgrades only nodes.
    """
    target = target_of(ctx, as_json)
    if rollback:
        if release:
            fail("give either RELEASE or --rollback NODE")
        now, before = target.run(lambda c: c.rollback_node(rollback))
        if target.json:
            print_json({"node": rollback, "release": now, "previous": before})
        else:
            click.echo(f"{rollback}: back on llmgw {now} (from {before}); its agent restarts on it")
        return
    if not release:
        fail("give the release: a wheel file (llmgw-VERSION-py3-none-any.whl) or a version from the package index")
    seconds = parse_duration(timeout)
    with tempfile.TemporaryDirectory(prefix="llmgw-upgrade-") as tmp:
        wheel = Path(release)
        if not wheel.is_file():
            if "/" in release or release.endswith(".whl"):
                fail(f"{release}: no such wheel file")
            click.echo(f"downloading llmgw {release} from the package index ...", err=True)
            wheel = fetch_release(release, Path(tmp))
        try:
            version = wheel_version(wheel.name)
        except ReleaseError as exc:
            fail(str(exc))
        results: list[dict[str, Any]] = []
        plane_results: list[dict[str, Any]] = []

        def say(line: str) -> None:
            if not target.json:
                click.echo(line)

        known = {n.id for n in target.run(lambda c: c.nodes())}  # back after a control plane's restart
        planes_problem = "" if nodes_only or only else _upgrade_control_planes(target, wheel, version, seconds, say,
                                                                              plane_results)

        async def run(client: ClusterClient) -> str:
            digest = await client.upload_release(wheel)  # again: the leader may be another one now
            if nodes_only or only:
                say(f"release {wheel.name} (sha256 {digest[:16]}...) uploaded")
            nodes = sorted(await _nodes_rejoined(client, known, seconds), key=lambda n: n.id)
            missing = set(only) - {n.id for n in nodes}
            if missing:
                return f"no such node: {', '.join(sorted(missing))} (see `llmgw ctl nodes`)"
            for n in nodes:
                if only and n.id not in only:
                    continue
                if n.version == version:
                    results.append({"node": n.id, "result": "skipped", "version": version})
                    say(f"{n.id}: already on {version}")
                    continue
                if n.state != "online":
                    results.append({"node": n.id, "result": "not online", "version": n.version})
                    return f"{n.id} is {n.state}: bring it back (or pass --node for the others) and run this again"
                ready = await _ready_on(client, n.id)
                started = time.monotonic()
                say(f"{n.id}: {n.version} -> {version}: sending and installing ...")
                try:
                    _, previous = await client.upgrade_node(n.id, wheel.name, digest, seconds)
                except ClientError as exc:
                    results.append({"node": n.id, "result": "failed", "version": n.version, "error": str(exc)})
                    return f"{n.id}: {exc}\nstopped before the next node; {n.id} still runs {n.version}"
                say(f"{n.id}: installed; waiting for it to come back with {ready} ready replica(s) ...")
                short = await _wait_back(client, n.id, version, ready, seconds)
                took = round(time.monotonic() - started, 1)
                if short:
                    results.append({"node": n.id, "result": "not back", "version": version, "previous": previous,
                                    "seconds": took, "error": short})
                    return (f"{n.id} is not back on {version} within {timeout}: {short}.\nStopped before the next "
                            f"node. An agent of {version} that has not joined by now goes back to {previous} by "
                            f"itself; one that joined but is not ready: `llmgw ctl upgrade --rollback {n.id}`")
                results.append({"node": n.id, "result": "upgraded", "version": version, "previous": previous,
                                "seconds": took})
                say(f"{n.id}: back on {version} with {ready}+ ready replica(s) in {took} s")
            return ""

        problem = planes_problem or target.run(run)
    if target.json:
        print_json({"release": version, "control_planes": plane_results, "nodes": results, "error": problem or None})
        if problem:
            ctx.exit(1)
        return
    if problem:
        fail(problem)
    click.echo(f"every node runs llmgw {version}")
