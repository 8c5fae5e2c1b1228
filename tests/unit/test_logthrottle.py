"""llmgw.logthrottle: a flood of one failure writes one line, then one per interval with a count."""

from __future__ import annotations

import logging

import pytest

import trio

from llmgw.logthrottle import MAX_REASON_CHARS, LogThrottle, is_disconnection, reason

INTERVAL = 60.0
FLOOD = 1000


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def throttle(clock: FakeClock) -> LogThrottle:
    return LogThrottle(logging.getLogger("test.logthrottle"), interval=INTERVAL, clock=clock)


def _lines(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "test.logthrottle" and r.levelno >= level]


def _boom() -> BaseException:
    try:
        raise ConnectionError("control plane unreachable")
    except ConnectionError as exc:
        return exc


def test_a_flood_within_one_interval_writes_one_line_with_its_traceback(
    throttle: LogThrottle, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    written = [throttle.failure("send", logging.WARNING, "send failed: %s", "x", exc_info=_boom()) for _ in range(FLOOD)]
    assert written.count(True) == 1
    lines = _lines(caplog)
    assert len(lines) == 1
    assert lines[0].getMessage() == "send failed: x"
    assert lines[0].exc_info is not None
    assert throttle.suppressed("send") == FLOOD - 1


def test_each_interval_writes_one_line_counting_what_it_suppressed(
    throttle: LogThrottle, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    intervals = 5
    for _ in range(intervals):
        for _ in range(FLOOD):
            throttle.failure("send", logging.WARNING, "send failed", exc_info=_boom())
            clock.now += INTERVAL / FLOOD / 2  # a whole flood spans half an interval
        clock.now += INTERVAL
    lines = _lines(caplog)
    assert len(lines) == intervals  # 1 + one per later interval, not intervals * FLOOD
    assert [r.exc_info is not None for r in lines] == [True] + [False] * (intervals - 1)
    for line in lines[1:]:
        assert line.getMessage().startswith(f"send failed (again; {FLOOD - 1} more not logged in the last ")


def test_tracebacks_after_the_first_go_to_debug_only(
    throttle: LogThrottle, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        throttle.failure("send", logging.WARNING, "send failed", exc_info=_boom())
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(_lines(caplog)) == 1
    assert len(debug) == 2 and all(r.exc_info is not None for r in debug)


def test_kinds_are_counted_apart(throttle: LogThrottle, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    for _ in range(10):
        throttle.failure(("reporter", "a"), logging.WARNING, "a failed")
        throttle.failure(("reporter", "b"), logging.WARNING, "b failed")
    assert [r.getMessage() for r in _lines(caplog)] == ["a failed", "b failed"]


def test_recovery_says_how_many_were_not_written_and_rearms(
    throttle: LogThrottle, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    for _ in range(4):
        throttle.failure("send", logging.WARNING, "send failed")
    assert throttle.recovered("send", "sending again to %s", "cp1")
    assert _lines(caplog, logging.INFO)[-1].getMessage() == "sending again to cp1 (after 3 more failures not logged)"
    assert not throttle.recovered("send", "never failed")
    assert throttle.failure("send", logging.WARNING, "send failed")


def test_remembered_kinds_are_bounded(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    throttle = LogThrottle(logging.getLogger("test.logthrottle"), interval=INTERVAL, clock=clock, max_kinds=2)
    for key in ("a", "b", "c", "a"):  # "a" was forgotten when "c" came: written again
        throttle.failure(key, logging.WARNING, "%s failed", key)
    assert [r.getMessage() for r in _lines(caplog)] == ["a failed", "b failed", "c failed", "a failed"]


def test_a_reason_is_one_bounded_line() -> None:
    remote = RuntimeError("remote exception: Traceback (most recent call last):\n  File x\nKeyError: 'shard-1'\n")
    assert reason(remote) == "KeyError: 'shard-1'"
    assert reason(ValueError()) == "ValueError"
    assert len(reason(ValueError("m" * 10_000))) == MAX_REASON_CHARS


def test_a_kj_error_reads_as_its_description_and_a_disconnection_needs_no_traceback() -> None:
    """pycapnp's KjException ends its text with KJ's 'stack: ...' trailer; the line says
    why, and a peer that went away is not logged with a traceback (is_disconnection)."""
    import capnp

    text = "capnp/rpc.c++:2779: disconnected: Peer disconnected.\nstack: 7f45 7f46"  # as logged by an agent
    disconnected = capnp.KjException(text, type="DISCONNECTED")
    assert reason(disconnected) == "capnp/rpc.c++:2779: disconnected: Peer disconnected."
    assert reason(RuntimeError("Peer disconnected.\nstack: 7f45 7f46")) == "Peer disconnected."
    assert is_disconnection(disconnected)
    assert not is_disconnection(capnp.KjException(text, type="FAILED"))
    assert is_disconnection(ConnectionResetError()) and is_disconnection(trio.BrokenResourceError())
    assert not is_disconnection(KeyError("shard-1"))
