"""fetch_weights against a real HTTP server on 127.0.0.1 that mimics the Hugging Face API.

The server lists a repository at /api/models/{repo}/revision/{rev} and serves files at
/{repo}/resolve/{commit}/{path} with Range support. Per file it can cut the connection
after some bytes (an interrupted transfer), stall after some bytes until released (to
cancel mid-file), pause after some bytes until released (a slow first fetch that a second
one waits for), or serve different bytes than it lists (a sha256 mismatch).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path
from typing import Iterator

import attrs
import pytest
import trio

from llmgw.node.fetch import COMPLETE_MARKER, FetchError, FetchSettings, cached_path, fetch_adapters, fetch_weights
from llmgw.spec import Adapter

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@attrs.define
class Hub:
    """The fake hub's content and fault switches (read by the server thread)."""

    files: dict[str, bytes] = attrs.Factory(dict)
    listed_sha: dict[str, str] = attrs.Factory(dict)  # overrides the published sha256
    cut_after: dict[str, int] = attrs.Factory(dict)  # path -> bytes sent before dropping (once)
    stall_after: dict[str, int] = attrs.Factory(dict)  # path -> bytes sent before waiting on release
    pause_after: dict[str, int] = attrs.Factory(dict)  # path -> bytes sent before waiting on release, then the rest
    release: threading.Event = attrs.Factory(threading.Event)
    ranges: list[tuple[str, str]] = attrs.Factory(list)  # (path, Range header or "") per file request
    url: str = ""


def _handler(hub: Hub) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path.startswith("/api/models/"):
                repo = path[len("/api/models/") :].split("/revision/")[0]
                if repo != "org/tiny":
                    self._send(404, b"{}")
                    return
                siblings = [
                    {
                        "rfilename": name,
                        "size": len(data),
                        "lfs": {"sha256": hub.listed_sha.get(name, hashlib.sha256(data).hexdigest()), "size": len(data)},
                    }
                    for name, data in hub.files.items()
                ]
                self._send(200, json.dumps({"sha": COMMIT, "siblings": siblings}).encode())
                return
            prefix = f"/org/tiny/resolve/{COMMIT}/"
            name = path[len(prefix) :] if path.startswith(prefix) else ""
            if name not in hub.files:
                self._send(404, b"not found")
                return
            data = hub.files[name]
            header = self.headers.get("Range", "")
            hub.ranges.append((name, header))
            start = int(header[len("bytes=") :].split("-")[0]) if header else 0
            body = data[start:]
            self.send_response(206 if header else 200)
            self.send_header("Content-Length", str(len(body)))
            if header:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if name in hub.cut_after:
                self.wfile.write(body[: hub.cut_after.pop(name)])
                self.wfile.flush()
                self.close_connection = True
                return
            if name in hub.pause_after:
                self.wfile.write(body[: hub.pause_after[name]])
                self.wfile.flush()
                hub.release.wait(30)
                self.wfile.write(body[hub.pause_after[name] :])
                return
            if name in hub.stall_after:
                self.wfile.write(body[: hub.stall_after[name]])
                self.wfile.flush()
                hub.release.wait(30)
                self.close_connection = True
                return
            self.wfile.write(body)

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


@pytest.fixture
def hub() -> Iterator[Hub]:
    state = Hub()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()


def _settings(tmp_path: Path, hub: Hub) -> FetchSettings:
    return FetchSettings(weights_dir=tmp_path / "weights", hf_endpoint=hub.url)


def _repo_dir(tmp_path: Path) -> Path:
    return tmp_path / "weights" / "hf" / "org" / "tiny" / COMMIT


async def test_repository_fetched_with_progress_and_reused(tmp_path: Path, hub: Hub) -> None:
    hub.files = {"config.json": b"{}" * 100, "model.safetensors": b"w" * 300_000}
    messages: list[str] = []
    path = await fetch_weights("hf://org/tiny", _settings(tmp_path, hub), messages.append)
    assert path == _repo_dir(tmp_path)
    assert (path / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
    assert (path / COMPLETE_MARKER).exists()
    assert messages[0] == "fetching weights: 0.0/300.2 kB"
    assert messages[-1] == "fetching weights: 300.2/300.2 kB"
    requests = len(hub.ranges)
    again = await fetch_weights(f"{hub.url}/org/tiny", _settings(tmp_path, hub))  # the page URL form
    assert again == path
    assert len(hub.ranges) == requests  # complete: nothing downloaded again


async def test_interrupted_transfer_resumes_with_range(tmp_path: Path, hub: Hub) -> None:
    data = bytes(range(256)) * 2000
    hub.files = {"model.safetensors": data}
    hub.cut_after = {"model.safetensors": 100_000}
    with pytest.raises(FetchError, match="resumes"):
        await fetch_weights("hf://org/tiny", _settings(tmp_path, hub))
    partial = _repo_dir(tmp_path) / "model.safetensors.partial"
    assert partial.stat().st_size == 100_000
    assert not (_repo_dir(tmp_path) / "model.safetensors").exists()
    path = await fetch_weights("hf://org/tiny", _settings(tmp_path, hub))
    assert (path / "model.safetensors").read_bytes() == data
    assert hub.ranges[-1] == ("model.safetensors", "bytes=100000-")
    assert not partial.exists()


async def test_sha256_mismatch_refused_and_nothing_looks_complete(tmp_path: Path, hub: Hub) -> None:
    hub.files = {"model.safetensors": b"x" * 5000}
    hub.listed_sha = {"model.safetensors": "0" * 64}
    with pytest.raises(FetchError, match="sha256 .* does not match"):
        await fetch_weights("hf://org/tiny", _settings(tmp_path, hub))
    repo = _repo_dir(tmp_path)
    assert not (repo / "model.safetensors").exists()
    assert not (repo / "model.safetensors.partial").exists()
    assert not (repo / COMPLETE_MARKER).exists()


async def test_cancellation_mid_file_leaves_only_a_partial(tmp_path: Path, hub: Hub) -> None:
    hub.files = {"a.bin": b"a" * 1000, "model.safetensors": b"m" * 200_000}
    hub.stall_after = {"model.safetensors": 50_000}
    settings = _settings(tmp_path, hub)
    partial = _repo_dir(tmp_path) / "model.safetensors.partial"
    with trio.move_on_after(30) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch_weights, "hf://org/tiny", settings)
            while not (partial.exists() and partial.stat().st_size >= 50_000):
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert not scope.cancelled_caught, "the fetch never got 50 kB into the file"
    assert (_repo_dir(tmp_path) / "a.bin").exists()
    assert not (_repo_dir(tmp_path) / "model.safetensors").exists()
    assert not (_repo_dir(tmp_path) / COMPLETE_MARKER).exists()
    hub.release.set()
    del hub.stall_after["model.safetensors"]
    path = await fetch_weights("hf://org/tiny", settings)
    assert (path / "model.safetensors").read_bytes() == hub.files["model.safetensors"]


async def test_concurrent_fetch_waits_for_the_first_and_reuses_its_download(tmp_path: Path, hub: Hub) -> None:
    hub.files = {"config.json": b"{}", "model.safetensors": b"m" * 200_000}
    hub.pause_after = {"model.safetensors": 50_000}
    settings = _settings(tmp_path, hub)
    second_said: list[str] = []
    paths: list[Path] = []
    first_holds_lock, second_waits = trio.Event(), trio.Event()

    async def fetch(said: list[str], event: trio.Event) -> None:
        def progress(message: str) -> None:
            said.append(message)
            event.set()  # the first one reports only once it holds the lock; the second, that it waits

        paths.append(await fetch_weights("hf://org/tiny", settings, progress))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch, [], first_holds_lock)
            await first_holds_lock.wait()
            nursery.start_soon(fetch, second_said, second_waits)
            await second_waits.wait()
            hub.release.set()
    assert paths == [_repo_dir(tmp_path)] * 2
    assert (_repo_dir(tmp_path) / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
    assert sorted(name for name, _ in hub.ranges) == ["config.json", "model.safetensors"], "each file fetched once"
    assert second_said == ["fetching weights: waiting for another fetch of it on this node to finish"]


async def test_single_file_url_with_checksum(tmp_path: Path, hub: Hub) -> None:
    data = b"gguf" * 1000
    hub.files = {"model.gguf": data}
    url = f"{hub.url}/org/tiny/resolve/{COMMIT}/model.gguf"
    good = hashlib.sha256(data).hexdigest()
    path = await fetch_weights(f"{url}#sha256={good}", _settings(tmp_path, hub))
    assert path.name == "model.gguf" and path.read_bytes() == data
    with pytest.raises(FetchError, match="does not match"):
        await fetch_weights(f"{url}?copy=1#sha256={'1' * 64}", _settings(tmp_path, hub))


async def test_local_path_used_in_place(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"x")
    settings = FetchSettings(weights_dir=tmp_path / "weights")
    assert await fetch_weights(str(model), settings) == model
    assert not (tmp_path / "weights").exists()
    with pytest.raises(FetchError, match="does not exist on this node"):
        await fetch_weights(str(tmp_path / "missing.gguf"), settings)


async def test_unknown_repository_and_traversal_refused(tmp_path: Path, hub: Hub) -> None:
    with pytest.raises(FetchError, match="no repository org/other"):
        await fetch_weights("hf://org/other", _settings(tmp_path, hub))
    hub.files = {"../escape.bin": b"x"}
    with pytest.raises(FetchError, match="outside its directory"):
        await fetch_weights("hf://org/tiny", _settings(tmp_path, hub))
    assert not (tmp_path / "weights" / "hf" / "org" / "escape.bin").exists()


async def test_adapters_fetched_in_order_with_named_progress(tmp_path: Path, hub: Hub) -> None:
    hub.files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"a" * 20_000}
    local = tmp_path / "chat.gguf"
    local.write_bytes(b"lora")
    url = f"{hub.url}/org/tiny/resolve/{COMMIT}/adapter_config.json"
    settings = _settings(tmp_path, hub)
    messages: list[str] = []
    adapters = (Adapter("sql", "hf://org/tiny"), Adapter("chat", str(local)), Adapter("cfg", url))
    fetched = await fetch_adapters(adapters, settings, messages.append)
    assert fetched == (Adapter("sql", str(_repo_dir(tmp_path))), Adapter("chat", str(local)),
                       Adapter("cfg", str(cached_path(url, settings))))
    assert (_repo_dir(tmp_path) / "adapter_model.safetensors").read_bytes() == hub.files["adapter_model.safetensors"]
    assert messages[-1].startswith("fetching adapter cfg: ")
    assert any(m == "fetching adapter sql: 20.0/20.0 kB" for m in messages)
    # An agent that restarts finds every adapter where it was fetched, without the network.
    assert [cached_path(a.source, settings) for a in adapters] == [Path(a.source) for a in fetched]


async def test_adapter_fetch_errors_name_the_adapter(tmp_path: Path, hub: Hub) -> None:
    settings = _settings(tmp_path, hub)
    with pytest.raises(FetchError, match=r"^LoRA adapter 'sql': adapter sql path /nowhere/sql does not exist on this node"):
        await fetch_adapters((Adapter("sql", "/nowhere/sql"),), settings)
    with pytest.raises(FetchError, match=r"^LoRA adapter 'x': .*no repository org/other"):
        await fetch_adapters((Adapter("x", "hf://org/other"),), settings)
    # The simulated engine's adapters are labels: nothing to check or fetch.
    labels = (Adapter("a", "not-a-file"),)
    assert await fetch_adapters(labels, settings, check_local=False) == labels
    assert cached_path("hf://org/other", settings) is None and cached_path("/nowhere", settings) is None
