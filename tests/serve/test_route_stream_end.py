"""How hetserve route relays a backend's stream: whole events only, unchanged and in order however the
backend's chunks split them (but for the Unicode line ends ``route.sse`` escapes); one that fails after the first bytes reached the client ends as
``hetserve serve`` ends one, with an error event and then ``data: [DONE]``, the event it was cut off
inside never sent."""

import asyncio
import json
import random

import httpx
import pytest

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


class Chunks(httpx.AsyncByteStream):
    """A backend's stream body: ``chunks`` as they are, then a reset connection if ``cut``."""

    def __init__(self, chunks, cut):
        self.chunks, self.cut = chunks, cut

    async def __aiter__(self):
        for c in self.chunks:
            yield c
        if self.cut:
            raise httpx.ReadError("connection reset")


def router_over(chunks, cut=False):
    """A Router whose one backend streams ``chunks`` (and then, if ``cut``, is cut off)."""
    from hetserve.serve.route.app import Router
    from hetserve.serve.route.backends import Backend, BackendPool, RouteConfig

    router = Router(BackendPool(RouteConfig((Backend("b0", "colocated", "http://b0"),))), health_interval_s=0)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, stream=Chunks(chunks, cut))))
    return router


def relayed(chunks, cut=False) -> list[bytes]:
    """The chunks route sends its client for a backend streaming ``chunks``."""
    async def scenario():
        router = router_over(chunks, cut)
        _, _, stream = await router.answer("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
        got = [chunk async for chunk in stream]
        await router.close()
        return got

    return asyncio.run(scenario())


def test_a_stream_cut_inside_an_event_drops_that_event_and_ends_with_error_then_done():
    """A backend cut off halfway through an event: the part of it that came is never sent, so the
    client reads whole events only, the error event and [DONE] among them."""
    got = b"".join(relayed([b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choi'], cut=True)).decode()
    assert "choi" not in got.split("\n\n", 1)[1], got
    evs = events(got)
    assert evs[0] == 'data: {"choices": [{"text": "a"}]}'
    assert evs[1].startswith('data: {"error"') and "backend b0 failed mid-stream" in evs[1], evs
    assert evs[2:] == ["data: [DONE]"]
    for ev in evs[:-1]:  # as the OpenAI SDK reads them: every data line but [DONE] is JSON
        json.loads(ev.removeprefix("data: "))


def test_a_cut_just_after_an_event_boundary_split_across_chunks_keeps_that_event():
    for crlf in (False, True):
        end = b"\r\n\r\n" if crlf else b"\n\n"
        one = b'data: {"n": 1}' + end
        # the boundary is split over two chunks; the next event is cut off before its end
        got = b"".join(relayed([one[:-1], one[-1:] + b'data: {"n": 2', b"}"], cut=True)).decode()
        evs = events(got)
        assert evs[0] == 'data: {"n": 1}', (crlf, evs)
        assert "backend b0 failed mid-stream" in evs[1] and evs[2:] == ["data: [DONE]"], (crlf, evs)


def test_a_client_on_the_openai_sdk_reads_the_error_of_a_stream_cut_inside_an_event():
    """What the client is for: the OpenAI SDK raises the error event's message (it json.loads each
    data line, so half an event would be a JSONDecodeError instead, and the error never read)."""
    import openai  # the dev extra's: make test installs it

    from hetserve.serve.route.server import create_app

    async def scenario():
        router = router_over([b'data: {"id": "c", "object": "text_completion", "created": 1, "model": "m", '
                              b'"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n',
                              b'data: {"id": "c", "object": "text_com'], cut=True)
        client = openai.AsyncOpenAI(base_url="http://route/v1", api_key="k", max_retries=0, http_client=
                                    httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(router))))
        texts = []
        try:
            stream = await client.completions.create(model="m", prompt="hi", stream=True)
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
        except openai.APIError as exc:
            return texts, exc
        finally:
            await client.close()
            await router.close()
        return texts, None

    texts, err = asyncio.run(scenario())
    assert texts == ["a"]
    assert isinstance(err, openai.APIError) and "backend b0 failed mid-stream" in err.message, repr(err)


STREAM = (b'data: {"choices": [{"text": "one"}]}\n\n'
          b': a comment\n\n'
          b'event: x\ndata: {"choices": [{"text": "two\\nlines"}]}\n\n'
          b'data: {"choices": [{"text": "three"}]}\n\n'
          b'data: [DONE]\n\n')


@pytest.mark.parametrize("ending", ["lf", "crlf", "cr"])
def test_a_whole_stream_arrives_unchanged_in_whole_events_however_the_backend_splits_it(ending):
    stream = STREAM.replace(b"\n", {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}[ending])
    rng = random.Random(7)
    splits = [[stream[i:i + 1] for i in range(len(stream))],  # a byte at a time
              [stream[:k] for k in (len(stream),)]]  # all at once
    for _ in range(30):  # at random places
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 12)))
        splits.append([stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])])
    double = {"lf": b"\n\n", "crlf": b"\r\n\r\n", "cr": b"\r\r"}[ending]
    whole = [e + double for e in stream.split(double)[:-1]]
    for chunks in splits:
        got = relayed(chunks)
        assert b"".join(got) == stream, chunks
        # each chunk sent is whole events, the stream's own in its order
        sent = [e + double for c in got for e in c.split(double)[:-1]]
        assert sent == whole and all(c.endswith(double) for c in got), (chunks, got)
    # streamed, not buffered: fed a byte at a time, each event goes out on its own once it has ended
    assert relayed(splits[0]) == whole


def test_unicode_line_ends_a_backend_sends_raw_reach_a_line_splitting_client_escaped_and_whole():
    """vLLM sends a token's U+2028 raw inside its JSON: relayed so, a client splitting lines as
    Python's str.splitlines does (httpx's iter_lines) cuts that event in two. Route escapes them, as
    serve does its own, even where a backend's chunks split such a character's bytes."""
    text = "a\u2028b\x85c\u2029d"
    raw = ('data: {"choices": [{"text": "%s"}]}\n\ndata: [DONE]\n\n' % text).encode()
    for chunks in ([raw], [raw[i:i + 1] for i in range(len(raw))]):
        got = b"".join(relayed(chunks)).decode()
        lines = [line for line in got.splitlines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) == 2, lines
        assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == text


def test_a_stream_that_ends_without_a_last_boundary_is_sent_whole():
    assert b"".join(relayed([b"data: 1\n\ndata: [DO", b"NE]"])) == b"data: 1\n\ndata: [DONE]"


def test_an_event_past_the_size_limit_ends_the_stream_as_broken(monkeypatch):
    from hetserve.serve.route import sse

    monkeypatch.setattr(sse, "MAX_EVENT_BYTES", 64)
    got = b"".join(relayed([b"data: 1\n\n", b"data: " + b"x" * 50, b"x" * 50, b"\n\n"])).decode()
    evs = events(got)
    assert evs[0] == "data: 1" and "over 64 bytes" in evs[1] and evs[2:] == ["data: [DONE]"], evs
    assert "xxx" not in got
