"""The HTTP front's hardening against real clients' habits (fake engine, one server for the module):
body-size limit, a cheap length bound, clients that hang up at any point, no replica left,
strict booleans, HEAD probes, usage in every chunk."""

from __future__ import annotations

import json
import logging
import socket

import httpx
import pytest

from hetserve.serve.fake import ByteCodec, FakeBackend

MAX_BODY = 64 * 1024
CONTEXT = 256


class _CountingCodec(ByteCodec):
    def __init__(self):
        self.longest = 0

    def encode(self, text: str) -> list[int]:
        self.longest = max(self.longest, len(text))
        return super().encode(text)


class _Errors(logging.Handler):
    """Every record at ERROR or above (tracebacks are logged at ERROR by uvicorn and by us)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def server():
    from hetserve.serve.app import create_app
    from hetserve.serve.coordinator import Coordinator
    from hetserve.serve.server import ServerThread

    backend = FakeBackend(replicas=2, slots=1, token_delay_s=0.01, max_context=CONTEXT)
    codec = _CountingCodec()
    coord = Coordinator(backend, codec, "tiny")
    errors = _Errors()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "hetserve.serve")]
    for lg in loggers:
        lg.addHandler(errors)
    srv = ServerThread(create_app(coord, max_body_bytes=MAX_BODY))
    try:
        yield srv.url, backend, codec, errors
    finally:
        srv.stop()
        for lg in loggers:
            lg.removeHandler(errors)


def _count(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics").text
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def _raw(url: str, head: bytes, body: bytes, close_after: bool = False) -> bytes:
    """Send ``head`` + ``body`` on a fresh socket; hang up at once (``close_after``) or read the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + body)
        if close_after:
            return b""
        out = b""
        while b"\r\n\r\n" not in out or len(out) < out.index(b"\r\n\r\n") + 4 + _length(out):
            part = s.recv(65536)
            if not part:
                break
            out += part
        return out


def _length(resp: bytes) -> int:
    for line in resp.split(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def _head(url: str, length: int) -> bytes:
    host = url.removeprefix("http://")
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    url, backend, _, _ = server
    before = _count(url, "hetserve_requests_total", endpoint="completions", outcome="rejected")
    # announces 20 MB, sends 14 bytes: the answer comes without waiting for the rest
    resp = _raw(url, _head(url, 20_000_000), b'{"model": "ti')
    assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
    assert json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
    # no Content-Length (chunked): counted as it arrives
    chunks = (b'{"model": "tiny", "prompt": "' + b"x" * 8192 for _ in range(2 * MAX_BODY // 8192))
    r = httpx.post(url + "/v1/completions", content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert _count(url, "hetserve_requests_total", endpoint="completions", outcome="rejected") == before + 2
    assert not backend.placed


def test_a_prompt_longer_than_the_context_is_refused_before_tokenizing(server):
    url, _, codec, _ = server
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": "y" * (CONTEXT + 1)}),
                       ("/v1/chat/completions", {"model": "tiny",
                                                 "messages": [{"role": "user", "content": "y" * (CONTEXT + 1)}]})):
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert codec.longest <= CONTEXT  # neither reached the tokenizer


def test_a_client_that_hangs_up_mid_upload_is_counted_quietly(server, wait_until):
    url, _, _, errors = server
    seen = len(errors.records)
    before = _count(url, "hetserve_requests_total", endpoint="completions", outcome="aborted")
    _raw(url, _head(url, 1000), b'{"model": "ti', close_after=True)
    assert wait_until(lambda: _count(url, "hetserve_requests_total", endpoint="completions",
                                     outcome="aborted") == before + 1, 5)
    assert errors.records[seen:] == []


def test_hang_ups_in_the_queue_and_mid_stream_are_counted_with_their_tokens(server, wait_until):
    url, backend, _, errors = server
    seen = len(errors.records)
    before = _count(url, "hetserve_requests_total", endpoint="completions", outcome="aborted")
    tokens_before = _count(url, "hetserve_generation_tokens_total")
    got = 0
    with httpx.stream("POST", url + "/v1/completions", timeout=10,
                      json={"model": "tiny", "prompt": "x", "max_tokens": 200, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                got += 1
            if got == 3:
                # the slot of r0 is held: a second request waits in the queue, then its client leaves too
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(url + "/v1/completions", timeout=0.3,
                               json={"model": "tiny", "prompt": "x", "max_tokens": 200})
                break
    assert wait_until(lambda: _count(url, "hetserve_requests_total", endpoint="completions",
                                     outcome="aborted") == before + 2, 5)
    assert wait_until(lambda: not backend.running and not backend.waiting, 5)
    assert _count(url, "hetserve_generation_tokens_total") >= tokens_before + got
    assert errors.records[seen:] == []


@pytest.mark.parametrize("stream", [False, True])
def test_no_live_replica_is_503_in_both_modes_and_asks_for_a_retry_only_where_it_can_come_back(serve_fake, stream):
    """Without a re-plan an operator can reach (an admin key), only a restart brings the server back:
    no ``Retry-After`` to invite retries that cannot succeed."""
    url, backend, coord = serve_fake()
    before = _count(url, "hetserve_requests_total", endpoint="chat", outcome="unavailable")
    backend.dead.update({"r0", "r1"})

    def ask():
        return httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "stream": stream,
                                                             "messages": [{"role": "user", "content": "hi"}]})
    try:
        r = ask()
        assert r.status_code == 503 and "retry-after" not in r.headers, (r.status_code, r.headers)
        assert r.json()["error"]["code"] == "unavailable"
        assert "serves again once the server is restarted" in r.json()["error"]["message"]  # no re-planner here
        coord.replanner, coord.admin_replan = object(), True  # an operator's re-plan can bring it back
        r = ask()
        assert r.status_code == 503 and r.headers["retry-after"].isdigit(), (r.status_code, r.headers)
        assert "POST /admin/replan" in r.json()["error"]["message"]
    finally:
        backend.dead.clear()
    assert _count(url, "hetserve_requests_total", endpoint="chat", outcome="unavailable") == before + 2


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_that_refuses_every_request_is_503_before_any_stream_starts(serve_fake, stream, monkeypatch):
    """A re-plan that failed with no replica left: the engine lists no replica and says why it is
    broken; a request gets the 503 naming that, not a 200 stream whose first event is the error."""
    url, backend, _ = serve_fake()
    monkeypatch.setattr(backend, "replicas", lambda: [], raising=False)
    monkeypatch.setattr(backend, "broken", "no replica left, and the re-plan failed: TimeoutError()", raising=False)
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": stream})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", (r.status_code, r.text)
    assert "the re-plan failed: TimeoutError()" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").json()["status"] == "unavailable"

    # broken with its replicas still listed alive (the engine's own loop failed): refused all the same
    monkeypatch.undo()
    monkeypatch.setattr(backend, "broken", "the coordinator failed: RuntimeError('x')", raising=False)
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": stream})
    assert r.status_code == 503 and "the coordinator failed" in r.json()["error"]["message"], (r.status_code, r.text)
    assert httpx.get(url + "/health").json()["status"] == "unavailable"


@pytest.mark.parametrize("field, value, words", [("stream", "yes", "valid boolean"),
                                                 ("echo", 1, "valid boolean"),
                                                 ("ignore_eos", "true", "valid boolean")])
def test_booleans_are_strict(server, field, value, words):
    url, _, _, _ = server
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field and words in r.text, r.text


def test_nan_temperature_names_the_real_rule(server):
    url, _, _, _ = server
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "finite number" in r.json()["error"]["message"], r.text
    assert "less than" not in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", "/v1/models/tiny"])
def test_head_is_served_where_get_is(server, path):
    url, _, _, _ = server
    r = httpx.head(url + path)
    assert r.status_code == 200 and r.content == b"", (path, r.status_code)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_continuous_usage_stats_puts_usage_in_every_chunk(server, path, body):
    url, _, _, _ = server
    req = {"model": "tiny", "max_tokens": 4, "stream": True, **body,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", url + path, json=req, timeout=10) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    usages = [e["usage"] for e in events]
    assert all(u is not None for u in usages), usages
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 4 and usages[0]["prompt_tokens"] > 0
    # without continuous_usage_stats only the last chunk carries it
    req["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", url + path, json=req, timeout=10) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert [e.get("usage") is not None for e in events] == [False] * (len(events) - 1) + [True]


@pytest.mark.parametrize("prompt, max_tokens, param", [(100, 10, "messages"), (40, 40, "max_tokens"),
                                                     (70, 10, "messages")])
def test_a_request_no_kv_pool_holds_names_the_field_to_shorten(prompt, max_tokens, param):
    """A prompt that alone outgrows the pools it needs points at the prompt (no completion length
    helps); one that fits alone but not with its completion points at ``max_tokens``. The pools: a
    prefill replica of 128 tokens and a decode replica of 64 (16-token blocks): 70 tokens fit the
    prefill pool but, with one output token, not the decode one. The figure named is the decode
    pool's: the one the request exceeds (not the larger prefill pool, which it fits)."""
    from hetserve.policies.request_checks import KVNeverFits, check_kv_fits
    from hetserve.serve.errors import refusal

    with pytest.raises(KVNeverFits) as info:
        check_kv_fits(prompt, max_tokens, [("prefill", 128.0), ("decode", 64.0)], 16)
    err = refusal(info.value, prompt_param="messages")
    assert err.param == param and "a replica that decodes holds 64 tokens" in str(err) and "128" not in str(err)


def test_health_is_degraded_while_a_replan_runs_without_lost_devices():
    """Every replica of the re-planned deployment lives, but devices whose workers died are out of it
    until returned: /health says degraded and names them; returned, it says ok again."""
    from types import SimpleNamespace

    from hetserve.serve.app import create_app
    from hetserve.serve.coordinator import Coordinator
    from hetserve.serve.server import ServerThread

    coord = Coordinator(FakeBackend(replicas=2, slots=1, max_context=CONTEXT), _CountingCodec(), "tiny")
    coord.replanner = SimpleNamespace(lost={"m0:1"})
    srv = ServerThread(create_app(coord))
    try:
        body = httpx.get(srv.url + "/health").json()
        assert body["status"] == "degraded" and body["lost_devices"] == ["m0:1"]
        assert all(r["alive"] for r in body["replicas"])
        coord.replanner.lost = set()
        body = httpx.get(srv.url + "/health").json()
        assert body["status"] == "ok" and body["lost_devices"] == []
    finally:
        srv.stop()
