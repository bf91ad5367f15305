"""How hetserve route ends a stream whose backend fails after the first bytes reached the client: as
``hetserve serve`` ends one, with an error event and then ``data: [DONE]``, each an event of its own."""

import asyncio

import httpx

from tests.serve.test_route import Backends, RouteServer, deploy_of


def events(text: str) -> list[str]:
    return [e for e in text.replace("\r\n", "\n").split("\n\n") if e.strip()]


def test_a_backend_killed_mid_stream_ends_the_stream_with_an_error_event_then_done(tmp_path):
    backends = Backends()
    # a slow stream (a token a second) from a process this test can SIGKILL once the first token is out
    backends.start([("k0", "colocated", 0.0, 1.0)], process=True)
    route = RouteServer(deploy_of(backends, [("k0", "colocated")]), tmp_path, health_interval_s=0)
    try:
        with httpx.stream("POST", f"{route.url}/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "hi", "max_tokens": 1000, "stream": True}) as r:
            assert r.status_code == 200
            got = ""
            parts = r.iter_text()
            while "k0-0" not in got:
                got += next(parts)
            backends.kill("k0")
            got += "".join(parts)
    finally:
        route.stop()
        backends.stop()
    evs = events(got)
    assert evs[0].startswith("data: ") and "k0-0" in evs[0]
    assert '"error"' in evs[-2] and "backend k0 failed mid-stream" in evs[-2], evs[-2:]
    assert evs[-1] == "data: [DONE]", evs[-2:]
    assert got.endswith("\n\n")


def test_a_stream_cut_inside_an_event_gets_its_error_event_and_done_as_events_of_their_own():
    """A backend cut off halfway through an event: that event is ended, so the error event and
    [DONE] after it are read as events, not as the rest of the broken one."""
    from hetserve.serve.route.app import Router
    from hetserve.serve.route.backends import Backend, BackendPool, RouteConfig

    class Cut(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            yield b'data: {"choi'
            raise httpx.ReadError("connection reset")

    async def scenario():
        router = Router(BackendPool(RouteConfig((Backend("b0", "colocated", "http://b0"),))), health_interval_s=0)
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(
            lambda request: httpx.Response(200, stream=Cut())))
        _, _, stream = await router.answer("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
        got = b"".join([chunk async for chunk in stream])
        await router.close()
        return got.decode()

    evs = events(asyncio.run(scenario()))
    assert evs[1] == 'data: {"choi'
    assert evs[2].startswith('data: {"error"') and "backend b0 failed mid-stream" in evs[2]
    assert evs[3:] == ["data: [DONE]"]
