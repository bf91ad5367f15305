"""A client that leaves route before its answer came frees the backend: route closes its request to
the backend, so a backend that aborts on disconnect (``hetserve serve`` does) stops generating for
nobody. Streams already did (the relay's write fails); a request answered in one body waited for
the backend's whole answer."""

import asyncio
import json
import select
import socket
import threading
import time

import pytest

from hetserve.serve.server import ServerThread


class SlowBackend:
    """An OpenAI-shaped backend whose completions take ``answer_s`` and which records when a request's
    client (route) went away before that."""

    def __init__(self, answer_s: float = 20.0):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        self.gone: list[float] = []  # when each abandoned request's connection closed
        self.started = threading.Event()
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.post("/v1/completions")
        async def completions(request: Request):
            await request.body()
            self.started.set()
            end = time.monotonic() + answer_s
            while time.monotonic() < end:
                if await request.is_disconnected():
                    self.gone.append(time.monotonic())
                    return JSONResponse({}, status_code=499)
                await asyncio.sleep(0.02)
            return {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}

        self.server = ServerThread(app)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_before_its_answer_closes_routes_request_to_the_backend(stream):
    from hetserve.serve.route.app import Router
    from hetserve.serve.route.backends import Backend, BackendPool, RouteConfig
    from hetserve.serve.route.server import create_app

    backend = SlowBackend()
    router = Router(BackendPool(RouteConfig((Backend("b0", "colocated", backend.server.url),)), "rr"),
                    health_interval_s=0)
    route = ServerThread(create_app(router))
    try:
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4, "stream": stream}).encode()
        # the client leaves once the backend has its request, not after a fixed wait a loaded machine
        # may not have forwarded it by
        with socket.create_connection((route.host, route.port), timeout=10) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: route\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert backend.started.wait(10), "route never forwarded the request"
            # nothing came back yet: a stream's headers wait for the backend's first byte too
            assert not select.select([client], [], [], 0)[0]
        left = time.monotonic()
        deadline = left + 10.0  # well short of the backend's 20 s answer
        while not backend.gone and time.monotonic() < deadline:
            time.sleep(0.05)
        # route polls its client every 0.25 s; the backend sees the close within its own poll
        assert backend.gone, "the backend kept working for a client that had left route"
    finally:
        route.stop()
        backend.server.stop()


class FirstByteBackend:
    """A backend whose stream sends its first event at once and then keeps going for ``answer_s``;
    ``gone`` records when route closed its request (the stream's generator was closed)."""

    def __init__(self, answer_s: float = 20.0):
        from fastapi import FastAPI
        from fastapi.responses import StreamingResponse

        self.gone: list[float] = []
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.post("/v1/completions")
        async def completions():
            async def events():
                try:
                    yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
                    end = time.monotonic() + answer_s
                    while time.monotonic() < end:
                        await asyncio.sleep(0.02)
                    yield b"data: [DONE]\n\n"
                finally:
                    self.gone.append(time.monotonic())
            return StreamingResponse(events(), media_type="text/event-stream")

        self.server = ServerThread(app)


def test_a_client_gone_before_a_streams_headers_releases_the_backend():
    """The backend's first byte came, and route's client is gone before route sends its headers (the
    server's first send fails, as uvicorn's does on a closed connection): Starlette then never reads
    the relayed body, and the relay's clean-up must still close the backend request and uncount it."""
    from starlette.requests import ClientDisconnect

    from hetserve.serve.route.app import Router
    from hetserve.serve.route.backends import Backend, BackendPool, RouteConfig
    from hetserve.serve.route.server import create_app

    backend = FirstByteBackend()
    router = Router(BackendPool(RouteConfig((Backend("b0", "colocated", backend.server.url),)), "rr"),
                    health_interval_s=0)
    body = b'{"model": "m", "prompt": "hi", "max_tokens": 4, "stream": true}'
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                                               (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80)}

    async def run() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client says nothing more

        async def send(message):
            if message["type"] == "http.response.start":
                raise OSError("the client closed the connection")

        try:
            with pytest.raises(ClientDisconnect):
                await create_app(router)(scope, receive, send)
        finally:
            await router.close()

    try:
        asyncio.run(run())
        deadline = time.monotonic() + 5.0
        while not backend.gone and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.gone, "route kept its request to the backend open for a client that had left"
        assert router.pool.by_id["b0"].in_flight == 0
    finally:
        backend.server.stop()
