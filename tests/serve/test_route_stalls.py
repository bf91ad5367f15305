"""A backend that goes quiet without closing its connections (frozen, or its host gone) does not hold
route's requests for the whole request timeout: once health checks have taken it out, a request that
has waited on it for ``stall_s`` moves to another backend (nothing answered yet) or ends with an error
event and ``[DONE]`` (streaming). A stream whose backend is marked down but still sends is left alone."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx

from tests.serve.test_route import Backends, wait_up


def router_for(handler, *ids, stall_s=0.3):
    from hetserve.serve.route.app import Router
    from hetserve.serve.route.backends import Backend, BackendPool, RouteConfig

    router = Router(BackendPool(RouteConfig(tuple(Backend(i, "colocated", f"http://{i}") for i in ids)), "rr"),
                    health_interval_s=0, health_failures=1, stall_s=stall_s)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return router


def count(router, backend, outcome):
    return router.metrics.registry.get_sample_value("hetserve_route_requests_total",
                                                    {"backend": backend, "outcome": outcome}) or 0


async def checks_until(router, backend, done, every_s=0.05, limit_s=10.0):
    """Health checks of ``backend`` (as the health loop makes them) until ``done`` is."""
    t = time.monotonic() + limit_s
    while not done.done() and time.monotonic() < t:
        await router.check(backend)
        await asyncio.sleep(every_s)


async def stream_under_checks(router, every_s):
    """A streamed request to backend b0, read to its end while b0's health checks run; its chunks."""
    _, _, stream = await router.answer("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
    got = []

    async def read():
        async for chunk in stream:
            got.append(chunk)

    reader = asyncio.ensure_future(read())
    await checks_until(router, router.pool.by_id["b0"], reader, every_s=every_s)
    await asyncio.wait_for(reader, 5)
    return got


def relayed_with_checks_timing_out(stream, stall_s=0.3, every_s=0.05):
    """``stream`` (an ``httpx.AsyncByteStream`` class: backend b0's answer) relayed while b0's health
    checks time out: (the chunks the client got, the router)."""
    async def handler(request):
        if request.url.path == "/health":
            raise httpx.ReadTimeout("no answer", request=request)
        return httpx.Response(200, stream=stream())

    async def scenario():
        router = router_for(handler, "b0", stall_s=stall_s)
        got = await stream_under_checks(router, every_s=every_s)
        await router.close()
        return got, router

    return asyncio.run(scenario())


def test_a_stream_from_a_backend_gone_quiet_ends_with_an_error_event_once_it_is_down():
    class Quiet(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            await asyncio.sleep(60)

    async def handler(request):
        if request.url.path == "/health":
            raise httpx.ReadTimeout("no answer", request=request)
        return httpx.Response(200, stream=Quiet())

    async def scenario():
        router = router_for(handler, "b0")
        t0 = time.monotonic()
        got = await stream_under_checks(router, every_s=0.05)
        took = time.monotonic() - t0
        await router.close()
        return got, took, router

    got, took, router = asyncio.run(scenario())
    assert got[0].startswith(b'data: {"choices"'), got
    assert b"nothing for 0.3 s" in got[-2] and got[-1] == b"data: [DONE]\n\n", got
    assert took < 5, took  # not the request timeout (600 s)
    assert (count(router, "b0", "broken"), count(router, "b0", "200")) == (1, 0)


def test_a_request_waiting_on_a_backend_gone_quiet_moves_to_another_once_it_is_down():
    answered = []

    async def handler(request):
        host = request.url.host
        if request.url.path == "/health":
            if host == "b0":
                raise httpx.ReadTimeout("no answer", request=request)
            return httpx.Response(200, json={})
        if host == "b0":
            await asyncio.sleep(60)
        answered.append(host)
        return httpx.Response(200, json={"choices": [{"text": host}]})

    async def scenario():
        router = router_for(handler, "b0", "b1")
        request = asyncio.ensure_future(router.answer("/v1/completions", {"model": "m", "prompt": "hi"}))
        await asyncio.sleep(0.05)  # rr: the first request is b0's
        await checks_until(router, router.pool.by_id["b0"], request)
        status, body, _ = await asyncio.wait_for(request, 5)
        await router.close()
        return status, body, router

    status, body, router = asyncio.run(scenario())
    assert status == 200 and body["choices"][0]["text"] == "b1" and answered == ["b1"]
    assert count(router, "b0", "failed") == 1
    assert router.metrics.registry.get_sample_value("hetserve_route_retries_total", {"backend": "b0"}) == 1


def test_a_stream_still_sending_from_a_backend_marked_down_is_left_to_finish():
    """Taken out by its health checks, the backend still sends (slow /health, busy engine): its waits
    are each shorter than ``stall_s``, so the stream runs to its end."""
    # waits of 0.05 s against a stall_s of 1 s (a pause of the whole process, GC or the scheduler,
    # stretches a wait: it must not look like a stall); the stream outlasts stall_s by half again
    class Steady(httpx.AsyncByteStream):
        async def __aiter__(self):
            for i in range(30):
                yield f'data: {{"choices": [{{"text": "{i}"}}]}}\n\n'.encode()
                await asyncio.sleep(0.05)
            yield b"data: [DONE]\n\n"

    got, router = relayed_with_checks_timing_out(Steady, stall_s=1.0, every_s=0.02)
    text = b"".join(got)
    assert not router.pool.by_id["b0"].alive
    assert text.count(b"data: ") == 31 and text.endswith(b"data: [DONE]\n\n") and b"error" not in text, text
    assert count(router, "b0", "200") == 1


def test_a_backend_answering_its_checks_with_503_keeps_its_requests_however_long_they_wait():
    """A 503 from /health says the backend lives (``serve`` draining, or holding requests for a
    re-plan): taken out, it still gets to answer what it holds, a stream after a pause and a plain
    request after its whole generation, both longer than ``stall_s``."""
    class Paused(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            await asyncio.sleep(0.8)
            yield b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n'

    async def handler(request):
        if request.url.path == "/health":
            return httpx.Response(503, json={"status": "unavailable"})
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, stream=Paused())
        await asyncio.sleep(0.8)
        return httpx.Response(200, json={"choices": [{"text": "whole"}]})

    async def scenario():
        router = router_for(handler, "b0", stall_s=0.3)
        _, _, stream = await router.answer("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
        plain = asyncio.ensure_future(router.answer("/v1/completions", {"model": "m", "prompt": "hi"}))
        await asyncio.sleep(0.05)  # sent, before the checks take the backend out

        async def read():
            return b"".join([chunk async for chunk in stream])

        both = asyncio.gather(read(), plain)
        await checks_until(router, router.pool.by_id["b0"], both)
        streamed, (status, body, _) = await asyncio.wait_for(both, 5)
        await router.close()
        return streamed, status, body, router

    streamed, status, body, router = asyncio.run(scenario())
    assert not router.pool.by_id["b0"].alive
    assert streamed.endswith(b"data: [DONE]\n\n") and b"error" not in streamed, streamed
    assert status == 200 and body["choices"][0]["text"] == "whole"


def test_a_stream_the_backend_ends_with_an_error_event_is_counted_as_error():
    class Fails(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            yield b'data: {"error": {"message": "worker lost", "type": "server_error"}}\n\ndata: [DONE]\n\n'

    async def scenario():
        router = router_for(lambda request: httpx.Response(200, stream=Fails()), "b0")
        _, _, stream = await router.answer("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
        got = b"".join([chunk async for chunk in stream])
        await router.close()
        return got, router

    got, router = asyncio.run(scenario())
    assert b"worker lost" in got and got.endswith(b"data: [DONE]\n\n")
    assert (count(router, "b0", "error"), count(router, "b0", "200")) == (1, 0)


def test_a_frozen_backend_process_ends_routes_stream_within_the_stall_timeout():
    """The real thing: ``hetserve route`` in front of a stand-in backend process that the test stops
    (SIGSTOP) mid-stream; the client's stream ends with an error event, then ``[DONE]``, in seconds."""
    b = Backends()
    b.start([("b0", "colocated", 0.0, 0.05)], process=True)
    route = subprocess.Popen([sys.executable, "-m", "hetserve.cli.main", "route", "--backends", b.urls["b0"],
                              "--port", "0", "--health-interval", "0.2", "--health-failures", "2",
                              "--stall-timeout", "1"],
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "NO_PROXY": "127.0.0.1"})
    pid = b.procs["b0"].pid
    try:
        found = re.search(r"on (http://127\.0\.0\.1:\d+):", route.stderr.readline())
        assert found
        wait_up(found.group(1))
        events = []
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{found.group(1)}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 3:
                        os.kill(pid, signal.SIGSTOP)
                        stopped = time.monotonic()
        took = time.monotonic() - stopped
    finally:
        os.kill(pid, signal.SIGCONT)
        route.terminate()
        route.wait(timeout=30)
        b.stop()
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert "nothing for 1 s" in error["message"], error
    assert took < 30, took  # health checks (2 × ~2 s timeouts) + the stall timeout, not the 600 s request timeout
