"""A streamed request whose tokens the server holds (no replica left: they wait for a re-plan's, up to
~2 minutes) is kept alive: while nothing else is written, an SSE comment goes out every
``KEEPALIVE_S``, always between whole events, so a client whose read timeout is shorter than the hold
keeps waiting. The OpenAI SDK skips the comments; a stream that never goes quiet carries none; none
follows ``[DONE]``. Over the real HTTP server, with the fake engine holding the request."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from hetserve.serve import choices
from hetserve.serve.fake import FakeBackend

COMMENT = choices.KEEPALIVE.encode()


class HeldBackend(FakeBackend):
    """The fake engine holding every request's tokens until ``release`` is set, as the engine holds
    them while no replica is left and a re-plan brings new ones."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    async def generate(self, *args, **kwargs):
        await asyncio.to_thread(self.release.wait)
        async for token in super().generate(*args, **kwargs):
            yield token


class Tap(httpx.BaseTransport):
    """Loopback HTTP whose response bytes the test keeps as they arrive (``raw``); ``release`` is set
    once two keep-alive comments have come, ending the hold."""

    def __init__(self, release: threading.Event | None = None):
        self.inner, self.raw, self.release = httpx.HTTPTransport(), bytearray(), release

    def handle_request(self, request):
        resp = self.inner.handle_request(request)
        return httpx.Response(resp.status_code, headers=resp.headers, stream=_Tapped(resp.stream, self),
                              extensions=resp.extensions)

    def close(self):
        self.inner.close()


class _Tapped(httpx.SyncByteStream):
    def __init__(self, stream, tap: Tap):
        self.stream, self.tap = stream, tap

    def __iter__(self):
        for chunk in self.stream:
            self.tap.raw += chunk
            if self.tap.release is not None and self.tap.raw.count(COMMENT) >= 2:
                self.tap.release.set()
            yield chunk

    def close(self):
        self.stream.close()


def streamed(url: str, endpoint: str, tap: Tap) -> list[dict]:
    """The SDK's chunks of one streamed request (without their id and creation time), read through ``tap``
    with a read timeout far below the hold a re-plan may need."""
    with httpx.Client(transport=tap, timeout=10) as http:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=10, http_client=http)
        usage = {"include_usage": True}
        if endpoint == "completions":
            chunks = sdk.completions.create(model="tiny", prompt="hello", max_tokens=5, stream=True, seed=0,
                                            stream_options=usage)
        else:
            chunks = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True, seed=3, stream_options=usage)
        return [c.model_dump(exclude={"id", "created"}) for c in chunks]


def carries_text(event: str) -> bool:
    if not event.startswith("data: {"):
        return False
    choice = (json.loads(event[len("data: "):])["choices"] or [{}])[0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_held_stream_sends_keepalive_comments_between_events_until_its_tokens_come(serve_fake, monkeypatch,
                                                                                    endpoint):
    monkeypatch.setattr(choices, "KEEPALIVE_S", 0.05)
    url, backend, _ = serve_fake(HeldBackend())
    tap = Tap(backend.release)
    try:
        held = streamed(url, endpoint, tap)  # without keep-alives: the read timeout, the hold never ended
    finally:
        backend.release.set()
    events = bytes(tap.raw).decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", events[-3:]  # nothing after [DONE]
    # every event whole: a comment stands alone between two events, never inside one
    assert all(e == ": keep-alive" or e.startswith("data: ") for e in events[:-1]), events
    first_text = next(i for i, e in enumerate(events) if carries_text(e))
    assert events[:first_text].count(": keep-alive") >= 2, events  # sent while the tokens were held

    # the SDK reads exactly what a stream never held gives, and that one's bytes carry no comment
    monkeypatch.setattr(choices, "KEEPALIVE_S", 15.0)
    plain_url, _, _ = serve_fake()
    plain = Tap()
    assert streamed(plain_url, endpoint, plain) == held
    assert COMMENT not in plain.raw and bytes(plain.raw).endswith(b"data: [DONE]\n\n")
