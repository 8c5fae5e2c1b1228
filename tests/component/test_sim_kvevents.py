"""The simulated engine's KV events over real ZMQ sockets: vLLM's wire format, hashes, eviction, replay."""

import os
import time

import httpx
import msgpack
import pytest
import zmq

from llmgw import kvhash
from llmgw.sim.launch import free_tcp_port, start_sim

MODEL = "sim-kv"
BS = 16
NUM_BLOCKS = 24
SEED = "0"  # given as PYTHONHASHSEED, as vLLM reads it
TIMEOUT = 10.0
BLOCK_STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]


class Events:
    """Every message received on the bound SUB socket, in arrival order."""

    def __init__(self, sub):
        self.sub = sub
        self.messages = []  # (topic, seq, ts, events, rank)

    def _receive(self, timeout):
        if self.sub.poll(int(timeout * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert len(seq) == 8
            batch = msgpack.unpackb(payload, raw=False)
            assert isinstance(batch, list) and len(batch) == 3 and isinstance(batch[0], float)
            self.messages.append((topic, int.from_bytes(seq, "big"), batch[0], batch[1], batch[2]))
            return True
        return False

    def wait_for(self, predicate, timeout=TIMEOUT, start=0):
        """Return the first event (from message index ``start``) matching ``predicate``, receiving as needed."""
        deadline = time.monotonic() + timeout
        checked = start
        while True:
            for _, _, _, events, _ in self.messages[checked:]:
                for ev in events:
                    if predicate(ev):
                        return ev
            checked = len(self.messages)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("no matching KV event before the deadline")
            self._receive(left)


@pytest.fixture(scope="module")
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(scope="module")
def setup(ctx, tmp_path_factory):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub_port = sub.bind_to_random_port("tcp://127.0.0.1")
    replay_port = free_tcp_port()
    env = {**os.environ, "PYTHONHASHSEED": SEED}
    args = [
        "--port", "0", "--model", MODEL, "--block-size", str(BS), "--num-blocks", str(NUM_BLOCKS), "--enable-lora",
        "--kv-events-endpoint", f"tcp://127.0.0.1:{sub_port}", "--kv-replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
    ]  # fmt: skip
    with start_sim(args, env=env) as proc, httpx.Client(base_url=proc.url, timeout=TIMEOUT) as http:
        events = Events(sub)
        # The engine's PUB connects to us: wait until its first batch gets through (slow joiner), by readiness.
        deadline = time.monotonic() + 20
        attempt = 0
        while not events.messages:
            assert time.monotonic() < deadline, "no KV event reached the bound SUB socket"
            attempt += 1
            http.post("/v1/completions", json={"model": MODEL, "prompt": list(range(1000 + attempt * 40, 1000 + attempt * 40 + 20)), "max_tokens": 1})
            events._receive(1.0)
        yield proc, http, events, replay_port, tmp_path_factory.mktemp("adapters")
    sub.close(linger=0)


def chat_tokens(http, messages):
    return http.post("/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": True}).json()["tokens"]


def test_block_stored_matches_vllm_format_and_kvhash(setup):
    proc, http, events, *_ = setup
    messages = [{"role": "user", "content": " ".join(f"alpha{i}" for i in range(40))}]
    tokens = chat_tokens(http, messages)
    assert len(tokens) >= 2 * BS
    expected = kvhash.event_hashes(kvhash.block_hashes(tokens, BS, seed=SEED))
    http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
    ev = events.wait_for(lambda e: e["type"] == "BlockStored" and e["block_hashes"][:1] == expected[:1])
    assert list(ev) == BLOCK_STORED_KEYS
    assert ev["block_hashes"] == expected
    assert ev["parent_block_hash"] is None
    assert ev["token_ids"] == tokens[: len(expected) * BS]
    assert ev["block_size"] == BS and ev["medium"] == "GPU" and ev["lora_id"] is None and ev["lora_name"] is None
    # Frames: topic "kv", consecutive sequence numbers (the first batches may be lost to the
    # slow-joiner effect before the connection is up; replay covers them, see below).
    assert {m[0] for m in events.messages} == {b"kv"}
    seqs = [m[1] for m in events.messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(m[4] == 0 for m in events.messages)


def test_lora_and_cache_salt_hashes(setup):
    proc, http, events, _, adapters = setup
    path = str(adapters)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "kv-ad", "lora_path": path}).status_code == 200
    prompt = list(range(5000, 5040))
    expected = kvhash.event_hashes(kvhash.block_hashes(prompt, BS, seed=SEED, lora=("kv-ad", path)))
    http.post("/v1/completions", json={"model": "kv-ad", "prompt": prompt, "max_tokens": 1})
    ev = events.wait_for(lambda e: e["type"] == "BlockStored" and e["block_hashes"][:1] == expected[:1])
    assert ev["block_hashes"] == expected and ev["lora_name"] == "kv-ad" and isinstance(ev["lora_id"], int)

    salted = kvhash.event_hashes(kvhash.block_hashes(prompt, BS, seed=SEED, cache_salt="tenant-A"))
    http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-A"})
    ev = events.wait_for(lambda e: e["type"] == "BlockStored" and e["block_hashes"][:1] == salted[:1])
    assert ev["block_hashes"] == salted and ev["lora_id"] is None


def test_eviction_emits_block_removed_for_stored_blocks(setup, ctx):
    proc, http, events, replay_port, _ = setup
    start = len(events.messages)
    # Each prompt stores 4 blocks; 8 of them overflow a 24-block cache.
    for i in range(8):
        prompt = list(range(20_000 + i * 100, 20_000 + i * 100 + 4 * BS + 1))
        http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    removed = events.wait_for(lambda e: e["type"] == "BlockRemoved", start=start)
    assert list(removed) == ["type", "block_hashes", "medium"] and removed["medium"] == "GPU"
    # Wait until the last prompt's blocks are announced, then check every removal names a stored
    # block, over the whole history (replayed, since the SUB socket may have missed the first batches).
    last = kvhash.event_hashes(kvhash.block_hashes(list(range(20_700, 20_700 + 4 * BS + 1)), BS, seed=SEED))
    events.wait_for(lambda e: e["type"] == "BlockStored" and e["block_hashes"][:1] == last[:1], start=start)
    stored, held = set(), set()
    history = [ev for _, _, payload in dealer_replay(ctx, replay_port, 0) for ev in msgpack.unpackb(payload, raw=False)[1]]
    assert removed in history
    for ev in history:
        if ev["type"] == "BlockStored":
            stored.update(ev["block_hashes"])
            held.update(ev["block_hashes"])
        elif ev["type"] == "BlockRemoved":
            assert set(ev["block_hashes"]) <= stored
            held.difference_update(ev["block_hashes"])
        elif ev["type"] == "AllBlocksCleared":
            held.clear()
    assert len(held) <= NUM_BLOCKS


def dealer_replay(ctx, port, start_seq):
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(int(TIMEOUT * 1000)), "replay did not answer"
            frames = dealer.recv_multipart()
            if frames == [b"", b"", b"\xff" * 8, b""]:
                return out
            assert len(frames) == 4 and frames[0] == b""
            out.append((frames[1], int.from_bytes(frames[2], "big"), frames[3]))
    finally:
        dealer.close()


def test_replay_returns_buffered_batches_then_end_marker(setup, ctx):
    proc, http, events, replay_port, _ = setup
    # Make sure at least one recent batch exists, then replay everything.
    prompt = list(range(30_000, 30_000 + BS + 1))
    first = kvhash.event_hashes(kvhash.block_hashes(prompt, BS, seed=SEED))
    http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    events.wait_for(lambda e: e["type"] == "BlockStored" and e["block_hashes"][:1] == first[:1])
    replayed = dealer_replay(ctx, replay_port, 0)
    seen = {m[1]: m for m in events.messages}
    seqs = [seq for _, seq, _ in replayed]
    assert seqs == list(range(len(seqs))) and set(seen) <= set(seqs)
    for topic, seq, payload in replayed:
        assert topic == b"kv"
        if seq in seen:
            assert msgpack.unpackb(payload, raw=False)[1] == seen[seq][3]
    later = dealer_replay(ctx, replay_port, 3)
    assert [seq for _, seq, _ in later] == [seq for _, seq, _ in replayed if seq >= 3]
    assert dealer_replay(ctx, replay_port, 10**9) == []


def test_reset_prefix_cache_emits_all_blocks_cleared(setup):
    proc, http, events, *_ = setup
    start = len(events.messages)
    assert http.post("/reset_prefix_cache").status_code == 200
    assert events.wait_for(lambda e: e["type"] == "AllBlocksCleared", start=start) == {"type": "AllBlocksCleared"}
    # After the reset, the same prompt misses again.
    prompt = list(range(40_000, 40_000 + 2 * BS + 1))
    http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    again = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 2 * BS}


def test_wildcard_endpoint_binds_and_a_connecting_sub_receives(ctx):
    port = free_tcp_port()
    with start_sim(["--port", "0", "--model", MODEL, "--kv-events-endpoint", f"tcp://*:{port}", "--kv-topic", ""]) as proc:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        try:
            events = Events(sub)
            deadline = time.monotonic() + 20
            with httpx.Client(base_url=proc.url, timeout=TIMEOUT) as http:
                attempt = 0
                while not events.messages:  # retried until the subscription has reached the engine
                    assert time.monotonic() < deadline, "no KV event reached the connecting SUB socket"
                    attempt += 1
                    http.post("/v1/completions", json={"model": MODEL, "prompt": list(range(attempt * 100, attempt * 100 + BS + 1)), "max_tokens": 1})
                    events._receive(1.0)
            assert events.messages[0][0] == b""  # topic "" is an empty frame
            # Another engine cannot bind the same endpoint: it refuses to start.
            with pytest.raises(RuntimeError) as info:
                start_sim(["--port", "0", "--model", MODEL, "--kv-events-endpoint", f"tcp://*:{port}"])
            assert "exited with status 2" in str(info.value) and "KV event sockets" in str(info.value)
        finally:
            sub.close(linger=0)
