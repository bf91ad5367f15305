"""The OpenAI-compatible HTTP front: ``create_app(coordinator) -> FastAPI``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming and not),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).

FastAPI is imported at module level (route annotations must resolve); the CLI imports this module
only inside ``hetserve serve``. Bodies are read and validated here (``hetserve.serve.protocol``); everything below HTTP — limits,
placement, generation, detokenization, abort — is the ``Coordinator``'s. Every error leaves through
``hetserve.serve.errors`` (one place), as ``{"error": {...}}`` with a 4xx/5xx status, or as one SSE
event when a stream fails after its headers were sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from hetserve.serve.coordinator import Coordinator, Prepared
from hetserve.serve.errors import InvalidRequest, ModelNotFound, error_event, install_error_handlers, to_api_error
from hetserve.serve.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, CompletionChoice,
                                     CompletionRequest, CompletionResponse, DeltaMessage, ModelCard, ModelList,
                                     Usage, new_id, now_s)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_DISCONNECT_POLL_S = 0.25


def create_app(coordinator: Coordinator, *, on_shutdown=None):
    """The FastAPI app serving ``coordinator``. ``on_shutdown``: an async callable run at shutdown."""
    @asynccontextmanager
    async def lifespan(_app):
        yield
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="hetserve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.state.coordinator = coordinator
    started = now_s()
    c = coordinator

    def check_model(name: str) -> None:
        if name != c.model_name:
            raise ModelNotFound(f"The model '{name}' does not exist; this server serves '{c.model_name}'.",
                                param="model")

    async def read_body(request: Request, cls):
        raw = await request.body()
        try:
            data = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise InvalidRequest("request body must be a JSON object")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from exc

    # ------------------------------------------------------------------ info routes
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": c.model_name, "in_flight": c.in_flight}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=c.model_name, created=started, max_model_len=c.max_context)])

    @app.get("/metrics")
    async def metrics():
        body, ctype = c.metrics.render()
        return Response(body, media_type=ctype)

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await read_body(request, CompletionRequest)
        check_model(body.model)
        req = _prepare(c, "completions", body, body.single_prompt, body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
        rid, created = new_id("cmpl"), now_s()
        if body.stream:
            def chunk(text: str, finish: str | None) -> str:
                return CompletionResponse(id=rid, created=created, model=c.model_name,
                                          choices=[CompletionChoice(text=text, finish_reason=finish)]
                                          ).model_dump_json()

            def usage_chunk() -> str:
                return CompletionResponse(id=rid, created=created, model=c.model_name, choices=[],
                                          usage=Usage.of(req.prompt_tokens, req.completion_tokens)).model_dump_json()

            return _sse(c, req, None, chunk, usage_chunk if body.include_usage else None)
        await _collect(c, req, request)
        return JSONResponse(CompletionResponse(
            id=rid, created=created, model=c.model_name,
            choices=[CompletionChoice(text=req.text, finish_reason=req.finish_reason)],
            usage=Usage.of(req.prompt_tokens, req.completion_tokens)).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatCompletionRequest = await read_body(request, ChatCompletionRequest)
        check_model(body.model)
        prompt = c.codec.render_chat([(m.role, m.text) for m in body.messages])
        req = _prepare(c, "chat", body, prompt, body.token_limit, None, prompt_param="messages")
        rid, created = new_id("chatcmpl"), now_s()
        if body.stream:
            def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
                delta = DeltaMessage(role="assistant" if role else None, content=text)
                return ChatCompletionChunk(id=rid, created=created, model=c.model_name,
                                           choices=[ChatChunkChoice(delta=delta, finish_reason=finish)]
                                           ).model_dump_json(exclude_none=False)

            def usage_chunk() -> str:
                return ChatCompletionChunk(id=rid, created=created, model=c.model_name, choices=[],
                                           usage=Usage.of(req.prompt_tokens, req.completion_tokens)).model_dump_json()

            return _sse(c, req, chunk("", None, role=True), chunk, usage_chunk if body.include_usage else None)
        await _collect(c, req, request)
        return JSONResponse(ChatCompletionResponse(
            id=rid, created=created, model=c.model_name,
            choices=[ChatChoice(message=AssistantMessage(content=req.text), finish_reason=req.finish_reason)],
            usage=Usage.of(req.prompt_tokens, req.completion_tokens)).model_dump())

    app.state.started = time.time()
    return app


def _prepare(c: Coordinator, endpoint: str, body, prompt, max_tokens, default_max, prompt_param: str = "prompt"
             ) -> Prepared:
    try:
        return c.prepare(endpoint, prompt, max_tokens=max_tokens, default_max_tokens=default_max,
                         temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                         stop=body.stop_strings, prompt_param=prompt_param)
    except Exception:
        c.reject(endpoint)
        raise


async def _collect(c: Coordinator, req: Prepared, request) -> None:
    """Run ``req`` to the end; if the client goes away first, cancel it (which aborts it in the engine)."""

    async def drain() -> None:
        async for _ in c.run(req):
            pass

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                task.result()
                return
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return  # nobody to answer
    finally:
        if not task.done():
            task.cancel()


def _sse(c: Coordinator, req: Prepared, first: str | None, chunk, usage_chunk):
    async def events() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield f"data: {first}\n\n"
            async for delta in c.run(req):
                yield f"data: {chunk(delta, None)}\n\n"
            yield f"data: {chunk('' if first is None else None, req.finish_reason)}\n\n"
            if usage_chunk is not None:
                yield f"data: {usage_chunk()}\n\n"
        except Exception as exc:  # noqa: BLE001 - headers are out: report in-band, then end the stream
            yield error_event(exc)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


__all__ = ["create_app", "to_api_error"]
