"""Usage survives kill -9 of the server (issue 12): a bounded load loop, the server killed in
the middle of it, started again on the same store, and the stored usage is exactly what the
clients were answered, give or take only the requests in flight at the kill.

Real processes on loopback. A single-process gateway with a flush interval of an hour:
nothing reaches the store before the kill but through the journal replayed at the restart.
Two gateway workers with a short interval: the kill waits for a flush (read from the SQLite
file), so the workers' journal marks travel through the pool's master to the store, and
the replay must add only what the flushes had not stored. No timing is asserted.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from llmgw.config.defaults import DEFAULT_SQLITE_NAME
from tests.system.harness import WAIT, Cluster, eventually, serve_sim_model

pytestmark = pytest.mark.system

#: Concurrent clients: at most this many requests are in flight when the server is killed.
CLIENTS = 4
#: Kill the server once the clients were answered this many times ...
ANSWERED_BEFORE_KILL = 40
#: ... and never send more than this many per client (the loop is bounded).
MAX_REQUESTS_PER_CLIENT = 200
MAX_TOKENS = 3


@attrs.define
class Tally:
    """Answers the clients got, in full, and the usage they reported; requests cut by the kill."""

    answered: int = 0
    usages: set[tuple[int, int]] = attrs.field(factory=set)  # (prompt, completion) tokens seen
    cut: int = 0
    changed: trio.Event = attrs.field(factory=trio.Event)

    def note(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


def body(index: int) -> dict[str, Any]:
    # The same prompt for everyone: every answer reports the same usage.
    request: dict[str, Any] = {"model": "m1", "prompt": "usage drill", "max_tokens": MAX_TOKENS}
    if index % 2:
        request.update(stream=True, stream_options={"include_usage": True})
    return request


async def one_request(http: httpx.AsyncClient, index: int, tally: Tally) -> bool:
    """Send one request; count it answered (with its usage) or cut. Return False once cut."""
    usage: dict[str, int] | None = None
    try:
        async with http.stream("POST", "/v1/completions", json=body(index)) as response:
            if response.status_code != 200:
                raise AssertionError(f"status {response.status_code}: {(await response.aread())[:300]!r}")
            if index % 2:
                done = False
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and '"usage"' in line:
                        usage = json.loads(line[6:]).get("usage") or usage
                if not done:
                    raise httpx.RemoteProtocolError("stream ended without [DONE]")
            else:
                usage = json.loads(await response.aread())["usage"]
    except httpx.HTTPError:
        tally.cut += 1
        tally.note()
        return False
    assert usage is not None, "every answer carries its usage"
    tally.answered += 1
    tally.usages.add((usage["prompt_tokens"], usage["completion_tokens"]))
    tally.note()
    return True


async def client_loop(gateway: str, index: int, tally: Tally) -> None:
    """One client: requests one after another until one is cut (the server is gone)."""
    async with httpx.AsyncClient(base_url=gateway, timeout=WAIT) as http:
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if not await one_request(http, index, tally):
                return


def flushed_requests(cluster: Cluster) -> int:
    """Return the requests the server's SQLite store holds now (read beside the server)."""
    with contextlib.closing(sqlite3.connect(f"file:{cluster.server_dir / DEFAULT_SQLITE_NAME}?mode=ro",
                                            uri=True, timeout=WAIT)) as db:
        return db.execute("SELECT COALESCE(SUM(requests), 0) FROM usage").fetchone()[0]


def stored_usage(cluster: Cluster) -> tuple[int, int, int]:
    rows = [u for u in cluster.ctl_json("usage") if u["model"] == "m1"]
    return (sum(u["requests"] for u in rows), sum(u["prompt_tokens"] for u in rows),
            sum(u["completion_tokens"] for u in rows))


@pytest.mark.parametrize(("flushes", "workers"), [(False, 1), (True, 2)],
                         ids=["one-gateway-no-flush", "two-workers-flushing"])
async def test_server_kill_loses_only_the_requests_in_flight(tmp_path: Path, flushes: bool, workers: int) -> None:
    extra = {"serving": {"usage_flush_interval": "0.2s" if flushes else "1h"}, "gateway": {"workers": workers}}
    async with Cluster(tmp_path, extra=extra) as cluster:
        server = await serve_sim_model(cluster)
        tally = Tally()
        async with trio.open_nursery() as nursery:
            for index in range(CLIENTS):
                nursery.start_soon(client_loop, cluster.gateway, index, tally)
            with trio.fail_after(WAIT):
                while tally.answered < ANSWERED_BEFORE_KILL:
                    await tally.changed.wait()
            if flushes:  # the kill comes after a flush: the replay adds only what it did not store
                await eventually(lambda: trio.to_thread.run_sync(flushed_requests, cluster), "a usage flush")
            server.kill()  # SIGKILL: no last flush, no clean close of anything
        assert tally.cut <= CLIENTS

        await cluster.start_server()
        requests, prompt_tokens, completion_tokens = stored_usage(cluster)
        # Requests in flight at the kill: those cut, and those answered just before it but
        # not yet counted by the gateway (at most one per client in all).
        assert tally.answered - CLIENTS <= requests <= tally.answered + tally.cut, (requests, tally)
        # Every stored request is one of these identical ones: its tokens are exact too.
        [(prompt, completion)] = tally.usages
        assert (prompt_tokens, completion_tokens) == (prompt * requests, completion * requests)
        # Nothing is counted twice by a later start either.
        cluster.server.kill()
        await cluster.start_server()
        assert stored_usage(cluster) == (requests, prompt_tokens, completion_tokens)
        assert list((cluster.server_dir / "usage-journal").iterdir()) == []
