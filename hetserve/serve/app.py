"""The OpenAI-compatible HTTP front: ``create_app(coordinator) -> FastAPI``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming and not),
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` (200 ok / degraded, 503 when no live
replica can serve or the server is draining), ``GET /metrics`` (Prometheus text format).

Keys (``hetserve.serve.keys``): with API keys set, every route but the probes (``/health``,
``/metrics``; them too with ``protect_probes``) needs ``Authorization: Bearer <key>``; ``/admin/*`` needs
an admin key and does not exist (404) without one. The check (``keys.KeyGate``) runs on the request's
path before any routing and before the body is read, so every path is guarded, known or not (an
unknown ``/v1/*`` path or method gets 401 without a key, not 404 / 405).

Every client error (4xx) is logged with its field and counted in ``hetserve_requests_total`` with
outcome ``rejected`` (``unauthorized`` for a missing or wrong key); while draining (graceful
shutdown), new requests get 503 with ``Retry-After``.

FastAPI is imported at module level (route annotations must resolve); the CLI imports this module
only inside ``hetserve serve``. Bodies are read and validated here (``hetserve.serve.protocol``); everything below HTTP — limits,
placement, generation, detokenization, abort — is the ``Coordinator``'s. Every error leaves through
``hetserve.serve.errors`` (one place), as ``{"error": {...}}`` with a 4xx/5xx status, or as one SSE
event when a stream fails after its headers were sent.
"""

from __future__ import annotations

import asyncio
import collections
import time
from contextlib import asynccontextmanager
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hetserve.errors import HetserveError
from hetserve.serve.limits import DEFAULT_MAX_BODY_BYTES
from hetserve.serve.bodies import ClientGone, json_object, read_bytes, validated
from hetserve.serve.choices import LogprobWriter, collect, prompt_entries, share_prompts, sse
from hetserve.serve.coordinator import Coordinator, Prepared
from hetserve.serve.errors import (ContextLengthExceeded, InvalidRequest, ModelNotFound, Overloaded,
                                   ServerError, ShuttingDown, Unavailable, install_error_handlers, log,
                                   to_api_error)
from hetserve.serve.keys import ADMIN_PREFIX, APIAuth, guarded_app
from hetserve.serve.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, CompletionChoice,
                                     CompletionRequest, CompletionResponse, DeltaMessage, ModelCard, ModelList,
                                     Usage, new_id, now_s)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# prompts up to this many characters (or token ids) are tokenized on the event loop: well under a
# millisecond, and never queued behind huge prompts in the thread pool
INLINE_PROMPT_CHARS = 16_384
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def create_app(coordinator: Coordinator, *, on_shutdown=None, auth: APIAuth | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The FastAPI app serving ``coordinator``. ``on_shutdown``: an async callable run at shutdown.
    ``auth``: the keys (default none: the API open, the admin routes off). ``max_body_bytes``: the
    largest request body read (413 beyond it)."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    @asynccontextmanager
    async def lifespan(_app):
        yield
        if on_shutdown is not None:
            await on_shutdown()

    auth = auth or APIAuth()

    app = FastAPI(title="hetserve", version="0.1.0", lifespan=lifespan, **guarded_app(auth))
    c = coordinator

    def count_client_error(path: str, err) -> None:
        if 400 <= err.status < 500:
            endpoint = "admin" if path.startswith(ADMIN_PREFIX + "/") else _ENDPOINTS.get(path, "other")
            outcome = "unauthorized" if err.status == 401 else "rejected"
            c.metrics.requests.labels(endpoint, outcome).inc()  # bounded labels

    install_error_handlers(app, on_error=count_client_error)

    async def client_gone(request: Request, _exc: ClientGone):
        # counted, not logged as an error: a client hanging up mid-upload is ordinary traffic
        c.metrics.requests.labels(_ENDPOINTS.get(request.url.path, "other"), "aborted").inc()
        return Response(status_code=499)  # nginx's "client closed request"; no one reads it

    app.add_exception_handler(ClientGone, client_gone)
    app.state.coordinator = coordinator
    app.state.auth = auth
    started = now_s()

    def admit(endpoint: str, body) -> None:
        if c.draining:
            c.reject(endpoint)
            raise ShuttingDown()
        check_model(body.model)
        why = c.unavailable()
        if why is not None:  # one answer in both modes, before any stream starts
            c.reject(endpoint, "unavailable")
            raise Unavailable(why, comes_back=c.comes_back())
        ignored = body.ignored_fields()
        if ignored:
            log.warning("%s: ignored request fields (they change nothing here): %s", endpoint, ", ".join(ignored))

    def check_model(name: str) -> None:
        if name != c.model_name:
            raise ModelNotFound(f"The model '{name}' does not exist; this server serves '{c.model_name}'.",
                                param="model")

    def check_length(size_chars: int, param: str) -> None:
        """Refuse a prompt that cannot fit the context before tokenizing it: a token covers at most
        ``codec.max_token_chars`` characters, so more than context × that many characters is more
        than the context in tokens (tokenizing megabytes would take seconds and hold gigabytes)."""
        bound = getattr(c.codec, "max_token_chars", None)
        if bound and size_chars > c.max_context * bound:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {c.max_context} tokens, however your {param} has "
                f"{size_chars} characters, more than {c.max_context} tokens even at {bound} characters per "
                "token (the tokenizer's longest). Please reduce the length of the prompt.", param=param)

    async def read_body(request: Request, cls):
        return validated(cls, json_object(await read_bytes(request, max_body_bytes)))

    async def run_to_end(reqs: list[Prepared], request: Request) -> None:
        """``collect`` the choices of a request answered in one body. One the shutdown ended (the
        drain timeout, a second signal: the engine fails what it holds) is a 503 with ``Retry-After``,
        not a fault: another instance, or this one restarted, can serve it."""
        try:
            await collect(c, reqs, request)
        except (ServerError, Overloaded) as exc:  # as a backend says it: a fault, or the shutdown's refusal
            if not c.draining:
                raise
            raise ShuttingDown(exc.message) from exc

    # ------------------------------------------------------------------ info routes
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        status, replicas = c.health()
        body = {"status": status, "model": c.model_name, "in_flight": c.in_flight, "replicas": replicas,
                "lost_devices": c.lost_devices()}
        return JSONResponse(body, status_code=503 if status in ("unavailable", "draining") else 200)

    def card() -> ModelCard:
        return ModelCard(id=c.model_name, created=started, max_model_len=c.usable_context())

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return ModelList(data=[card()])

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        check_model(model_id)
        return card()

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        body, ctype = c.metrics.render()
        return Response(body, media_type=ctype)

    # ------------------------------------------------------------------ elastic re-plan
    @app.post("/admin/replan")
    async def admin_replan(request: Request):
        """Re-plan now. Body (all optional): {"cluster": path of an updated cluster file,
        "lost": [devices gone], "returned": [devices back]}. Answers the re-plan record."""
        if c.replanner is None:
            raise InvalidRequest("this server cannot re-plan (the Ray backend places its actors once)")
        if c.draining:  # the re-plan's new workers would start only for the shutdown to stop them
            raise ShuttingDown()
        data = json_object(await read_bytes(request, max_body_bytes), empty={})
        unknown = sorted(set(data) - {"cluster", "lost", "returned"})
        if unknown:
            raise InvalidRequest(f"unrecognized field {unknown[0]!r}; expected cluster, lost, returned",
                                 param=unknown[0])
        if data.get("cluster") is not None and not isinstance(data["cluster"], str):
            raise InvalidRequest("'cluster' must be a cluster file path or preset name", param="cluster")
        for key in ("lost", "returned"):
            v = data.get(key)
            if v is not None and not (isinstance(v, list) and all(isinstance(d, str) for d in v)):
                raise InvalidRequest(f"'{key}' must be a list of device names", param=key)
            twice = sorted(d for d, n in collections.Counter(v or ()).items() if n > 1)
            if twice:  # a list written by hand or a script gone wrong: say so rather than guess
                raise InvalidRequest(f"'{key}' names {', '.join(twice[:8])} more than once", param=key)
        try:
            record = await asyncio.to_thread(c.replanner.replan, data.get("cluster"), data.get("lost"),
                                             data.get("returned"))
        except HetserveError as exc:  # a device list the cluster refuses names its field (ReplanInputError)
            raise InvalidRequest(f"re-plan failed: {exc}", param=getattr(exc, "param", None)) from exc
        return JSONResponse(record)

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await read_body(request, CompletionRequest)
        admit("completions", body)
        prompts = body.prompts
        for p in prompts:
            if isinstance(p, str):
                check_length(len(p), "prompt")
        ids_of = [await _tokenize(c, len(p), lambda p=p: p) for p in prompts]
        k = body.logprobs
        reqs = [_prepare(c, "completions", body, ids, body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS,
                         index=i * body.n + j, logprobs=k, prompt_logprobs=k if body.echo else None)
                for i, ids in enumerate(ids_of) for j in range(body.n)]
        prompt_of = {r.index: ids_of[r.index // body.n] for r in reqs}
        share_prompts(reqs, body.n)
        writers = {r.index: LogprobWriter(c.codec) for r in reqs}
        rid, created = new_id("cmpl"), now_s()

        def usage() -> Usage:
            return Usage.of(sum(len(ids) for ids in ids_of), sum(r.completion_tokens for r in reqs))

        def echoed(req: Prepared) -> tuple[str, dict | None]:
            ids = prompt_of[req.index]
            text = c.codec.decode(ids)
            lps = writers[req.index].completions(prompt_entries(ids, req.prompt_logprobs)) if k is not None else None
            return text, lps

        if body.stream:
            sent = {r.index: 0 for r in reqs}  # logprob entries already streamed, per choice
            echo_due = {r.index: body.echo for r in reqs}

            def first(req: Prepared) -> list[str]:
                return []  # with echo the prompt goes out with the first chunk, once its logprobs are in

            def chunk(req: Prepared, text: str | None, finish: str | None) -> str:
                head, lps = "", None
                if echo_due[req.index]:
                    echo_due[req.index] = False
                    head, lps = echoed(req)
                new = req.logprobs[sent[req.index]:]
                sent[req.index] += len(new)
                if k is not None:
                    more = writers[req.index].completions(new)
                    lps = more if lps is None else {key: lps[key] + more[key] for key in lps}
                choice = CompletionChoice(index=req.index, text=head + (text or ""), logprobs=lps,
                                          finish_reason=finish)
                return CompletionResponse(id=rid, created=created, model=c.model_name, choices=[choice],
                                          usage=running_usage(body, req)).model_dump_json()

            def usage_chunk() -> str:
                return CompletionResponse(id=rid, created=created, model=c.model_name, choices=[],
                                          usage=usage()).model_dump_json()

            return sse(c, reqs, first, chunk, usage_chunk if body.include_usage else None)
        await run_to_end(reqs, request)
        choices = []
        for req in reqs:
            text, lps = echoed(req) if body.echo else ("", None)
            if k is not None:
                more = writers[req.index].completions(req.logprobs)
                lps = more if lps is None else {key: lps[key] + more[key] for key in lps}
            choices.append(CompletionChoice(index=req.index, text=text + req.text, logprobs=lps,
                                            finish_reason=req.finish_reason))
        return JSONResponse(CompletionResponse(id=rid, created=created, model=c.model_name, choices=choices,
                                               usage=usage()).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatCompletionRequest = await read_body(request, ChatCompletionRequest)
        admit("chat", body)
        messages = [(m.role, m.text) for m in body.messages]
        check_length(sum(len(t) for _, t in messages), "messages")
        ids = await _tokenize(c, sum(len(t) for _, t in messages), lambda: c.codec.render_chat(messages), "messages")
        k = body.sampled_logprobs
        reqs = [_prepare(c, "chat", body, ids, body.token_limit, None, prompt_param="messages", index=j, logprobs=k)
                for j in range(body.n)]
        share_prompts(reqs, body.n)
        writer = LogprobWriter(c.codec)
        rid, created = new_id("chatcmpl"), now_s()

        def usage() -> Usage:
            return Usage.of(len(ids), sum(r.completion_tokens for r in reqs))

        if body.stream:
            sent = {r.index: 0 for r in reqs}

            def make(req: Prepared, delta: DeltaMessage, lps: dict | None, finish: str | None) -> str:
                return ChatCompletionChunk(id=rid, created=created, model=c.model_name,
                                           choices=[ChatChunkChoice(index=req.index, delta=delta, logprobs=lps,
                                                                    finish_reason=finish)],
                                           usage=running_usage(body, req)).model_dump_json(exclude_none=False)

            def first(req: Prepared) -> list[str]:
                return [make(req, DeltaMessage(role="assistant", content=""), None, None)]

            def chunk(req: Prepared, text: str | None, finish: str | None) -> str:
                new = req.logprobs[sent[req.index]:]
                sent[req.index] += len(new)
                lps = writer.chat(new) if k is not None and new else None
                return make(req, DeltaMessage(content=text), lps, finish)

            def usage_chunk() -> str:
                return ChatCompletionChunk(id=rid, created=created, model=c.model_name, choices=[],
                                           usage=usage()).model_dump_json()

            return sse(c, reqs, first, chunk, usage_chunk if body.include_usage else None)
        await run_to_end(reqs, request)
        return JSONResponse(ChatCompletionResponse(
            id=rid, created=created, model=c.model_name,
            choices=[ChatChoice(index=r.index, message=AssistantMessage(content=r.text), finish_reason=r.finish_reason,
                                logprobs=writer.chat(r.logprobs) if k is not None else None) for r in reqs],
            usage=usage()).model_dump())

    app.state.started = time.time()
    return app


def running_usage(body, req: Prepared) -> Usage | None:
    """The usage so far, for a stream chunk when the client asked for it in every chunk."""
    return Usage.of(req.prompt_tokens, req.completion_tokens) if body.continuous_usage else None


async def _tokenize(c: Coordinator, size: int, make_prompt, prompt_param: str = "prompt") -> list[int]:
    """``c.tokenize(make_prompt())``, on a worker thread when the prompt is over ``INLINE_PROMPT_CHARS``
    (``size``): rendering and tokenizing megabytes of text takes seconds, and on the event loop it
    would stall every other stream and /health meanwhile."""
    def work() -> list[int]:
        return c.tokenize(make_prompt(), prompt_param)

    return work() if size <= INLINE_PROMPT_CHARS else await asyncio.to_thread(work)


def _prepare(c: Coordinator, endpoint: str, body, ids: list[int], max_tokens, default_max,
             prompt_param: str = "prompt", index: int = 0, logprobs: int | None = None,
             prompt_logprobs: int | None = None) -> Prepared:
    # a client error raised here is counted as rejected by the error handler. Choice ``index`` draws
    # with seed + index, so each choice equals a single request sent with that seed.
    seed = None if body.seed is None else (body.seed + index + 2 ** 63) % 2 ** 64 - 2 ** 63
    temperature, top_p = body.sampling_knobs
    return c.prepare(endpoint, ids, max_tokens=max_tokens, default_max_tokens=default_max,
                     temperature=temperature, top_p=top_p, seed=seed,
                     stop=body.stop_strings, prompt_param=prompt_param, ignore_eos=body.ignore_eos,
                     min_tokens=body.min_tokens, presence_penalty=body.presence_penalty,
                     frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                     logprobs=logprobs, prompt_logprobs=prompt_logprobs, index=index)


__all__ = ["create_app", "to_api_error"]
