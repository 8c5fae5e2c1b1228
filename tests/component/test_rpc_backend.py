"""The native trio backend for pycapnp (llmgw.rpc.kjtrio): run these before any pycapnp upgrade."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import capnp
import pytest
import trio
import trio.testing

from llmgw.rpc.connection import open_client, serve_stream
from llmgw.rpc.kjtrio import TrioLoop, TrioTask, capnp_runtime
from tests.component.rpc_echo import EchoImpl, load_schema

schema = load_schema()
ROOT = Path(__file__).resolve().parents[2]
# Bounds each wait in these tests so a broken backend fails instead of hanging the suite.
HANG_GUARD = 20


@contextlib.asynccontextmanager
async def memory_pair(impl: Any) -> AsyncIterator[Any]:
    """Serve ``impl`` over an in-memory stream pair; yields the client's bootstrap Echo."""
    a, b = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_stream, a, impl)
        async with open_client(b) as client:
            yield client.bootstrap().cast_as(schema.Echo)
        nursery.cancel_scope.cancel()


async def wait_until(predicate: Any) -> None:
    """Yield to the scheduler until ``predicate()`` holds (bounded by HANG_GUARD)."""
    with trio.fail_after(HANG_GUARD):
        while not predicate():
            await trio.sleep(0)


async def test_basic_call_and_remote_error() -> None:
    async with capnp_runtime(), memory_pair(EchoImpl(schema)) as echo:
        assert (await echo.echo("hello")).text == "HELLO"
        with pytest.raises(capnp.KjException) as info:
            await echo.fail("bad input")
        assert info.value.type == "FAILED"
        assert "bad input" in info.value.description


async def test_capabilities_both_ways() -> None:
    class Doubler(schema.Callback.Server):
        async def call(self, value: int, **_: Any) -> int:
            return value * 2

    async with capnp_runtime(), memory_pair(EchoImpl(schema)) as echo:
        # The client hands the server a capability; the server calls back through it.
        assert (await echo.callback(Doubler(), 20)).result == 41
        # The server hands out a new capability.
        child = (await echo.child("kid")).child
        assert (await child.name()).name == "kid"


async def test_pipelining() -> None:
    async with capnp_runtime(), memory_pair(EchoImpl(schema)) as echo:
        # Call a method on a capability that has not been returned yet.
        grandchild = echo.child("a").child.child("b").child
        assert (await grandchild.name()).name == "b"


async def test_client_cancellation_cancels_server_method() -> None:
    impl = EchoImpl(schema)
    async with capnp_runtime(), memory_pair(impl) as echo:
        async with trio.open_nursery() as nursery:

            async def call() -> None:
                await echo.hang("x")

            nursery.start_soon(call)
            with trio.fail_after(HANG_GUARD):
                await impl.hang_entered.wait()
            nursery.cancel_scope.cancel()
        await wait_until(lambda: impl.cancelled == 1)
        assert impl.hanging == 0
        assert (await echo.echo("still usable")).text == "STILL USABLE"


async def test_cancellation_crosses_back_through_a_callback() -> None:
    """Cancel the outer call: the server's pending call to the client's capability is cancelled too."""
    callback_cancelled = trio.Event()
    callback_entered = trio.Event()

    class Stuck(schema.Callback.Server):
        async def call(self, value: int, **_: Any) -> int:
            callback_entered.set()
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                callback_cancelled.set()
                raise
            return 0  # pragma: no cover

    async with capnp_runtime(), memory_pair(EchoImpl(schema)) as echo:
        with trio.move_on_after(HANG_GUARD) as guard:
            async with trio.open_nursery() as nursery:

                async def call() -> None:
                    await echo.callback(Stuck(), 1)

                nursery.start_soon(call)
                await callback_entered.wait()
                nursery.cancel_scope.cancel()
            await callback_cancelled.wait()
        assert not guard.cancelled_caught


async def test_500_in_flight_calls_cancelled_at_once() -> None:
    impl = EchoImpl(schema)
    async with capnp_runtime(), memory_pair(impl) as echo:
        async with trio.open_nursery() as nursery:
            for i in range(500):

                async def call(i: int = i) -> None:
                    await echo.hang(str(i))

                nursery.start_soon(call)
            await wait_until(lambda: impl.hanging == 500)
            nursery.cancel_scope.cancel()
        await wait_until(lambda: impl.cancelled == 500 and impl.hanging == 0)
        assert (await echo.echo("ok")).text == "OK"


async def test_cancelled_before_start_never_runs_body() -> None:
    """Regression: a Call and its Finish in the same KJ turn used to crash pycapnp (use-after-free)."""
    async with capnp_runtime() as loop:
        ran = []

        async def body() -> None:
            ran.append(True)

        task = loop.create_task(body())
        assert isinstance(task, TrioTask)
        task.cancel()
        await task.wait()
        assert task.cancelled()
        assert ran == []


async def test_call_cancelled_before_it_is_sent_is_harmless() -> None:
    """The Call and the Finish leave in one write; the server must not crash or run a stale body."""
    impl = EchoImpl(schema)
    async with capnp_runtime(), memory_pair(impl) as echo:
        for _ in range(200):
            with trio.CancelScope() as scope:
                scope.cancel()
                await echo.hang("never")
        await wait_until(lambda: impl.hanging == 0)
        assert (await echo.echo("alive")).text == "ALIVE"


async def test_16_mib_message() -> None:
    payload = os.urandom(16 * 1024 * 1024 - 1024)
    async with capnp_runtime(), memory_pair(EchoImpl(schema)) as echo:
        assert (await echo.blob(payload)).size == len(payload)
        assert (await echo.echo("after")).text == "AFTER"


async def test_many_tcp_connections() -> None:
    impl_count = 0

    async with capnp_runtime():
        async def handler(stream: trio.SocketStream) -> None:
            nonlocal impl_count
            impl_count += 1
            await serve_stream(stream, EchoImpl(schema, f"conn{impl_count}"))

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            results: list[str] = []

            async def one_client(i: int) -> None:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with open_client(stream) as client:
                    echo = client.bootstrap().cast_as(schema.Echo)
                    for j in range(5):
                        results.append((await echo.echo(f"c{i}-{j}")).text)

            with trio.fail_after(HANG_GUARD * 3):
                async with trio.open_nursery() as clients:
                    for i in range(40):
                        clients.start_soon(one_client, i)
            nursery.cancel_scope.cancel()
    assert sorted(results) == sorted(f"C{i}-{j}" for i in range(40) for j in range(5))
    assert impl_count == 40


async def test_clean_shutdown_with_calls_in_flight() -> None:
    """The serving side goes away with calls running: they are cancelled, the client's calls fail."""
    impl = EchoImpl(schema)
    errors: list[BaseException] = []
    async with capnp_runtime():
        a, b = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as outer:
            server_scope = trio.CancelScope()

            async def server() -> None:
                with server_scope:
                    await serve_stream(a, impl)

            outer.start_soon(server)
            async with open_client(b) as client:
                echo = client.bootstrap().cast_as(schema.Echo)
                async with trio.open_nursery() as calls:
                    for i in range(20):

                        async def call(i: int = i) -> None:
                            try:
                                await echo.hang(str(i))
                            except capnp.KjException as exc:
                                errors.append(exc)

                        calls.start_soon(call)
                    await wait_until(lambda: impl.hanging == 20)
                    server_scope.cancel()
    assert impl.cancelled == 20
    assert len(errors) == 20
    assert all(e.type == "DISCONNECTED" for e in errors)


@contextlib.asynccontextmanager
async def peer_process() -> AsyncIterator[tuple[subprocess.Popen[str], int]]:
    """Start tests/component/rpc_peer.py; yields (process, port) and kills it on exit."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/component/rpc_peer.py")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = await trio.to_thread.run_sync(proc.stdout.readline)
        assert line.startswith("port "), line
        yield proc, int(line.split()[1])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


async def test_killed_peer_fails_pending_calls() -> None:
    async with capnp_runtime(), peer_process() as (proc, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with open_client(stream) as client:
            echo = client.bootstrap().cast_as(schema.Echo)
            assert (await echo.echo("up")).text == "UP"
            errors: list[capnp.KjException] = []
            with trio.fail_after(HANG_GUARD):
                async with trio.open_nursery() as nursery:
                    for i in range(10):

                        async def call(i: int = i) -> None:
                            try:
                                await echo.hang(str(i))
                            except capnp.KjException as exc:
                                errors.append(exc)

                        nursery.start_soon(call)
                    # Let the calls reach the peer, then kill it.
                    assert (await echo.echo("sync")).text == "SYNC"
                    proc.kill()
            assert len(errors) == 10 and all(e.type == "DISCONNECTED" for e in errors)
            # Later calls on its capabilities fail too, at once.
            with pytest.raises(capnp.KjException) as info:
                with trio.fail_after(HANG_GUARD):
                    await echo.echo("gone")
            assert info.value.type == "DISCONNECTED"


async def test_hung_peer_is_caught_by_a_deadline() -> None:
    """Cap'n Proto has no keepalive: a stopped peer leaves calls pending, so every call carries a deadline."""
    async with capnp_runtime(), peer_process() as (proc, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with open_client(stream) as client:
            echo = client.bootstrap().cast_as(schema.Echo)
            assert (await echo.echo("up")).text == "UP"
            os.kill(proc.pid, signal.SIGSTOP)
            with pytest.raises(trio.TooSlowError):
                with trio.fail_after(0.5):
                    await echo.echo("anyone?")
            os.kill(proc.pid, signal.SIGCONT)
            # The connection recovers once the peer runs again.
            with trio.fail_after(HANG_GUARD):
                assert (await echo.echo("back")).text == "BACK"


async def test_runtime_refuses_nesting() -> None:
    async with capnp_runtime():
        with pytest.raises(RuntimeError, match="already running"):
            async with capnp_runtime():
                pass  # pragma: no cover


def test_loop_object_is_not_visible_outside_the_runtime() -> None:
    async def main() -> TrioLoop | None:
        from llmgw.rpc import kjtrio

        async with capnp_runtime():
            inside = kjtrio._current_loop()
        assert kjtrio._current_loop() is None
        return inside

    assert isinstance(trio.run(main), TrioLoop)
