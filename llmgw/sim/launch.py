"""Start ``python -m llmgw.sim`` as a child process and wait until it listens (for tests, demos, benchmarks).

Readiness is the engine's own listening line on stderr, never a sleep. stderr
is drained by a daemon thread for the process's whole life (so a chatty engine
can never block on a full pipe) and kept in :attr:`SimProcess.stderr_lines`.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from typing import Mapping, Sequence

#: What the engine prints once listening; the port is taken from it.
LISTENING_RE = re.compile(r"llmgw-sim: serving .* on http://(?P<host>[^:]+):(?P<port>\d+)")
#: Seconds to wait for the listening line (a loaded 2-core machine starts Python slowly).
DEFAULT_START_TIMEOUT_S = 30.0
#: Seconds to wait for exit after SIGTERM before SIGKILL.
DEFAULT_STOP_TIMEOUT_S = 10.0


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free a moment ago (for endpoints the engine must bind itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SimProcess:
    """A running simulated engine. Use as a context manager, or call :meth:`stop`."""

    def __init__(self, proc: subprocess.Popen[str], lines: "queue.Queue[str | None]") -> None:
        self.proc = proc
        self.stderr_lines: list[str] = []
        self._lines = lines
        self.host = ""
        self.port = 0

    @property
    def url(self) -> str:
        """Return the base URL, e.g. ``http://127.0.0.1:PORT``."""
        return f"http://{self.host}:{self.port}"

    def wait_listening(self, timeout: float) -> None:
        """Block until the listening line appears. Raises RuntimeError (with stderr) if the process exits or times out."""
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                self.stop()
                raise RuntimeError(f"llmgw.sim did not listen within {timeout}s; stderr:\n{''.join(self.stderr_lines)}") from None
            if line is None:
                rc = self.proc.wait()
                raise RuntimeError(f"llmgw.sim exited with status {rc} before listening; stderr:\n{''.join(self.stderr_lines)}")
            self.stderr_lines.append(line)
            m = LISTENING_RE.search(line)
            if m:
                self.host, self.port = m.group("host"), int(m.group("port"))
                return

    def drain(self) -> str:
        """Return all stderr read so far (including lines after the listening line)."""
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.stderr_lines.append(line)
        return "".join(self.stderr_lines)

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; return the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def __enter__(self) -> "SimProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_sim(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_START_TIMEOUT_S,
    wait: bool = True,
) -> SimProcess:
    """Start ``python -m llmgw.sim ARGS`` and return it once listening (``--port 0`` is fine).

    ``env`` replaces the environment (default: this process's). With
    ``wait=False`` returns at once (call :meth:`SimProcess.wait_listening`).
    Raises RuntimeError with the engine's stderr if it exits or times out first.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw.sim", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ if env is None else env),
    )
    lines: "queue.Queue[str | None]" = queue.Queue()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name="llmgw-sim-stderr", daemon=True).start()
    sim = SimProcess(proc, lines)
    if wait:
        sim.wait_listening(timeout)
    return sim
