"""A native trio backend for pycapnp.

pycapnp 2.x drives its KJ event loop from asyncio: the KJ event port asks the loop
to ``call_soon`` a KJ turn, server calls become ``asyncio.create_task`` tasks,
client calls are awaited through ``loop.create_future()``, and byte streams are
asyncio ``BufferedProtocol`` objects. pycapnp looks every one of those names up
in its module globals at call time, so this module swaps the module-global
``asyncio`` of ``capnp.lib.capnp`` for a shim whose loop is backed by trio:

* ``call_soon`` feeds a queue drained by one trio task (the "drainer");
* ``create_future`` returns a :class:`TrioFuture` whose ``__await__`` parks the
  awaiting trio task; cancelling that task cancels the future, which drops the
  KJ promise, which sends Finish to the peer (cancellation crosses the wire);
* ``create_task`` starts a :class:`TrioTask` (its own cancel scope) in the
  runtime's nursery; the peer's Finish cancels that scope, so a server method
  sees ``trio.Cancelled``;
* :mod:`llmgw.rpc.transport` adapts any ``trio.abc.Stream`` to pycapnp's protocol.

Threads other than the one running :func:`capnp_runtime` fall through to the
real asyncio, so nothing else in the process is affected.

Rules for code using this backend (each one crashes the process if broken,
see ../shared/reference/capnp-trio.md):

* always ``await`` a call inside an ``async def``; never hand a capability
  method to ``nursery.start_soon`` and never probe a promise with ``hasattr``;
* leave a null capability field unset (never assign ``None``);
* a server method copies its params into Python values before its first
  await, never swallows ``trio.Cancelled``, and never touches params or
  results after it was cancelled.
"""

from __future__ import annotations

import asyncio as _real_asyncio
import collections
import contextlib
import logging
import threading
import types
import warnings
from typing import Any, AsyncIterator, Callable, Coroutine

import trio

import capnp
from capnp.lib import capnp as _capnp_lib

from llmgw.rpc.errors import remote_failure
from llmgw.rpc.gcthread import collecting_on_this_thread
from llmgw.trioutil import unwrap_single_group

log = logging.getLogger(__name__)

#: The pycapnp release whose internals this backend was written and tested against.
TESTED_PYCAPNP_VERSION = "2.2.4"

_thread_state = threading.local()


class BackendUnavailable(RuntimeError):
    """pycapnp lacks an internal the trio backend relies on (an untested release)."""


class Handle:
    """What ``loop.call_soon`` returns: a queued callback that can be cancelled."""

    __slots__ = ("_callback", "_args", "_cancelled")

    def __init__(self, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._callback = callback
        self._args = args
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True
        self._callback = None  # type: ignore[assignment]
        self._args = ()

    def cancelled(self) -> bool:
        return self._cancelled

    def _run(self) -> None:
        if not self._cancelled:
            self._callback(*self._args)


_PENDING, _DONE, _CANCELLED = "pending", "done", "cancelled"


class _Completion:
    """State shared by :class:`TrioFuture` and :class:`TrioTask` (asyncio's Future API subset)."""

    def __init__(self, loop: TrioLoop) -> None:
        self._loop = loop
        self._state = _PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[Any], Any]] = []
        self._waiters: list[trio.lowlevel.Task] = []

    def done(self) -> bool:
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def result(self) -> Any:
        if self._state == _CANCELLED:
            raise _real_asyncio.CancelledError()
        if self._state == _PENDING:
            raise _real_asyncio.InvalidStateError("result is not set")
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self) -> BaseException | None:
        if self._state == _CANCELLED:
            raise _real_asyncio.CancelledError()
        if self._state == _PENDING:
            raise _real_asyncio.InvalidStateError("exception is not set")
        return self._exception

    def add_done_callback(self, callback: Callable[[Any], Any], *, context: Any = None) -> None:
        if self.done():
            self._loop.call_soon(callback, self)
        else:
            self._callbacks.append(callback)

    def remove_done_callback(self, callback: Callable[[Any], Any]) -> int:
        before = len(self._callbacks)
        self._callbacks = [cb for cb in self._callbacks if cb is not callback]
        return before - len(self._callbacks)

    def _complete(self, state: str, result: Any = None, exception: BaseException | None = None) -> None:
        self._state = state
        self._result = result
        self._exception = exception
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self._loop.call_soon(callback, self)
        waiters, self._waiters = self._waiters, []
        for task in waiters:
            trio.lowlevel.reschedule(task)

    async def _wait_done(self, on_abort: Callable[[], None] | None) -> None:
        """Park the calling trio task until this completes.

        If the waiting task is cancelled first, ``on_abort`` runs (a future cancels
        itself there, which is how cancellation reaches the KJ promise) and
        ``trio.Cancelled`` propagates.
        """
        if self.done():
            await trio.lowlevel.checkpoint()
            return
        task = trio.lowlevel.current_task()
        self._waiters.append(task)

        def abort(_raise_cancel: Any) -> trio.lowlevel.Abort:
            with contextlib.suppress(ValueError):
                self._waiters.remove(task)
            if on_abort is not None:
                on_abort()
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


class TrioFuture(_Completion):
    """``loop.create_future()``: what a pycapnp client call is awaited through."""

    def __init__(self, loop: TrioLoop) -> None:
        super().__init__(loop)
        # pycapnp attaches the KJ promise here to keep it alive.
        self.kjpromise: Any = None

    def set_result(self, result: Any) -> None:
        if self.done():
            raise _real_asyncio.InvalidStateError("future already done")
        self._complete(_DONE, result=result)

    def set_exception(self, exception: BaseException) -> None:
        if self.done():
            raise _real_asyncio.InvalidStateError("future already done")
        if isinstance(exception, type):
            exception = exception()
        self._complete(_DONE, exception=exception)

    def cancel(self, msg: Any = None) -> bool:
        if self.done():
            return False
        self._complete(_CANCELLED)
        return True

    def __await__(self) -> Any:
        if not self.done():
            yield from self._wait_done(self.cancel).__await__()
        return self.result()


class TrioTask(_Completion):
    """``asyncio.create_task(coro)`` for pycapnp: one server call (or connection callback).

    The coroutine runs in the runtime's nursery inside its own cancel scope. A task
    cancelled before it starts never runs its body: a Call and its Finish in the
    same KJ turn would otherwise make pycapnp read the params of a destroyed call.
    Exceptions are kept on the task as :func:`llmgw.rpc.errors.remote_failure` (pycapnp
    turns them into a remote error: one line, no traceback); they never reach the nursery.
    """

    def __init__(self, loop: TrioLoop, coro: Coroutine[Any, Any, Any]) -> None:
        super().__init__(loop)
        self._coro = coro
        self._scope = trio.CancelScope()
        self._cancel_requested = False
        # pycapnp stores its fulfiller wrapper here.
        self._fulfiller: Any = None
        loop._nursery.start_soon(self._run, name=getattr(coro, "__qualname__", "capnp-task"))

    def cancel(self, msg: Any = None) -> bool:
        if self.done():
            return False
        self._cancel_requested = True
        self._scope.cancel()
        return True

    def get_coro(self) -> Coroutine[Any, Any, Any]:
        return self._coro

    async def _run(self) -> None:
        if self._cancel_requested:
            self._coro.close()
            self._complete(_CANCELLED)
            return
        try:
            with self._scope:
                result = await self._coro
        except trio.Cancelled:
            # Not our scope: the whole runtime is going away.
            self._complete(_CANCELLED)
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to pycapnp, which reports it to the caller
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                self._complete(_DONE, exception=exc)
                raise
            # One line for the caller, never this process's traceback (llmgw.rpc.errors).
            self._complete(_DONE, exception=remote_failure(exc, getattr(self._coro, "__qualname__", "")))
            return
        if self._scope.cancelled_caught:
            self._complete(_CANCELLED)
        else:
            self._complete(_DONE, result=result)

    async def wait(self) -> None:
        """Return once the task has finished, however it finished."""
        await self._wait_done(None)


class TrioLoop:
    """The object pycapnp believes is the running asyncio loop, for one trio run."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._queue: collections.deque[Handle] = collections.deque()
        self._wakeup = trio.Event()
        self._closed = False

    # -- the asyncio loop methods pycapnp calls --------------------------------------

    def call_soon(self, callback: Callable[..., Any], *args: Any, context: Any = None) -> Handle:
        handle = Handle(callback, args)
        self._queue.append(handle)
        self._wakeup.set()
        return handle

    def create_future(self) -> TrioFuture:
        return TrioFuture(self)

    def create_task(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None, context: Any = None) -> TrioTask:
        if self._closed:
            coro.close()
            raise RuntimeError("the capnp runtime is shutting down")
        return TrioTask(self, coro)

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        log.error("capnp: %s", context.get("message", "unhandled error"), exc_info=exc)

    def get_debug(self) -> bool:
        return False

    def is_closed(self) -> bool:
        return self._closed

    # -- trio side ----------------------------------------------------------------------

    # KeyboardInterrupt-protected: pycapnp runs Python callbacks (server method dispatch,
    # done callbacks) from inside a KJ turn and turns any exception raised there into an
    # RPC error for the peer, so a Ctrl-C raised in one would be sent to the peer instead
    # of stopping this program. Protected, trio delivers it to the main task instead.
    @trio.lowlevel.enable_ki_protection
    async def _drain(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run queued callbacks (KJ turns, done callbacks) until cancelled. A Ctrl-C
        (``KeyboardInterrupt``) never interrupts a callback: trio raises it in the main task."""
        task_status.started()
        queue = self._queue
        while True:
            while queue:
                handle = queue.popleft()
                try:
                    handle._run()
                except Exception:  # noqa: BLE001 - one bad callback must not stop every connection
                    log.exception("capnp: callback failed")
            self._wakeup = trio.Event()
            if queue:
                continue
            await self._wakeup.wait()

    async def _gather(self, *aws: Any, return_exceptions: bool = False) -> list[Any]:
        results = []
        for aw in aws:
            if isinstance(aw, TrioTask):
                await aw.wait()
                if aw.cancelled():
                    results.append(_real_asyncio.CancelledError())
                elif aw._exception is not None:
                    if not return_exceptions:
                        raise aw._exception
                    results.append(aw._exception)
                else:
                    results.append(aw._result)
            else:
                try:
                    results.append(await aw)
                except Exception as exc:
                    if not return_exceptions:
                        raise
                    results.append(exc)
        return results


def _current_loop() -> TrioLoop | None:
    return getattr(_thread_state, "loop", None)


def _make_shim() -> types.ModuleType:
    shim = types.ModuleType("llmgw_asyncio_shim", "asyncio as seen by pycapnp under llmgw's trio backend")

    def get_running_loop() -> Any:
        loop = _current_loop()
        return loop if loop is not None else _real_asyncio.get_running_loop()

    def create_task(coro: Any, **kwargs: Any) -> Any:
        loop = _current_loop()
        if loop is not None:
            return loop.create_task(coro, **kwargs)
        return _real_asyncio.create_task(coro, **kwargs)

    def gather(*aws: Any, return_exceptions: bool = False) -> Any:
        loop = _current_loop()
        if loop is not None:
            return loop._gather(*aws, return_exceptions=return_exceptions)
        return _real_asyncio.gather(*aws, return_exceptions=return_exceptions)

    shim.get_running_loop = get_running_loop  # type: ignore[attr-defined]
    shim.create_task = create_task  # type: ignore[attr-defined]
    shim.gather = gather  # type: ignore[attr-defined]
    shim.iscoroutine = _real_asyncio.iscoroutine  # type: ignore[attr-defined]
    shim.BufferedProtocol = _real_asyncio.BufferedProtocol  # type: ignore[attr-defined]
    # Anything else pycapnp might look up falls through to the real module.
    shim.__getattr__ = lambda name: getattr(_real_asyncio, name)  # type: ignore[attr-defined]
    return shim


_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Point pycapnp's module-global ``asyncio`` at the trio shim (idempotent).

    Raises :class:`BackendUnavailable` if pycapnp lacks an internal this backend
    needs; warns once on a pycapnp release other than the tested one.
    """
    global _installed
    with _install_lock:
        if _installed:
            return
        missing = [
            name
            for name, ok in (
                ("capnp.lib.capnp.asyncio", "asyncio" in _capnp_lib.__dict__),
                ("capnp.AsyncIoStream._connect", hasattr(capnp.AsyncIoStream, "_connect")),
                ("capnp.kj_loop", hasattr(capnp, "kj_loop")),
                ("capnp.TwoPartyServer", hasattr(capnp, "TwoPartyServer")),
                ("capnp.TwoPartyClient", hasattr(capnp, "TwoPartyClient")),
            )
            if not ok
        ]
        if missing:
            raise BackendUnavailable(
                f"pycapnp {capnp.__version__} lacks {', '.join(missing)}; llmgw's trio backend needs "
                f"pycapnp=={TESTED_PYCAPNP_VERSION} (pip install pycapnp=={TESTED_PYCAPNP_VERSION})"
            )
        if capnp.__version__ != TESTED_PYCAPNP_VERSION:
            warnings.warn(
                f"pycapnp {capnp.__version__} is untested with llmgw's trio backend "
                f"(tested: {TESTED_PYCAPNP_VERSION}); run tests/component/test_rpc_backend.py",
                RuntimeWarning,
                stacklevel=2,
            )
        _capnp_lib.asyncio = _make_shim()
        _installed = True


@contextlib.asynccontextmanager
async def capnp_runtime() -> AsyncIterator[TrioLoop]:
    """Run pycapnp's KJ event loop inside the current trio run.

    Every capnp object (connections, capabilities, promises) must be created,
    used and released inside this block, in this thread; while it runs, cyclic
    garbage is collected only by a task of the block (:mod:`llmgw.rpc.gcthread`). On exit, open
    connections are closed, server calls still running are cancelled and waited
    for, and the KJ loop is shut down.

    Raises ``RuntimeError`` if a runtime is already active in this thread.
    """
    install()
    if _current_loop() is not None:
        raise RuntimeError("a capnp runtime is already running in this thread")
    with unwrap_single_group():
        async with trio.open_nursery() as nursery:
            loop = TrioLoop(nursery)
            _thread_state.loop = loop
            try:
                await nursery.start(loop._drain)
                # Reference cycles holding capnp objects must not be collected in
                # another thread (llmgw/rpc/gcthread.py).
                await nursery.start(collecting_on_this_thread)
                async with capnp.kj_loop():
                    yield loop
                    loop._closed = True
            finally:
                loop._closed = True
                _thread_state.loop = None
                nursery.cancel_scope.cancel()


def runtime_active() -> bool:
    """True when called inside :func:`capnp_runtime` in this thread."""
    return _current_loop() is not None
