"""A failed server call reaches its caller as one line, never as the server's traceback."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator

import capnp
import pytest
import trio
import trio.testing

from llmgw.rpc.connection import open_client, serve_stream
from llmgw.rpc.errors import INTERNAL_ERROR, MAX_REMOTE_MESSAGE, TIMED_OUT, remote_reason
from llmgw.rpc.kjtrio import capnp_runtime
from tests.component.rpc_echo import EchoImpl, load_schema

schema = load_schema()


class OwnError(Exception):
    """Stands in for an llmgw exception class (defined under the llmgw package)."""


OwnError.__module__ = "llmgw.control.store.base"


def _chained() -> Exception:
    try:
        raise OSError("the disk under /var/lib/llmgw is full")
    except OSError as exc:
        try:
            raise ValueError("cannot record shard m-1") from exc
        except ValueError as outer:
            return outer


#: (what the server method raises, what the caller reads).
EXPECTED = [
    (ValueError("profile.engine_args[0]: --log-file is not allowed"),
     "profile.engine_args[0]: --log-file is not allowed"),
    (KeyError("unknown shard 'm-1'"), "unknown shard 'm-1'"),
    (LookupError("no replica 'x' on a connected node"), "no replica 'x' on a connected node"),
    (OSError(28, "No space left on device"), "[Errno 28] No space left on device"),
    (RuntimeError("this agent does not manage engine installs"), "this agent does not manage engine installs"),
    (OwnError("model 'm' already exists"), "model 'm' already exists"),
    (ValueError("line one\n  line two\n"), "line one; line two"),
    (_chained(), "cannot record shard m-1"),
    (ExceptionGroup("nursery", [ValueError("the only one")]), "the only one"),
    (trio.TooSlowError(), TIMED_OUT),
    (ValueError("x" * 10 * MAX_REMOTE_MESSAGE), "x" * (MAX_REMOTE_MESSAGE - 3) + "..."),
]
#: Programming errors: the caller reads an id, the server's log has the traceback.
UNEXPECTED = [TypeError("unsupported operand"), AttributeError("'NoneType' has no attribute 'id'"),
              AssertionError(), IndexError("list index out of range"), NotImplementedError("todo")]


@contextlib.asynccontextmanager
async def raising(exc: BaseException) -> AsyncIterator[Any]:
    """Serves an Echo whose ``fail`` raises ``exc``; yields the client's Echo."""
    impl = EchoImpl(schema)

    async def fail(message: str, **_: Any) -> None:
        raise exc

    impl.fail = fail
    a, b = trio.testing.memory_stream_pair()
    async with capnp_runtime(), trio.open_nursery() as nursery:
        nursery.start_soon(serve_stream, a, impl)
        async with open_client(b) as client:
            yield client.bootstrap().cast_as(schema.Echo)
        nursery.cancel_scope.cancel()


async def failure_of(exc: BaseException) -> capnp.KjException:
    async with raising(exc) as echo:
        with trio.fail_after(10), pytest.raises(capnp.KjException) as info:
            await echo.fail("")
    return info.value


@pytest.mark.parametrize(("exc", "message"), EXPECTED, ids=lambda v: type(v).__name__)
async def test_expected_errors_reach_the_caller_as_their_own_line(exc: BaseException, message: str) -> None:
    failure = await failure_of(exc)
    assert remote_reason(failure) == message
    assert "Traceback" not in failure.description and "File " not in failure.description
    assert len(failure.description.strip().splitlines()) == 1


@pytest.mark.parametrize("exc", UNEXPECTED, ids=lambda v: type(v).__name__)
async def test_unexpected_errors_name_an_id_whose_traceback_is_logged(
    exc: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="llmgw.rpc.errors"):
        failure = await failure_of(exc)
    reason = remote_reason(failure)
    prefix, _, rest = INTERNAL_ERROR.partition("{id}")
    assert reason.startswith(prefix) and reason.endswith(rest), reason
    error_id = reason[len(prefix): len(reason) - len(rest)]
    assert str(exc) not in failure.description or not str(exc)
    (record,) = [r for r in caplog.records if error_id in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[1] is exc


OLD_PEER = (
    "remote exception: message = Traceback (most recent call last):\n"
    '  File "/srv/llmgw/node/agent.py", line 96, in startShard\n'
    "    await supervisor.start_shard(shard_spec, RemoteReporter(reporter))\n"
    "llmgw.node.engines.EngineRefused: shard m-1: refused on this node: engine_env.LD_PRELOAD: not allowed\n"
)


@pytest.mark.parametrize(
    ("description", "reason"),
    [
        (OLD_PEER, "shard m-1: refused on this node: engine_env.LD_PRELOAD: not allowed"),
        ("remote exception: message = llmgw.rpc.errors.RemoteError: conflict: model exists\n",
         "conflict: model exists"),
        ("Peer disconnected.", "Peer disconnected."),
        ("", "FAILED"),
    ],
)
def test_remote_reason_reads_new_and_old_peers(description: str, reason: str) -> None:
    exc = capnp.KjException(message=description, type="FAILED")
    assert remote_reason(exc) == reason
