"""``hetserve route`` in front of a stream ``hetserve serve`` holds: serve's keep-alive comments are
route's client's too (relayed whole, the first of them the stream's first bytes), and they never hide
a frozen backend: a frozen process sends nothing, keep-alives included, so once its health checks go
unanswered the stall timeout ends its stream as before."""

from __future__ import annotations

import asyncio

import httpx

from hetserve.serve import choices
from tests.serve.test_route_stalls import count, relayed_with_checks_timing_out
from tests.serve.test_stream_keepalive import COMMENT, HeldBackend, carries_text


def test_route_relays_the_keepalives_of_a_stream_serve_holds(serve_fake, monkeypatch):
    from hetserve.serve.route.app import Router
    from hetserve.serve.route.backends import Backend, BackendPool, RouteConfig

    monkeypatch.setattr(choices, "KEEPALIVE_S", 0.05)
    url, backend, _ = serve_fake(HeldBackend())

    async def scenario():
        router = Router(BackendPool(RouteConfig((Backend("b0", "colocated", url),))), health_interval_s=0,
                        timeout_s=10)  # without keep-alives: no first byte before this
        got = b""
        try:
            _, _, stream = await router.answer("/v1/completions", {"model": "tiny", "prompt": "hello",
                                                                   "max_tokens": 3, "stream": True})
            async for chunk in stream:
                got += chunk
                if got.count(COMMENT) >= 2:  # route's client hears them while serve holds the tokens
                    backend.release.set()
        finally:
            backend.release.set()
            await router.close()
        return got

    got = asyncio.run(scenario()).decode()
    events = got.split("\n\n")
    assert events[:2] == [": keep-alive"] * 2 and events[-2:] == ["data: [DONE]", ""], events
    assert all(e == ": keep-alive" or e.startswith("data: {") for e in events[:-2]), events
    assert any(carries_text(e) for e in events)  # the held tokens, after them


def test_a_backend_that_froze_after_sending_keepalives_still_stalls_out():
    """Keep-alives came, then nothing (SIGSTOP sends no comment either): the stall timeout ends the
    stream with an error event and ``[DONE]``, the comments before it relayed."""
    class KeptAliveThenFrozen(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield COMMENT
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            yield COMMENT
            await asyncio.sleep(60)  # frozen

    got, router = relayed_with_checks_timing_out(KeptAliveThenFrozen)
    assert got[:3] == [COMMENT, b'data: {"choices": [{"text": "a"}]}\n\n', COMMENT], got
    assert b"nothing for 0.3 s" in got[-2] and got[-1] == b"data: [DONE]\n\n", got
    assert count(router, "b0", "broken") == 1
