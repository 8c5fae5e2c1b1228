"""The gateway workers' front (llmgw/router/workers/worker.py ``WorkerFront``) tags every
response with ``x-llmgw-worker``, also those that start through the server's body sink
instead of the ASGI ``send``: whole answers (``respond``) and streams (``start``).

The server's sink is faked here (a recorder): the lane's own sink is tested on real sockets
in tests/component/test_h1lane.py, and the workers' tag end to end in
tests/component/test_gateway_workers.py.
"""

from __future__ import annotations

from typing import Any, Mapping

from llmgw.router.http.extensions import BODY_SINK_KEY
from llmgw.router.workers.worker import WORKER_HEADER, WorkerFront

TAG = WORKER_HEADER.decode()


class RecordingSink:
    """What a server's sink was asked to send, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def send_piece(self, body: bytes) -> None:
        self.calls.append(("piece", body))

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        self.calls.append(("start", (status, dict(headers))))

    def flush(self) -> None:
        self.calls.append(("flush", None))

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.calls.append(("respond", (status, dict(headers), body)))


async def run_front(app: Any) -> RecordingSink:
    """Run ``app`` behind worker 3's front for one POST; return the sink it was given."""
    sink = RecordingSink()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [],
             "extensions": {BODY_SINK_KEY: sink}}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError(f"the app sent {message['type']} through send, not the sink")

    async def no_scrape() -> bytes | None:
        return None

    await WorkerFront(app, 3, no_scrape)(scope, receive, send)
    return sink


async def test_a_stream_started_through_the_sink_is_tagged() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        sink = scope["extensions"][BODY_SINK_KEY]
        await sink.start(200, {"content-type": "text/event-stream"})
        sink.flush()
        sink.send_piece(b"data: 1\n\n")

    sink = await run_front(app)
    assert sink.calls == [
        ("start", (200, {"content-type": "text/event-stream", TAG: "3"})),
        ("flush", None),
        ("piece", b"data: 1\n\n"),
    ]


async def test_a_whole_answer_through_the_sink_is_tagged() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await scope["extensions"][BODY_SINK_KEY].respond(200, {"content-type": "application/json"}, b"{}")

    sink = await run_front(app)
    assert sink.calls == [("respond", (200, {"content-type": "application/json", TAG: "3"}, b"{}"))]
