"""The FastAPI app of ``hetserve route`` (``Router`` does the forwarding; ``route.app``)."""

from contextlib import asynccontextmanager

from fastapi import Request  # at module level: FastAPI reads the routes' annotations from here

from hetserve.serve.keys import APIAuth, guarded_app
from hetserve.serve.limits import DEFAULT_MAX_BODY_BYTES
from hetserve.serve.route.app import CREDENTIALS_REFUSED, BackendRefusedCredentials, Router
from hetserve.serve.route.relay import RelayedResponse


def create_app(router: Router, auth: APIAuth | None = None):
    """The app forwarding to ``router``'s backends; ``auth``: the keys its clients need (as
    ``hetserve serve``'s: ``serve.keys``; default none, the API open)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    from hetserve.serve.bodies import ClientGone, json_object, read_bytes, validated
    from hetserve.serve.errors import ModelNotFound, ShuttingDown, Unavailable, install_error_handlers
    from hetserve.serve.protocol import ChatCompletionRequest, CompletionRequest

    @asynccontextmanager
    async def lifespan(app):
        router.start()
        yield
        await router.close()

    app = FastAPI(title="hetserve route", lifespan=lifespan, **guarded_app(auth or APIAuth()))
    app.add_middleware(CountInFlight, router=router)
    install_error_handlers(app)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # the client hung up mid-upload: nobody reads it, nothing to log

    @app.exception_handler(BackendRefusedCredentials)
    async def credentials_refused(request: Request, exc: BackendRefusedCredentials):
        # the router logged it once per backend already: not again as a failure of every request
        return JSONResponse(exc.body(), status_code=exc.status)

    async def read_body(request: Request) -> tuple[dict, bytes]:
        if router.draining:  # a graceful shutdown: as serve refuses, before the body is read
            raise ShuttingDown()
        raw = await read_bytes(request, DEFAULT_MAX_BODY_BYTES)  # serve's limit and reading: one body, one answer
        return json_object(raw), raw

    async def forward(request: Request, path: str, body: dict, raw: bytes):
        status, data, stream = await router.until_ended(router.answer(path, body, raw), request.is_disconnected)
        if stream is not None:
            return RelayedResponse(stream, media_type="text/event-stream")
        return JSONResponse(data, status_code=status)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, raw = await read_body(request)
        validated(CompletionRequest, body)  # serve's models and messages: bad input is never forwarded
        return await forward(request, "/v1/completions", body, raw)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body, raw = await read_body(request)
        validated(ChatCompletionRequest, body)
        return await forward(request, "/v1/chat/completions", body, raw)

    @app.get("/v1/models")
    async def models():
        return JSONResponse(await model_list())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        # as serve answers it: the model's card, or model_not_found naming what is served
        listed = await model_list()
        cards = [m for m in listed.get("data", []) if isinstance(m, dict)] if isinstance(listed, dict) else []
        for card in cards:
            if card.get("id") == model_id:
                return JSONResponse(card)
        served = ", ".join(repr(m.get("id")) for m in cards) or "none"
        raise ModelNotFound(f"The model '{model_id}' does not exist; the backends serve {served}.", param="model")

    async def model_list():
        """A live backend's ``GET /v1/models`` answer."""
        refused = None  # a backend that refused route's credentials: the reason, if none answers
        for b in router.pool.config.backends:
            if b.alive:
                try:
                    r = await router.client.get(f"{b.url}/v1/models", headers=router.headers, timeout=5.0)
                except Exception:
                    continue
                if r.status_code == 200:
                    return r.json()
                if r.status_code in CREDENTIALS_REFUSED:
                    router.credentials_refused(b, r.status_code)
                    refused = refused or BackendRefusedCredentials(b.id, r.status_code)
        if refused is not None:
            raise refused
        raise Unavailable("no backend can serve: every one is down")

    @app.get("/health")
    async def health():
        up = {b.id: b.alive for b in router.pool.config.backends}
        ok = any(up[b.id] for b in router.pool.entry) and (not router.pool.decode or any(
            up[b.id] for b in router.pool.decode))
        # as `serve`'s /health: degraded while a backend is down but the rest can still serve, 503
        # draining once a shutdown began (a load balancer sends its traffic elsewhere)
        status = ("draining" if router.draining else "unavailable" if not ok
                  else "ok" if all(up.values()) else "degraded")
        return JSONResponse({"status": status, "backends": up},
                            status_code=200 if status in ("ok", "degraded") else 503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class CountInFlight:
    """ASGI middleware: ``router.in_flight`` counts the API requests (``/v1/...``) from their start to
    their answer's last byte, a stream's included, whatever ends them (the drain waits on it)."""

    def __init__(self, app, router: Router):
        self.app, self.router = app, router

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        self.router.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.router.in_flight -= 1
