"""The official ``openai`` Python client against the gateway in front of real simulated engines.

Two in-process ``llmgw.sim`` replicas (the full vLLM-like engine on real 127.0.0.1
sockets) behind the gateway on Hypercorn; the client is ``openai.AsyncOpenAI`` exactly as
an application would use it. Every call checks content, not just that no exception was
raised: a gateway that dropped, reordered or duplicated stream chunks, lost the usage
chunk or broke the models endpoints fails here.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx
import openai
import pytest
import trio

from llmgw.router import LoadTracker, Replica, ReplicaTable, create_app, serve_gateway
from llmgw.sim import SimConfig, serve

MODEL = "sim-chat"
DEADLINE_S = 20  # every client call; a hang is a failure, not a stuck suite
MAX_TOKENS = 12


@asynccontextmanager
async def openai_client(replicas: int = 2) -> AsyncIterator[tuple[openai.AsyncOpenAI, LoadTracker, str]]:
    """Run ``replicas`` in-process sims and the gateway; yield (client, load, direct sim URL); stop all."""
    async with trio.open_nursery() as nursery:
        endpoints = []
        for _ in range(replicas):
            _, port = await nursery.start(serve, SimConfig(model=MODEL, port=0))
            endpoints.append(f"http://127.0.0.1:{port}")
        table = ReplicaTable()
        table.set_model_replicas(MODEL, [Replica(f"s{i}", MODEL, url, "node-1") for i, url in enumerate(endpoints)])
        load = LoadTracker()
        port = await nursery.start(serve_gateway, create_app(table, load=load), "127.0.0.1", 0)
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S
        )
        try:
            yield client, load, endpoints[0]
        finally:
            await client.close()
        with trio.fail_after(DEADLINE_S):
            await load.wait_until(lambda tracker: tracker.total() == 0)
        nursery.cancel_scope.cancel()


async def direct(url: str, path: str, body: dict) -> dict:
    """Return the sim's own JSON answer to ``body`` (the reference the gateway must match)."""
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S) as client:
        response = await client.post(path, json=body)
        response.raise_for_status()
        return response.json()


async def test_chat_and_completions_match_the_engine() -> None:
    async with openai_client() as (client, _, sim_url):
        messages = [{"role": "user", "content": "Tell me about trio."}]
        chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
        reference = await direct(sim_url, "/v1/chat/completions",
                                 {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS})
        assert chat.model == MODEL
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content == reference["choices"][0]["message"]["content"]
        assert chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == reference["usage"]["completion_tokens"]

        completion = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=MAX_TOKENS)
        reference = await direct(sim_url, "/v1/completions",
                                 {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS})
        assert completion.choices[0].text == reference["choices"][0]["text"]
        assert completion.choices[0].text
        assert completion.usage is not None and completion.usage.total_tokens == reference["usage"]["total_tokens"]


async def test_streaming_chat_with_usage_matches_the_whole_answer() -> None:
    async with openai_client() as (client, _, _url):
        messages = [{"role": "user", "content": "Stream me something."}]
        whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # really streamed
        usage_chunks = [c for c in chunks if c.usage is not None]
        assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
        assert usage_chunks[0].usage.completion_tokens == whole.usage.completion_tokens
        assert chunks[-1].choices == []

        # Without include_usage the client sees no usage chunk (the gateway asks the engine
        # for one to account tokens and must strip it again).
        plain = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True)
        plain_chunks = [chunk async for chunk in plain]
        assert all(c.usage is None for c in plain_chunks)
        assert "".join(c.choices[0].delta.content or "" for c in plain_chunks if c.choices) == text


async def test_streaming_completions_with_usage() -> None:
    async with openai_client() as (client, _, _url):
        whole = await client.completions.create(model=MODEL, prompt="count:", max_tokens=MAX_TOKENS)
        stream = await client.completions.create(
            model=MODEL, prompt="count:", max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert sum(1 for c in chunks if c.usage is not None) == 1


async def test_embeddings() -> None:
    async with openai_client() as (client, _, sim_url):
        result = await client.embeddings.create(model=MODEL, input=["first text", "second text"])
        reference = await direct(sim_url, "/v1/embeddings", {"model": MODEL, "input": ["first text", "second text"]})
        assert [e.index for e in result.data] == [0, 1]
        # The client asks for base64 (float32) by default: equal to the engine's floats to float32 precision.
        for got, want in zip(result.data, reference["data"], strict=True):
            assert got.embedding == pytest.approx(want["embedding"], rel=1e-6, abs=1e-7)
        assert len(result.data[0].embedding) > 0
        assert result.data[0].embedding != result.data[1].embedding
        assert result.usage.prompt_tokens == reference["usage"]["prompt_tokens"]


async def test_models_list_retrieve_and_errors() -> None:
    async with openai_client(replicas=1) as (client, _, _url):
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        retrieved = await client.models.retrieve(MODEL)
        assert retrieved.id == MODEL and retrieved.object == "model"
        try:
            await client.models.retrieve("no-such-model")
        except openai.NotFoundError as error:
            assert error.code == "model_not_found"
        else:
            raise AssertionError("retrieving an unknown model must raise NotFoundError")
        try:
            await client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        except openai.NotFoundError as error:
            assert error.code == "model_not_found"
        else:
            raise AssertionError("an unknown model must raise NotFoundError")
