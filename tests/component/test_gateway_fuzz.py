"""Property-based robustness of the gateway: malformed bodies and headers at every endpoint.

The gateway (auth on, one valid key) and an in-process ``llmgw.sim`` replica run in a
trio loop on a background thread; hypothesis drives plain blocking sockets against it,
so every request really crosses a 127.0.0.1 socket and Hypercorn's HTTP parser, and the
test can send bytes no HTTP client library would (bogus framing headers, invalid UTF-8,
100,000-deep JSON, 5,000-digit numbers).

Properties, for every request:

* never a 500 and no other 5xx (the engine is healthy), except 501 from the HTTP layer
  for a Transfer-Encoding other than ``chunked``;
* never a hang: the server answers and closes (every request says ``Connection: close``)
  within :data:`DEADLINE_S`. Where the request's framing may leave the server waiting
  for body bytes that never come (a Content-Length larger than the body, a raw
  "chunked" body), the client half-closes and then only a timely close is required;
* on ``/v1/*`` every 4xx/5xx carries an OpenAI-shaped JSON error body. The one exception
  is a request whose framing the HTTP layer itself rejects before the app sees it
  (Hypercorn answers those with an empty 400/431/501); such requests are marked by the
  generator, and only they may get an empty error body.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from typing import Iterator

import attrs
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.catalog import generate_key
from llmgw.router import Replica, ReplicaTable, create_app, serve_gateway
from llmgw.router.auth import AuthTable, KeyEntry, Tenant
from llmgw.sim import SimConfig, serve

MODEL = "fuzz-model"
DEADLINE_S = 15.0  # per request: an answer (or, after a half-close, a close) must come within it
START_TIMEOUT_S = 30.0
EXAMPLES = 150  # per endpoint group: the whole file stays well under a minute

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    # The same examples every run, so CI is reproducible; to explore new ones locally,
    # set derandomize=False (and raise EXAMPLES).
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


# -- the gateway under test, on a background trio loop ----------------------------------------


class GatewayThread:
    """A sim replica and the gateway in ``trio.run`` on a daemon thread; :attr:`port` once started."""

    def __init__(self) -> None:
        self.key = generate_key()
        self.port = 0
        self.crashed: BaseException | None = None
        self._started: queue.Queue[int | BaseException] = queue.Queue()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="gateway-under-fuzz", daemon=True)

    def start(self) -> None:
        self._thread.start()
        started = self._started.get(timeout=START_TIMEOUT_S)
        if isinstance(started, BaseException):
            raise started
        self.port = started

    def stop(self) -> None:
        """Stop the gateway; raise what ended its trio run early, if anything did."""
        if self._thread.is_alive() and self._token is not None and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(START_TIMEOUT_S)
        assert not self._thread.is_alive(), "the gateway did not shut down"
        if self.crashed is not None:
            raise AssertionError("the gateway's trio run crashed") from self.crashed

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as error:  # reported to start() if it happened before the port
            self.crashed = error
            self._started.put(error)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            # A short max_model_len bounds what a fuzzed max_tokens can ask the engine for.
            _, sim_port = await nursery.start(serve, SimConfig(model=MODEL, port=0, max_model_len=256))
            table = ReplicaTable()
            table.set_model_replicas(MODEL, [Replica("s0", MODEL, f"http://127.0.0.1:{sim_port}", "node-1")])
            tenant = Tenant("fuzzers")
            auth = AuthTable(keys=[KeyEntry(self.key.key_id, bytes.fromhex(self.key.secret_hash), tenant)])
            port = await nursery.start(serve_gateway, create_app(table, auth=auth), "127.0.0.1", 0)
            self._started.put(port)
            await self._stop.wait()
            nursery.cancel_scope.cancel()


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayThread]:
    running = GatewayThread()
    running.start()
    try:
        yield running
    finally:
        running.stop()


# -- one raw exchange ------------------------------------------------------------------------


@attrs.frozen
class Request:
    method: str
    path: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes  # exactly the bytes sent after the head
    framing_ok: bool  # False: the HTTP layer may reject it before the app sees it
    half_close: bool  # True: the server may wait for more body; the client sends EOF


@attrs.frozen
class Answer:
    status: int | None  # None: closed without a response
    headers: dict[str, str]
    body: bytes


def exchange(port: int, request: Request) -> Answer:
    """Send ``request`` on a fresh connection; return the answer read until the server closes.

    Fails the test (AssertionError) if the server neither answers nor closes within DEADLINE_S.
    """
    head = [f"{request.method} {request.path} HTTP/1.1".encode(), b"host: 127.0.0.1", b"connection: close"]
    head += [name + b": " + value for name, value in request.headers]
    raw = b"\r\n".join(head) + b"\r\n\r\n" + request.body
    data = b""
    give_up = time.monotonic() + DEADLINE_S
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        try:
            sock.sendall(raw)
            if request.half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server answered early and closed (e.g. a bad head): read what it said
            pass
        while True:
            remaining = give_up - time.monotonic()
            assert remaining > 0, f"no answer and no close within {DEADLINE_S}s: {request!r:.300}"
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                raise AssertionError(f"no answer and no close within {DEADLINE_S}s: {request!r:.300}") from None
            except ConnectionResetError:
                break  # closed on us with our bytes unread: a close, checked below like EOF
            if not chunk:
                break
            data += chunk
    return parse_answer(data)


def parse_answer(data: bytes) -> Answer:
    """Return the first HTTP response in ``data`` (status None if there is none)."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        assert not data, f"truncated response head: {data[:200]!r}"
        return Answer(None, {}, b"")
    lines = data[:end].split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    rest = data[end + 4:]
    if "chunked" in headers.get("transfer-encoding", ""):
        body = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            body += rest[:size]
            rest = rest[size + 2:]
    elif "content-length" in headers:
        body = rest[: int(headers["content-length"])]
    else:
        body = rest
    return Answer(status, headers, body)


def check(request: Request, answer: Answer) -> None:
    """Assert the properties in the module docstring for one exchange."""
    if answer.status is None:
        assert request.half_close or not request.framing_ok, (
            f"the server closed without answering a complete request: {request!r:.300}"
        )
        return
    assert answer.status != 500, f"500 for {request!r:.400}: {answer.body[:400]!r}"
    if answer.status >= 500:
        assert answer.status == 501 and not request.framing_ok, (answer, request)
    if not request.path.startswith("/v1") or answer.status < 400:
        return
    if not answer.body:
        assert not request.framing_ok, f"empty {answer.status} on /v1 for a well-framed request: {request!r:.300}"
        return
    assert answer.headers.get("content-type", "").startswith("application/json"), answer
    error = json.loads(answer.body)["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error


# -- strategies ---------------------------------------------------------------------------------

FORWARDED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
VALID_BODIES: dict[str, dict[str, object]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 4},
    "/v1/embeddings": {"model": MODEL, "input": "hello"},
}
FIELDS = (
    "model", "messages", "prompt", "input", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "n", "stop", "logprobs", "seed", "user", "tools", "response_format", "encoding_format",
    "dimensions", "lora_request", "cache_salt",
)
# JSON text no json.dumps would write, or that Python's json module treats specially.
RAW_VALUES = (
    "1" * 5000,  # past Python's 4300-digit int conversion limit
    "-" + "9" * 4301,
    "1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1" * 400 + ".5e-99999", "-0", "0.0000000000000000001",
    '"\\ud800"', '"x\\udfff"', '"\\u0000"', '"' + "\\u00e9" * 10 + '"', "18446744073709551616", "-9223372036854775809",
    '{"include_usage": "yes"}', '{"include_usage": true, "continuous_usage_stats": 7}', "[null]", "{}", "[]",
    '[{"role": 5}]', '[{"content": {"text": []}}]', '[{"role": "user", "content": [{"type": "text", "text": 9}]}]',
)
JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
JSON_VALUES = st.recursive(
    JSON_LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
VALUE_TEXT = st.one_of(JSON_VALUES.map(json.dumps), st.sampled_from(RAW_VALUES))


@st.composite
def wrong_types(draw: st.DrawFn, path: str) -> bytes:
    """A valid body for ``path`` with one to three fields replaced by any JSON value (as text)."""
    base = dict(VALID_BODIES[path])
    if draw(st.booleans()):
        base["stream"] = True
    replaced = draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True))
    kept = {k: v for k, v in base.items() if k not in replaced}
    parts = [json.dumps(k) + ": " + json.dumps(v) for k, v in kept.items()]
    parts += [json.dumps(k) + ": " + draw(VALUE_TEXT) for k in replaced]
    return ("{" + ", ".join(draw(st.permutations(parts))) + "}").encode()


@st.composite
def deeply_nested(draw: st.DrawFn, path: str) -> bytes:
    depth = draw(st.sampled_from([50, 998, 1001, 5000, 100_000]))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    nested = opener * depth + "1" + closer * depth
    where = draw(st.sampled_from(["whole", "field", "unclosed"]))
    if where == "whole":
        return nested.encode()
    if where == "unclosed":
        return (opener * depth).encode()
    field = draw(st.sampled_from(FIELDS))
    body = dict(VALID_BODIES[path])
    body.pop(field, None)
    return (json.dumps(body)[:-1] + ", " + json.dumps(field) + ": " + nested + "}").encode()


@st.composite
def invalid_utf8(draw: st.DrawFn, path: str) -> bytes:
    bad = draw(st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\x80\x80"]))
    text = json.dumps(VALID_BODIES[path]).encode()
    where = draw(st.integers(min_value=0, max_value=len(text)))
    return text[:where] + bad + text[where:]


@st.composite
def truncated(draw: st.DrawFn, path: str) -> bytes:
    text = json.dumps({**VALID_BODIES[path], "stream": draw(st.booleans())}).encode()
    return text[: draw(st.integers(min_value=0, max_value=len(text) - 1))]


def bodies(path: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.just(b""),
        st.binary(max_size=512),
        truncated(path),
        deeply_nested(path),
        wrong_types(path),
        invalid_utf8(path),
        st.just(json.dumps(VALID_BODIES[path]).encode()),
        st.sampled_from(RAW_VALUES).map(str.encode),
    )


HEADER_VALUE = st.binary(max_size=40).map(lambda b: bytes(c for c in b if c >= 0x21 and c != 0x7F))
LONG_LENGTHS = st.sampled_from([200, 4000, 12_000, 20_000, 70_000])


@st.composite
def requests(draw: st.DrawFn, key: str, methods: st.SearchStrategy[str], paths: st.SearchStrategy[str],
             body_for: st.SearchStrategy[bytes] | None = None) -> Request:
    """A request with fuzzed method, path, headers and body, and what its framing allows."""
    method = draw(methods)
    path = draw(paths)
    if body_for is not None:
        body = draw(body_for)
    elif path in VALID_BODIES:
        body = draw(bodies(path))
    else:
        body = draw(st.one_of(st.just(b""), st.binary(max_size=64)))
    framing_ok, half_close = True, False
    headers: list[tuple[bytes, bytes]] = []

    auth = draw(st.sampled_from(["valid", "valid", "valid", "none", "random", "bearer-random", "wrong-key", "basic", "long"]))
    if auth == "valid":
        headers.append((b"authorization", f"Bearer {key}".encode()))
    elif auth == "random":
        headers.append((b"authorization", draw(HEADER_VALUE)))
    elif auth == "bearer-random":
        headers.append((b"authorization", b"Bearer " + draw(HEADER_VALUE)))
    elif auth == "wrong-key":
        headers.append((b"authorization", b"Bearer llmgw_" + key.split("_")[1].encode() + b"_wrongsecret"))
    elif auth == "basic":
        headers.append((b"authorization", b"Basic dXNlcjpwYXNz"))
    elif auth == "long":
        length = draw(LONG_LENGTHS)
        headers.append((b"authorization", b"Bearer " + b"k" * length))
        framing_ok = length < 8000

    content_type = draw(st.sampled_from([
        None, b"application/json", b"text/plain", b"application/json; charset=latin-1", b"multipart/form-data; boundary=x",
        b"application/x-www-form-urlencoded", b"", b"*/*", b"application/json;;;=",
    ]) | HEADER_VALUE)
    if content_type is not None:
        headers.append((b"content-type", content_type))

    framing = draw(st.sampled_from(["length", "length", "length", "none", "smaller", "larger", "garbage", "twice", "chunked",
                                    "chunked-raw", "te-other", "te-and-length"]))
    if framing == "length":
        headers.append((b"content-length", str(len(body)).encode()))
    elif framing == "none":
        # A body without a length is read as none, and its bytes as a (bad) pipelined
        # request, which Hypercorn rejects, racing the app's answer: a close is fine.
        framing_ok = not body
    elif framing == "smaller" and body:
        headers.append((b"content-length", str(draw(st.integers(0, len(body) - 1))).encode()))
        framing_ok = False  # trailing bytes: as for "none"
    elif framing == "larger" or framing == "smaller":
        headers.append((b"content-length", str(len(body) + draw(st.integers(1, 10**6))).encode()))
        framing_ok, half_close = False, True
    elif framing == "garbage":
        headers.append((b"content-length", draw(st.sampled_from([b"abc", b"-1", b"1e3", b"+5", b"0x10", b"", b"9" * 40, b"1, 2"]))))
        framing_ok, half_close = False, True
    elif framing == "twice":
        headers.append((b"content-length", str(len(body)).encode()))
        headers.append((b"content-length", str(len(body) + 1).encode()))
        framing_ok, half_close = False, True
    elif framing == "chunked":
        headers.append((b"transfer-encoding", b"chunked"))
        cut = draw(st.integers(0, len(body)))
        pieces = [p for p in (body[:cut], body[cut:]) if p]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    elif framing == "chunked-raw":
        headers.append((b"transfer-encoding", b"chunked"))
        framing_ok, half_close = False, True
    elif framing == "te-other":
        headers.append((b"transfer-encoding", draw(st.sampled_from([b"gzip", b"gzip, chunked", b"chunked, gzip", b"identity", b"bogus"]))))
        framing_ok, half_close = False, True
    else:  # te-and-length
        headers.append((b"transfer-encoding", b"chunked"))
        headers.append((b"content-length", str(len(body)).encode()))
        framing_ok, half_close = False, True

    if draw(st.booleans()):
        headers.append((b"x-request-id", draw(HEADER_VALUE)))
    if draw(st.booleans()):
        headers.append((b"accept", draw(st.sampled_from([b"text/event-stream", b"application/json", b"*/*", b"x/y"]))))
    if draw(st.integers(0, 5)) == 0:
        length = draw(LONG_LENGTHS)
        headers.append((b"x-long-" + draw(st.sampled_from([b"a", b"b"])), b"v" * length))
        framing_ok = framing_ok and length < 8000
    if draw(st.integers(0, 4)) == 0:
        headers.append((b"traceparent", draw(HEADER_VALUE)))
    # Any header (an Authorization, say) can make the whole head too large for the HTTP layer,
    # which then answers 431 itself, with no JSON body: judge the head as a whole.
    framing_ok = framing_ok and sum(len(name) + len(value) + 4 for name, value in headers) < 8000
    return Request(method, path, tuple(draw(st.permutations(headers))), body, framing_ok, half_close)


MODEL_IDS = st.one_of(
    st.just(MODEL),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~%/", min_size=1, max_size=30),
    st.sampled_from(["%ff", "%00", "a%2Fb", "..", "%", "x" * 2000]),
)
LOCAL_PATHS = st.one_of(
    st.sampled_from(["/v1/models", "/healthz", "/metrics", "/", "/v1", "/v1/", "/v2/models", "/v1/unknown",
                     "/v1/chat/completions/extra", "/v1/models?x=1", "/healthz?%ff", "/metrics/", "*"]),
    MODEL_IDS.map(lambda model: "/v1/models/" + model),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~%/", max_size=30).map(lambda p: "/v1/" + p),
)
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE"])


# -- the properties ---------------------------------------------------------------------------


def test_the_fuzz_harness_reaches_the_app(gateway: GatewayThread) -> None:
    """A well-formed request through the same harness is served (so the properties below test the app)."""
    body = json.dumps(VALID_BODIES["/v1/chat/completions"]).encode()
    headers = ((b"authorization", f"Bearer {gateway.key.key}".encode()), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()))
    answer = exchange(gateway.port, Request("POST", "/v1/chat/completions", headers, body, True, False))
    assert answer.status == 200, answer
    assert json.loads(answer.body)["choices"][0]["message"]["content"]
    missing = exchange(gateway.port, Request("GET", "/v1/models/absent", headers[:1], b"", True, False))
    assert missing.status == 404 and json.loads(missing.body)["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path", FORWARDED)
def test_forwarded_endpoints_survive_malformed_posts(gateway: GatewayThread, path: str) -> None:
    @FUZZ_SETTINGS
    @given(request=requests(gateway.key.key, st.just("POST"), st.just(path), bodies(path)))
    def run(request: Request) -> None:
        check(request, exchange(gateway.port, request))

    run()


def test_every_endpoint_survives_any_method_and_headers(gateway: GatewayThread) -> None:
    @FUZZ_SETTINGS
    @given(request=requests(gateway.key.key, METHODS, st.one_of(st.sampled_from(FORWARDED), LOCAL_PATHS)))
    def run(request: Request) -> None:
        check(request, exchange(gateway.port, request))

    run()
