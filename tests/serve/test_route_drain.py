"""``hetserve route`` shuts down as ``hetserve serve`` does: on SIGTERM / Ctrl-C it refuses new requests
with 503 while the streams in flight run to their end, and exits 0; a second signal ends those left
at once, each with an error event and ``[DONE]``; no traceback either way."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.serve.test_route import Backends, wait_up

TOKENS = 150  # per stream, one every CHUNK_S from the stand-in: about 3 s a stream, so none ends before
# the signal even where a loaded machine starts one thread a second late
CHUNK_S = 0.02


@pytest.fixture(scope="module")
def backend():
    b = Backends()
    b.start([("b0", "colocated", 0.0, CHUNK_S)], process=True)
    yield b.urls["b0"]
    b.stop()


class Route:
    """``hetserve route`` as a process of its own (signals go to it alone), on a port the OS picks."""

    def __init__(self, backend_url: str, *extra: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "hetserve.cli.main", "route", "--backends", backend_url,
                                      "--port", "0", "--health-interval", "0", *extra], stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "NO_PROXY": "127.0.0.1"})
        line = self.proc.stderr.readline()
        found = re.search(r"on (http://127\.0\.0\.1:\d+):", line)
        assert found, line
        self.url = found.group(1)
        wait_up(self.url)

    def finish(self, timeout_s: float = 30.0) -> tuple[int, str]:
        """(exit status, the rest of its stderr)."""
        try:
            rest = self.proc.communicate(timeout=timeout_s)[1]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rest = self.proc.communicate()[1]
        return self.proc.returncode, rest


def start_streams(url: str, n: int) -> tuple[list[list[str]], list[threading.Thread], threading.Barrier]:
    """``n`` streamed completions on threads; each appends its SSE ``data:`` payloads to its list
    (an exception's text where the stream broke). The barrier is passed once each has its first event."""
    got: list[list[str]] = [[] for _ in range(n)]
    first = threading.Barrier(n + 1, timeout=30)

    def one(i):
        body = {"model": "tiny", "prompt": "hi", "max_tokens": TOKENS, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got[i].append(line[len("data: "):])
                        if len(got[i]) == 1:
                            first.wait()
        except Exception as exc:  # noqa: BLE001 - a broken stream is what the test looks for
            got[i].append(f"broken: {type(exc).__name__} {exc}")
            if len(got[i]) == 1:
                first.abort()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return got, threads, first


def test_sigterm_drains_every_stream_to_its_end_refuses_new_requests_and_exits_0(backend):
    route = Route(backend)
    got, threads, first = start_streams(route.url, 4)
    first.wait()  # every stream has its first event: all four are in flight
    route.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    refused = httpx.post(f"{route.url}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=10)
    health = httpx.get(f"{route.url}/health", timeout=10)  # as serve's: a load balancer stops sending
    for t in threads:
        t.join(30)
    status, log = route.finish()
    assert health.status_code == 503 and health.json()["status"] == "draining", health.text
    for events in got:  # each stream whole: every token, then [DONE], no error event
        assert events[-1] == "[DONE]", events[-2:]
        assert len(events) == TOKENS + 1 and not any('"error"' in e for e in events), events[-3:]
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    assert status == 0, log
    assert "draining 4 request(s)" in log and "hetserve route stopped" in log, log
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_a_second_signal_ends_the_streams_in_flight_with_an_error_event_then_done(backend):
    route = Route(backend, "--drain-timeout", "60")
    got, threads, first = start_streams(route.url, 2)
    first.wait()
    route.proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    route.proc.send_signal(signal.SIGINT)
    for t in threads:
        t.join(30)
    status, log = route.finish()
    for events in got:
        assert events[-1] == "[DONE]", events[-2:]
        assert len(events) < TOKENS + 1, "the stream ran to its end: the second signal did not end it"
        error = json.loads(events[-2])["error"]
        assert "second signal" in error["message"], error
    assert status == 0, log
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_end_now_wakes_a_stream_and_a_request_whose_backend_sends_nothing_more():
    """The second signal's ``end_now`` answers a stream whose backend has gone quiet (an error event,
    then ``[DONE]``) and a request still waiting for its backend (the 503), within its grace."""
    from hetserve.serve.errors import ShuttingDown
    from hetserve.serve.route.app import Router
    from hetserve.serve.route.backends import Backend, BackendPool, RouteConfig

    class Stalls(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": []}\n\n'
            await asyncio.sleep(60)

    async def handler(request):
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, stream=Stalls())
        await asyncio.sleep(60)

    async def scenario():
        router = Router(BackendPool(RouteConfig((Backend("b0", "colocated", "http://b0"),))), health_interval_s=0)
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        _, _, stream = await router.answer("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
        got = []

        async def read():
            async for chunk in stream:
                got.append(chunk)

        async def plain():
            try:
                await router.until_ended(router.answer("/v1/completions", {"model": "m", "prompt": "hi"}))
            except ShuttingDown as exc:
                return exc

        tasks = [asyncio.ensure_future(read()), asyncio.ensure_future(plain())]
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        await router.end_now("stopped by a second signal", grace_s=0)
        _, refused = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        took = time.monotonic() - t0
        await router.close()
        return got, refused, took

    got, refused, took = asyncio.run(scenario())
    assert b"stopped by a second signal" in got[-2] and got[-1] == b"data: [DONE]\n\n", got
    assert isinstance(refused, ShuttingDown) and refused.status == 503 and refused.headers["Retry-After"]
    assert took < 2, took
