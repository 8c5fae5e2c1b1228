"""Whatever JSON (or bytes) a client sends, the simulated engine answers with a 2xx or a 4xx JSON error, never a 5xx."""

import json

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.sim import api
from llmgw.sim.config import parse_args
from llmgw.sim.engine import Engine
from llmgw.sim.httpserver import Request
from llmgw.sim.publisher import KvEventPublisher

MODEL = "fuzz"
POST_PATHS = [path for path, (method, _) in api.ROUTES.items() if method == "POST" and path != "/reset_prefix_cache"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 70_000), st.floats(allow_nan=False), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
field_names = st.sampled_from(["model", "messages", "prompt", "input", "max_tokens", "stream", "stream_options", "stop", "tokens", "cache_salt", "lora_name", "lora_path", "n", "encoding_format", "add_generation_prompt"])
bodies = st.one_of(
    st.dictionaries(field_names, values, max_size=6).map(lambda d: json.dumps(d).encode()),
    st.builds(lambda d: json.dumps({"model": MODEL, **d}).encode(), st.dictionaries(field_names, values, max_size=5)),
    st.binary(max_size=40),
    st.just(b"[" * 100_000),
)


class FakeResponder:
    """Records what the handler sends instead of writing to a socket."""

    def __init__(self):
        self.started = False
        self.status = 0
        self.body = b""

    async def send(self, status, body, content_type=b"application/json"):
        self.started, self.status, self.body = True, status, body

    async def send_json(self, status, obj):
        await self.send(status, json.dumps(obj).encode())

    async def start(self, status, content_type):
        self.started, self.status = True, status

    async def chunk(self, data):
        self.body += data

    async def end(self):
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(POST_PATHS), body=bodies)
async def test_no_server_errors(path, body):
    engine = Engine(parse_args(["--model", MODEL, "--enable-lora", "--any-lora-path", "--prefill-us-per-token", "0", "--max-model-len", "256"]), KvEventPublisher(None))
    handler = api.make_handler(engine)
    resp = FakeResponder()
    with trio.fail_after(10):
        await handler(Request("POST", path, "", [], body), resp)
    assert resp.started and 200 <= resp.status < 500
    if resp.status >= 400:
        err = json.loads(resp.body)["error"]
        assert err["code"] == resp.status and isinstance(err["message"], str)
