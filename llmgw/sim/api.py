"""The simulated engine's HTTP surface, shaped like vLLM's OpenAI-compatible server.

``make_handler(engine)`` returns the request handler for :func:`llmgw.sim.httpserver.serve`.
Every refusal is an OpenAI-shaped JSON error
``{"error": {"message", "type", "param", "code"}}``; malformed JSON is a 400.
"""

from __future__ import annotations

import base64
import hmac
import json
import struct
import time
import uuid
from typing import Any, Awaitable, Callable

from llmgw.sim import metrics, tokenizer
from llmgw.sim.engine import Engine, EngineError, Output, Run, embedding, plan_output
from llmgw.sim.httpserver import Request, Responder
from llmgw.sim.validate import check_sampling

SIM_VERSION = "0.32.0+llmgw.sim"
_SSE_DONE = b"data: [DONE]\n\n"
_SSE = b"text/event-stream; charset=utf-8"

Route = Callable[[Engine, Request, Responder], Awaitable[None]]


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def _json_body(req: Request) -> dict[str, Any]:
    """Return the request's JSON object; raises EngineError(400) if it is not one."""
    try:
        obj = json.loads(req.body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise EngineError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise EngineError(400, "request body must be a JSON object")
    return obj


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens} if cached_tokens else None,
    }


def _stop_list(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise EngineError(400, "'stop' must be a string or a list of strings", param="stop")


def _cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise EngineError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
    return salt


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """Returns (stream, include usage) once the sampling fields pass vLLM's checks (raises EngineError(400))."""
    stream = check_sampling(body)
    opts = body.get("stream_options")
    include_usage = stream and isinstance(opts, dict) and opts.get("include_usage") is True
    return stream, include_usage


def _check_n(body: dict[str, Any]) -> None:
    n = body.get("n", 1)
    if n not in (1, None):
        raise EngineError(400, "llmgw-sim serves n=1 only", param="n")


def _max_tokens_field(body: dict[str, Any]) -> object:
    value = body.get("max_completion_tokens")
    return body.get("max_tokens") if value is None else value


# ---- chat and completions -------------------------------------------------------------


async def chat_completions(engine: Engine, req: Request, resp: Responder) -> None:
    body = _json_body(req)
    lora = engine.resolve_model(body.get("model"))
    stream, include_usage = _stream_flags(body)
    try:
        prompt = engine.prompts.chat(body)
    except ValueError as exc:
        raise EngineError(400, str(exc), param="messages") from None
    _check_n(body)
    max_tokens = engine.max_tokens_for(len(prompt), _max_tokens_field(body))
    stop = _stop_list(body)
    salt = _cache_salt(body)
    model = body.get("model") or engine.cfg.model
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    adapter = lora.name if lora else None
    async with engine.run(prompt, lora=lora, cache_salt=salt) as run:
        out = plan_output(prompt, max_tokens, adapter=adapter, stop=stop)
        if not stream:
            for _ in out.pieces:
                await run.decode_step()
            run.completed(out)
            await resp.send_json(
                200,
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": out.text, "tool_calls": []},
                            "logprobs": None,
                            "finish_reason": out.finish_reason,
                            "stop_reason": out.stop_reason,
                        }
                    ],
                    "usage": _usage(len(prompt), len(out.token_ids), run.cached_tokens),
                },
            )
            return
        head = f'data: {{"id":"{rid}","object":"chat.completion.chunk","created":{created},"model":{_dumps(model)},"choices":'.encode()
        await resp.start(200, _SSE)
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        await resp.chunk(head + _dumps([first]).encode() + b"}\n\n")
        await _stream_pieces(run, resp, out, head, lambda text: {"delta": {"content": text}})
        run.completed(out)
        if include_usage:
            await resp.chunk(head + b"[],\"usage\":" + _dumps(_usage(len(prompt), len(out.token_ids), run.cached_tokens)).encode() + b"}\n\n")
        await resp.chunk(_SSE_DONE)
        await resp.end()


async def _stream_pieces(run: Run, resp: Responder, out: Output, head: bytes, delta: Callable[[str], dict[str, Any]], index: int = 0) -> None:
    """Send one SSE chunk per generated piece; the last carries the finish reason."""
    last = len(out.pieces) - 1
    if last < 0:
        choice = {"index": index, **delta(""), "logprobs": None, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        await resp.chunk(head + _dumps([choice]).encode() + b"}\n\n")
        return
    for k, piece in enumerate(out.pieces):
        await run.decode_step()
        if k < last:
            choice = {"index": index, **delta(piece), "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": index, **delta(piece), "logprobs": None, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        await resp.chunk(head + _dumps([choice]).encode() + b"}\n\n")


def _completion_prompts(engine: Engine, prompt: object) -> list[list[int]]:
    """Return the token ids of each prompt in a completions request; raises EngineError(400)."""
    def is_ids(x: object) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in x)

    if isinstance(prompt, str):
        return [engine.prompts.text(prompt)]
    if is_ids(prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [engine.prompts.text(p) for p in prompt]
        if all(is_ids(p) for p in prompt):
            return [list(p) for p in prompt]
    raise EngineError(400, "'prompt' must be a string, a list of strings, a list of token ids, or a list of lists of token ids", param="prompt")


async def completions(engine: Engine, req: Request, resp: Responder) -> None:
    body = _json_body(req)
    lora = engine.resolve_model(body.get("model"))
    stream, include_usage = _stream_flags(body)
    prompts = _completion_prompts(engine, body.get("prompt"))
    if any(not p for p in prompts):
        raise EngineError(400, "the prompt is empty", param="prompt")
    _check_n(body)
    limits = [engine.max_tokens_for(len(p), _max_tokens_field(body)) for p in prompts]
    stop = _stop_list(body)
    salt = _cache_salt(body)
    model = body.get("model") or engine.cfg.model
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    adapter = lora.name if lora else None
    head = f'data: {{"id":"{rid}","object":"text_completion","created":{created},"model":{_dumps(model)},"choices":'.encode()
    choices = []
    n_prompt = n_out = n_cached = 0
    if stream:
        await resp.start(200, _SSE)
    for i, (prompt, max_tokens) in enumerate(zip(prompts, limits)):
        async with engine.run(prompt, lora=lora, cache_salt=salt) as run:
            out = plan_output(prompt, max_tokens, adapter=adapter, stop=stop)
            if stream:
                await _stream_pieces(run, resp, out, head, lambda text: {"text": text}, index=i)
            else:
                for _ in out.pieces:
                    await run.decode_step()
            run.completed(out)
            n_prompt += len(prompt)
            n_out += len(out.token_ids)
            n_cached += run.cached_tokens
            choices.append({"index": i, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason, "prompt_logprobs": None})
    if stream:
        if include_usage:
            await resp.chunk(head + b"[],\"usage\":" + _dumps(_usage(n_prompt, n_out, n_cached)).encode() + b"}\n\n")
        await resp.chunk(_SSE_DONE)
        await resp.end()
        return
    await resp.send_json(
        200,
        {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices, "usage": _usage(n_prompt, n_out, n_cached)},
    )


async def embeddings(engine: Engine, req: Request, resp: Responder) -> None:
    body = _json_body(req)
    engine.resolve_model(body.get("model"))
    inputs = _completion_prompts(engine, body.get("input"))
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise EngineError(400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    data = []
    total = 0
    for i, ids in enumerate(inputs):
        vec = embedding(ids, engine.cfg.embedding_dim)
        total += len(ids)
        value: object = vec if fmt == "float" else base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "embedding": value, "index": i})
    engine.count_request()
    await resp.send_json(
        200,
        {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": body.get("model") or engine.cfg.model,
            "data": data,
            "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0, "prompt_tokens_details": None},
        },
    )


# ---- models, tokenizer, LoRA, admin ------------------------------------------------------


def _model_card(engine: Engine, model_id: str, root: str, parent: str | None) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": engine.started_at,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": engine.cfg.max_model_len,
        "permission": [],
    }


async def models(engine: Engine, req: Request, resp: Responder) -> None:
    cards = [_model_card(engine, engine.cfg.model, engine.cfg.model, None)]
    cards += [_model_card(engine, ref.name, ref.path, engine.cfg.model) for ref in engine.loras.values()]
    await resp.send_json(200, {"object": "list", "data": cards})


async def tokenize(engine: Engine, req: Request, resp: Responder) -> None:
    body = _json_body(req)
    engine.resolve_model(body.get("model"))
    if "messages" in body:
        try:
            tokens = engine.prompts.chat(body)
        except ValueError as exc:
            raise EngineError(400, str(exc), param="messages") from None
    elif isinstance(body.get("prompt"), str):
        tokens = engine.prompts.text(body["prompt"])
    else:
        raise EngineError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
    strs = [tokenizer.decode([t]) for t in tokens] if body.get("return_token_strs") is True else None
    await resp.send_json(200, {"count": len(tokens), "max_model_len": engine.cfg.max_model_len, "tokens": tokens, "token_strs": strs})


async def tokenizer_files(engine: Engine, req: Request, resp: Responder) -> None:
    """The tokenizer files a gateway loads (``--tokenizer``/``--served-tokenizer``), as llmgw's vLLM guard serves them."""
    body = engine.prompts.served_body
    if body is None:
        raise EngineError(404, "this engine serves no tokenizer files (start it with --tokenizer DIR)",
                          err_type="NotFoundError")
    await resp.send(200, body)


async def detokenize(engine: Engine, req: Request, resp: Responder) -> None:
    body = _json_body(req)
    engine.resolve_model(body.get("model"))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise EngineError(400, "'tokens' must be a list of token ids", param="tokens")
    await resp.send_json(200, {"prompt": tokenizer.decode(tokens)})


async def load_lora_adapter(engine: Engine, req: Request, resp: Responder) -> None:
    body = _json_body(req)
    text = engine.load_lora(body.get("lora_name"), body.get("lora_path"))
    await resp.send(200, text.encode(), b"text/plain; charset=utf-8")


async def unload_lora_adapter(engine: Engine, req: Request, resp: Responder) -> None:
    body = _json_body(req)
    text = engine.unload_lora(body.get("lora_name"))
    await resp.send(200, text.encode(), b"text/plain; charset=utf-8")


async def health(engine: Engine, req: Request, resp: Responder) -> None:
    await resp.send(200, b"", b"text/plain")


async def metrics_page(engine: Engine, req: Request, resp: Responder) -> None:
    await resp.send(200, metrics.render(engine).encode(), b"text/plain; version=0.0.4; charset=utf-8")


async def version(engine: Engine, req: Request, resp: Responder) -> None:
    await resp.send_json(200, {"version": SIM_VERSION})


async def load(engine: Engine, req: Request, resp: Responder) -> None:
    await resp.send_json(200, {"server_load": engine.running + engine.waiting})


async def reset_prefix_cache(engine: Engine, req: Request, resp: Responder) -> None:
    engine.cache.clear()
    await resp.send(200, b"", b"text/plain")


async def debug_cached_blocks(engine: Engine, req: Request, resp: Responder) -> None:
    """``POST /debug/cached_blocks`` ``{"model", "tokens", "cache_salt"?}`` -> ``{"cached_blocks", "block_size"}``:
    the leading blocks of ``tokens`` this engine holds now (an oracle for routing benchmarks; vLLM has no such
    endpoint)."""
    body = _json_body(req)
    lora = engine.resolve_model(body.get("model"))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise EngineError(400, "'tokens' must be a list of token ids", param="tokens")
    hit = engine.cache.cached_blocks(tokens, lora=lora, cache_salt=_cache_salt(body))
    await resp.send_json(200, {"cached_blocks": hit, "block_size": engine.cfg.block_size})


async def kv_event_sources(engine: Engine, req: Request, resp: Responder) -> None:
    cfg = engine.cfg
    await resp.send_json(
        200,
        {
            "sources": [
                {
                    "data_parallel_rank": cfg.data_parallel_rank,
                    "endpoint": cfg.kv_events_endpoint,
                    "replay_endpoint": cfg.kv_replay_endpoint,
                    "topic": cfg.kv_topic,
                    "publisher": "zmq" if cfg.kv_events_endpoint else "null",
                }
            ]
        },
    )


#: Paths answered without the engine's secret: the liveness check (vLLM and llama-server leave
#: /health open too, so an agent or load balancer can probe without the key).
OPEN_PATHS = frozenset({"/health"})
_BEARER = "bearer "


def authorized(req: Request, api_key: str) -> bool:
    """Return whether ``req`` may be served: no secret is set, its path is open, or it carries
    ``Authorization: Bearer <api_key>`` (compared in constant time)."""
    if not api_key or req.path in OPEN_PATHS:
        return True
    for name, value in req.headers:
        if name.lower() == b"authorization":
            text = value.decode("latin-1")
            if text[: len(_BEARER)].lower() != _BEARER:
                return False
            return hmac.compare_digest(text[len(_BEARER):].strip().encode("latin-1"), api_key.encode())
    return False


def _unauthorized() -> dict[str, Any]:
    """The 401 body, in OpenAI's shape (``invalid_api_key``); it never echoes the key sent."""
    return {"error": {
        "message": "Incorrect API key provided: send the engine's key as 'Authorization: Bearer <key>'.",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key",
    }}


ROUTES: dict[str, tuple[str, Route]] = {
    "/v1/chat/completions": ("POST", chat_completions),
    "/v1/completions": ("POST", completions),
    "/v1/embeddings": ("POST", embeddings),
    "/v1/models": ("GET", models),
    "/tokenize": ("POST", tokenize),
    "/detokenize": ("POST", detokenize),
    "/v1/load_lora_adapter": ("POST", load_lora_adapter),
    "/v1/unload_lora_adapter": ("POST", unload_lora_adapter),
    "/health": ("GET", health),
    "/metrics": ("GET", metrics_page),
    "/version": ("GET", version),
    "/load": ("GET", load),
    "/reset_prefix_cache": ("POST", reset_prefix_cache),
    "/kv_event_sources": ("GET", kv_event_sources),
    "/debug/cached_blocks": ("POST", debug_cached_blocks),
    "/llmgw/tokenizer": ("GET", tokenizer_files),
}


def make_handler(engine: Engine) -> Callable[[Request, Responder], Awaitable[None]]:
    """Return the HTTP handler serving :data:`ROUTES` for ``engine``; refusals become JSON errors.

    With a secret (``engine.cfg.api_key``), a request without it gets 401 on every path but
    :data:`OPEN_PATHS`, before anything else (even a 404 would tell a stranger what exists).
    """

    async def handle(req: Request, resp: Responder) -> None:
        if not authorized(req, engine.cfg.api_key):
            await resp.send_json(401, _unauthorized())
            return
        route = ROUTES.get(req.path)
        if route is None:
            await resp.send_json(404, _error_body(404, f"no route for {req.path}", "NotFoundError"))
            return
        method, fn = route
        if req.method != method:
            await resp.send_json(405, _error_body(405, f"{req.path} accepts {method} only", "MethodNotAllowed"))
            return
        try:
            await fn(engine, req, resp)
        except EngineError as exc:
            if resp.started:
                raise
            await resp.send_json(exc.status, _error_body(exc.status, exc.message, exc.err_type, exc.param))

    return handle

