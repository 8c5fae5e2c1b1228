"""The simulated engine as a real process: vLLM's HTTP surface, the openai client, LoRA, process behaviour."""

import json
import socket

import httpx
import openai
import pytest

from llmgw.sim.launch import start_sim

MODEL = "sim-model"
TIMEOUT = 10.0
LONG_TEXT = " ".join(f"word{i}" for i in range(60))  # several 16-token blocks


@pytest.fixture(scope="module")
def sim():
    with start_sim(["--port", "0", "--model", MODEL, "--enable-lora", "--max-loras", "2", "--max-model-len", "512"]) as proc:
        yield proc


@pytest.fixture
def http(sim):
    with httpx.Client(base_url=sim.url, timeout=TIMEOUT) as client:
        yield client


def chat_body(content, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def sse_events(text):
    """Return the JSON payloads of an SSE body and whether it ended with [DONE]."""
    blocks = text.split("\n\n")
    assert blocks[-1] == "", "stream must end with a blank line"
    datas = [b.removeprefix("data: ") for b in blocks[:-1]]
    assert all(b.startswith("data: ") for b in blocks[:-1])
    return [json.loads(d) for d in datas if d != "[DONE]"], datas[-1] == "[DONE]"


def test_health_and_version(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.content == b""
    assert http.get("/version").json()["version"]


def test_chat_non_streaming(http):
    r = http.post("/v1/chat/completions", json=chat_body("Hello there", max_tokens=5))
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    again = http.post("/v1/chat/completions", json=chat_body("Hello there", max_tokens=5)).json()
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]
    other = http.post("/v1/chat/completions", json=chat_body("Something else", max_tokens=5)).json()
    assert other["choices"][0]["message"]["content"] != choice["message"]["content"]


def test_chat_streaming_with_usage(http):
    full = http.post("/v1/chat/completions", json=chat_body("Stream me", max_tokens=6)).json()
    r = http.post("/v1/chat/completions", json=chat_body("Stream me", max_tokens=6, stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events, done = sse_events(r.text)
    assert done
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert content == full["choices"][0]["message"]["content"]
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"]
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)


def test_stream_without_usage_has_no_usage_chunk(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True})
    events, done = sse_events(r.text)
    assert done and all(e["choices"] for e in events) and "usage" not in events[-1]
    assert "".join(e["choices"][0]["text"] for e in events).count(" ") == 3


def test_completions_string_and_token_ids_agree(http):
    tokens = http.post("/tokenize", json={"model": MODEL, "prompt": "Once upon a time"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["token_strs"] is None and tokens["max_model_len"] == 512
    by_text = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}).json()
    by_ids = http.post("/v1/completions", json={"model": MODEL, "prompt": tokens["tokens"], "max_tokens": 4}).json()
    assert by_text["object"] == "text_completion"
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]
    assert by_text["usage"]["prompt_tokens"] == tokens["count"]
    batch = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a b", "c d"], "max_tokens": 2}).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]


def test_tokenize_messages_matches_chat_prompt_and_detokenize(http):
    msgs = [{"role": "user", "content": "Count my tokens"}]
    tok = http.post("/tokenize", json={"model": MODEL, "messages": msgs, "add_generation_prompt": True}).json()
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 1}).json()
    assert tok["count"] == chat["usage"]["prompt_tokens"]
    text = http.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()["prompt"]
    assert text == "<|im_start|>user\nCount my tokens<|im_end|>\n<|im_start|>assistant\n"


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_metrics_and_prefix_cache_hits(http):
    before = http.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        metric(before, name)
    assert 'vllm:cache_config_info{block_size="16"' in before and 'prefix_caching_hash_algo="sha256_cbor"' in before
    assert 'vllm:lora_requests_info{max_lora="2"' in before
    body = chat_body(LONG_TEXT + " metrics test", max_tokens=2)
    first = http.post("/v1/chat/completions", json=body).json()
    mid = http.get("/metrics").text
    second = http.post("/v1/chat/completions", json=body).json()
    after = http.get("/metrics").text
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert metric(mid, "vllm:prefix_cache_queries_total") - metric(before, "vllm:prefix_cache_queries_total") == prompt_tokens
    hits = metric(after, "vllm:prefix_cache_hits_total") - metric(mid, "vllm:prefix_cache_hits_total")
    assert hits == (prompt_tokens - 1) // 16 * 16 > 0
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": hits}


def error_of(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    return err


def test_errors_are_openai_shaped(http):
    error_of(http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    error_of(http.post("/v1/completions", content=b"[1, 2]"), 400)
    error_of(http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}), 400)
    error_of(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 10_000}), 400)
    err = error_of(http.post("/v1/chat/completions", json=chat_body("x") | {"model": "nope"}), 404)
    assert err["param"] == "model" and "nope" in err["message"]
    error_of(http.get("/v1/nothing"), 404)
    error_of(http.get("/v1/chat/completions"), 405)
    # The connection is still usable after errors.
    assert http.get("/health").status_code == 200


def test_malformed_http_gets_400(sim):
    with socket.create_connection((sim.host, sim.port), timeout=TIMEOUT) as s:
        s.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.1 400")


def test_lora_load_unload(http, tmp_path):
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "ad1", "lora_path": str(tmp_path), "load_inplace": False})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'ad1' added successfully."
    assert error_of(http.post("/v1/load_lora_adapter", json={"lora_name": "ad1", "lora_path": str(tmp_path)}), 400)["type"] == "InvalidUserInput"
    error_of(http.post("/v1/load_lora_adapter", json={"lora_name": "ad2", "lora_path": str(tmp_path / "absent")}), 404)
    error_of(http.post("/v1/load_lora_adapter", json={"lora_name": MODEL, "lora_path": str(tmp_path)}), 400)
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert cards["ad1"]["parent"] == MODEL and cards["ad1"]["root"] == str(tmp_path) and cards[MODEL]["parent"] is None
    base = http.post("/v1/chat/completions", json=chat_body("adapter test", max_tokens=6)).json()
    tuned = http.post("/v1/chat/completions", json=chat_body("adapter test", max_tokens=6) | {"model": "ad1"}).json()
    assert tuned["model"] == "ad1" and tuned["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "ad1"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'ad1' removed successfully."
    error_of(http.post("/v1/unload_lora_adapter", json={"lora_name": "ad1"}), 404)
    assert "ad1" not in {m["id"] for m in http.get("/v1/models").json()["data"]}
    error_of(http.post("/v1/chat/completions", json=chat_body("x") | {"model": "ad1"}), 404)


def test_openai_client(sim):
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4
    comp = client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert comp.usage.completion_tokens == 3 and comp.choices[0].text
    emb = client.embeddings.create(model=MODEL, input=["one", "two"])  # the client asks for base64
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 16
    assert emb.data[0].embedding != emb.data[1].embedding
    again = client.embeddings.create(model=MODEL, input="one", encoding_format="float")
    assert again.data[0].embedding == pytest.approx(emb.data[0].embedding, rel=1e-6)
    assert [m.id for m in client.models.list()][0] == MODEL


def test_port_taken_exits_nonzero_with_message(sim):
    with pytest.raises(RuntimeError) as info:
        start_sim(["--port", str(sim.port), "--model", MODEL])
    assert "exited with status 2" in str(info.value) and "address already in use" in str(info.value)


def test_sigterm_exits_zero():
    proc = start_sim(["--port", "0", "--model", MODEL])
    assert proc.stop() == 0


def test_fail_after_exits_one():
    proc = start_sim(["--port", "0", "--model", MODEL, "--fail-after", "2"])
    try:
        with httpx.Client(base_url=proc.url, timeout=TIMEOUT) as client:
            for _ in range(2):
                assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 200
        assert proc.proc.wait(TIMEOUT) == 1
        assert "--fail-after 2 reached" in proc.drain()
    finally:
        proc.stop()
