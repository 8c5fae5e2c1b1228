"""A tiny stand-in inference engine for supervisor tests (standard library only).

    python fake_engine.py --host H --port P [options]

GET /health answers --health-status (default 200). POST /crash?code=N prints a last
line and exits with code N at once; POST /health-status?code=N changes what /health
answers from then on. Options make it misbehave on purpose:
--lines N prints N numbered lines at start, --ignore-term ignores SIGTERM,
--spawn-child starts a grandchild that ignores SIGTERM (and prints its pid),
--exit-at-start N prints a last line and exits with code N before listening.
"""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import subprocess
import sys
import urllib.parse

GRANDCHILD = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(60)\n"


def say(line: str) -> None:
    print(f"fake-engine[{os.getpid()}]: {line}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--lines", type=int, default=0)
    parser.add_argument("--health-status", type=int, default=200)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--spawn-child", action="store_true")
    parser.add_argument("--exit-at-start", type=int, default=None)
    opts = parser.parse_args()

    for i in range(opts.lines):
        say(f"line {i}")
    if opts.exit_at_start is not None:
        say(f"fatal: cannot load model {opts.model} (exit {opts.exit_at_start})")
        sys.exit(opts.exit_at_start)
    if opts.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        def on_term(signum: int, frame: object) -> None:
            say("got SIGTERM, exiting")
            os._exit(0)

        signal.signal(signal.SIGTERM, on_term)
    if opts.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", GRANDCHILD])
        say(f"grandchild pid {child.pid}")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(opts.health_status, b"ok" if opts.health_status == 200 else b"not ready")
            else:
                self._reply(404, b"no such path")

        def do_POST(self) -> None:
            url = urllib.parse.urlparse(self.path)
            if url.path == "/crash":
                code = int(urllib.parse.parse_qs(url.query).get("code", ["3"])[0])
                say(f"last words: crashing with code {code}")
                os._exit(code)
            if url.path == "/health-status":
                opts.health_status = int(urllib.parse.parse_qs(url.query)["code"][0])
                say(f"health now answers {opts.health_status}")
                self._reply(200, b"ok")
                return
            self._reply(404, b"no such path")

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # health polls would flood the log
            pass

    server = http.server.ThreadingHTTPServer((opts.host, opts.port), Handler)
    say(f"listening on {opts.host}:{opts.port} model {opts.model}")
    server.serve_forever()


if __name__ == "__main__":
    main()
