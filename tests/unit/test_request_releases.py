"""Releases (router/http/cleanup.py): what a forwarded request holds, released last first."""

from __future__ import annotations

import pytest
import trio

from llmgw.router.http.cleanup import Releases


async def test_callbacks_run_last_registered_first_and_once() -> None:
    ran: list[str] = []

    async def close(name: str) -> None:
        await trio.lowlevel.checkpoint()
        ran.append(name)

    releases = Releases()
    releases.callback(ran.append, "ticket")
    releases.push_async_callback(close, "response")
    releases.callback(ran.append, "lease")
    await releases.aclose()
    assert ran == ["lease", "response", "ticket"]
    await releases.aclose()  # nothing left to run
    assert ran == ["lease", "response", "ticket"]


async def test_every_callback_runs_and_the_last_error_is_raised_with_the_earlier_as_context() -> None:
    ran: list[str] = []

    def fail(message: str) -> None:
        ran.append(message)
        raise RuntimeError(message)

    releases = Releases()
    releases.callback(ran.append, "first")
    releases.callback(fail, "second")
    releases.callback(fail, "third")
    with pytest.raises(RuntimeError, match="second") as raised:
        await releases.aclose()
    assert ran == ["third", "second", "first"]
    assert isinstance(raised.value.__context__, RuntimeError)
    assert str(raised.value.__context__) == "third"


async def test_async_callbacks_are_awaited_when_the_request_is_cancelled() -> None:
    ran: list[str] = []

    async def close_shielded() -> None:
        with trio.CancelScope(shield=True):
            await trio.lowlevel.checkpoint()
        ran.append("closed")

    releases = Releases()
    releases.push_async_callback(close_shielded)
    releases.callback(ran.append, "lease")
    with trio.CancelScope() as scope:
        scope.cancel()
        await releases.aclose()
    assert ran == ["lease", "closed"]
