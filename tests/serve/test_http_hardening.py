"""The HTTP front under bad input, benchmark clients, lost replicas and graceful shutdown (fake engine)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from hetserve.serve.errors import _validation_error
from hetserve.serve.fake import ByteCodec, FakeBackend

NESTED = b'{"model": "tiny", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"


def _body(**fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "x", **fields}).encode()


# (body, param the 400 must name); each must be refused before anything reaches the engine
BAD = [
    (b'{"model": "tiny", "prompt": "\\ud800"}', None),  # a lone surrogate: valid JSON, not text
    (NESTED, None),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}", None),  # past int's 4,300 digits
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 1e999}', "max_tokens"),
    (_body(n=0), "n"),
    (_body(top_k=5), "top_k"),
    (_body(repetition_penalty=0), "repetition_penalty"),
    (_body(logprobs=21), "logprobs"),
    (_body(echo=True, max_tokens=0, best_of=2), "best_of"),
    (_body(min_tokens=-1), "min_tokens"),
    (_body(min_tokens=9, max_tokens=4), "min_tokens"),
    (_body(seed=10 ** 30), "seed"),
    (_body(stream_options={"include_usage": True}), "stream_options"),
    (_body(prompt=[[1, 2], []]), "prompt"),
    (_body(prompt=[999_999]), "prompt"),
    (_body(metadata=["not", "a", "map"]), "metadata"),
    (_body(max_tokens=True), "max_tokens"),  # no lax coercion: a boolean is no count, a string no number
    (_body(max_tokens="5"), "max_tokens"),
    (_body(prompt=[True, False]), "prompt"),
]


@pytest.mark.parametrize("body, param", BAD, ids=range(len(BAD)))
def test_bad_bodies_are_one_400_naming_the_field_and_counted(serve_fake, body, param):
    url, backend, _ = serve_fake()
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert not backend.placed
    metrics = httpx.get(url + "/metrics").text
    assert 'hetserve_requests_total{endpoint="completions",outcome="rejected"} 1.0' in metrics


@pytest.mark.parametrize("prompt, got", [(123, "123"), ([1.5], "[1.5]"), ({"text": "x"}, "{'text': 'x'}")])
def test_a_prompt_of_no_accepted_type_is_one_line_naming_the_types(serve_fake, prompt, got):
    """pydantic reports a union mismatch once per member (``prompt.str``, ``prompt.list[int].0``, ...)."""
    url, backend, _ = serve_fake()
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt", r.text
    assert err["message"] == f"prompt: must be str, list[int], list[str] or list[list[int]]; got {got}"
    assert not backend.placed


def test_a_chat_content_of_no_accepted_type_names_the_types(serve_fake):
    url, backend, _ = serve_fake()
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": 5}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages.0.content", r.text
    assert err["message"] == "messages.0.content: must be str or list[TextPart]; got 5"
    assert not backend.placed


@pytest.mark.parametrize("body", [b"\xff\xfe{", '{"model": "tiny", "prompt": "x"}'.encode("utf-16")])
def test_a_body_that_is_not_utf8_is_a_400_saying_so(serve_fake, body):
    url, backend, _ = serve_fake()
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not UTF-8 text (byte 0xff)" in r.json()["error"]["message"], r.text
    assert not backend.placed


def test_a_user_message_without_content_is_refused_but_an_assistants_is_not(serve_fake):
    url, backend, _ = serve_fake()
    chat = url + "/v1/chat/completions"
    r = httpx.post(chat, json={"model": "tiny", "messages": [{"role": "user"}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages.0.content", r.text
    assert err["message"] == "messages.0.content: a user message needs content"
    assert not backend.placed
    r = httpx.post(chat, json={"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": []}, {"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text


def test_an_objects_own_fields_are_not_read_as_union_members():
    errors = [{"loc": ("body", "response_format", "type"), "msg": "Field required", "type": "missing"},
              {"loc": ("body", "response_format", "json_schema"), "msg": "Field required", "type": "missing"}]
    err = _validation_error(errors)
    assert err.param == "response_format.type"
    assert str(err).startswith("response_format.type: Field required (and 1 more problem)")


def test_benchmark_client_fields_are_accepted(serve_fake):
    """What guidellm / aiperf / inference-perf send: ignore_eos, min_tokens and OpenAI's no-op fields."""
    url, _, _ = serve_fake(backend=FakeBackend(eos_at=3))
    base = {"model": "tiny", "prompt": "x", "max_tokens": 6, "seed": 1}
    r = httpx.post(url + "/v1/completions", json=base)
    assert r.json()["usage"]["completion_tokens"] == 3  # <eos> ends it
    r = httpx.post(url + "/v1/completions", json={**base, "ignore_eos": True, "min_tokens": 2, "store": False,
                                                  "metadata": {"run": "1"}, "parallel_tool_calls": False,
                                                  "top_k": -1, "skip_special_tokens": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6 and r.json()["choices"][0]["finish_reason"] == "length"
    card = httpx.get(url + "/v1/models/tiny")
    assert card.status_code == 200 and card.json()["id"] == "tiny"
    assert httpx.get(url + "/v1/models/other").status_code == 404


class _HeldCodec(ByteCodec):
    """Encoding a prompt over ``big`` characters blocks until ``release`` is set (a huge prompt's
    seconds of tokenizing, held for as long as the test needs)."""

    max_token_chars = None  # no cheap length bound: the prompt must reach the tokenizer

    def __init__(self, big: int):
        self.big, self.entered, self.release = big, threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        if len(text) > self.big:
            self.entered.set()
            self.release.wait(timeout=60)
        return super().encode(text)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_huge_prompt_is_tokenized_off_the_event_loop(serve_fake, endpoint):
    """While a 6 MB prompt is being tokenized, /health and a small streaming request are answered:
    both finish before its tokenizing does."""
    codec = _HeldCodec(big=1_000_000)
    url, _, _ = serve_fake(FakeBackend(max_context=256), codec=codec)
    huge = "x" * 6_000_000
    path, body = (("/v1/completions", {"model": "tiny", "prompt": huge}) if endpoint == "completions" else
                  ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": huge}]}))
    answers: list[httpx.Response] = []
    big = threading.Thread(target=lambda: answers.append(httpx.post(url + path, json=body, timeout=90)))
    big.start()
    try:
        assert codec.entered.wait(timeout=30), "the huge prompt never reached the tokenizer"
        health = httpx.get(url + "/health", timeout=20)
        small = {"model": "tiny", "prompt": "hi", "max_tokens": 5, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=small, timeout=20) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert not codec.release.is_set()  # the huge prompt is still being tokenized
    finally:
        codec.release.set()
        big.join(60)
    assert health.status_code == 200
    assert events[-1] == "[DONE]" and len(events) == 5 + 2  # five tokens, the finish chunk, [DONE]
    assert answers and answers[0].status_code == 400 and "maximum context length" in answers[0].text


def test_dead_replica_is_never_chosen_and_health_says_so(serve_fake):
    from hetserve.policies.placement import make_placement

    url, backend, _ = serve_fake(placement=make_placement("rr"))
    backend.dead.add("r1")
    for _ in range(4):
        assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}
                          ).status_code == 200
    assert set(backend.placed) == {"r0"}
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert {r["id"]: r["alive"] for r in health.json()["replicas"]} == {"r0": True, "r1": False}
    metrics = httpx.get(url + "/metrics").text
    assert 'hetserve_replica_up{replica="r1",role="colocated"} 0.0' in metrics
    assert 'hetserve_replica_up{replica="r0",role="colocated"} 1.0' in metrics
    backend.dead.add("r0")
    assert httpx.get(url + "/health").status_code == 503


def _stream(url: str, max_tokens: int, out: list) -> None:
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "x", "max_tokens": max_tokens, "stream": True}) as r:
        out.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))


def test_drain_finishes_short_requests_and_ends_long_ones_with_an_error_event(serve_fake, wait_until):
    url, _, coord = serve_fake(backend=FakeBackend(token_delay_s=0.05, max_context=1024))
    # the coordinator's clock (the drain's deadline) moves only when the test moves it: the short
    # request finishes inside the drain however slowly the machine runs it
    now = [100.0]
    coord.clock = lambda: now[0]
    short, long = [], []
    threads = [threading.Thread(target=_stream, args=(url, n, out)) for n, out in ((5, short), (1000, long))]
    for t in threads:
        t.start()
    assert wait_until(lambda: coord.in_flight == 2)
    drained = {}
    drain = threading.Thread(target=lambda: drained.update(cut=asyncio.run(coord.drain(1.0))))
    drain.start()
    assert wait_until(lambda: coord.draining)
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "shutting_down"
    assert httpx.get(url + "/health").json()["status"] == "draining"
    threads[0].join(30)
    assert wait_until(lambda: coord.in_flight == 1) and drain.is_alive()  # the long one (50 s) waits out the drain
    now[0] += 1.5  # past the drain's timeout
    drain.join(30)
    threads[1].join(30)
    assert drained["cut"] == 1
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]" and "drain timeout" in json.loads(long[-2])["error"]["message"]


class _RecordingReplanner:
    def __init__(self):
        self.calls = []

    def replan(self, cluster=None, lost=None, returned=None):
        from hetserve.errors import PlanError

        self.calls.append((cluster, lost, returned))
        if returned == ["nope:0"]:
            raise PlanError("re-plan: devices ['nope:0'] are not in cluster 'c'")
        return {"kept": ["c0"], "retired": [], "added": ["c1"], "plan_s": 0.1, "start_s": 1.0, "total_s": 1.2}


def test_admin_replan_forwards_its_fields_and_refuses_bad_ones(serve_fake):
    from hetserve.serve.keys import APIAuth, KeySet

    url, _, coord = serve_fake(auth=APIAuth(admin_keys=KeySet(["admin-secret"])))
    admin = {"Authorization": "Bearer admin-secret"}  # /admin/* is off without an admin key
    r = httpx.post(url + "/admin/replan", json={}, headers=admin)
    assert r.status_code == 400 and "cannot re-plan" in r.json()["error"]["message"]  # no replanner (Ray)
    coord.replanner = _RecordingReplanner()
    r = httpx.post(url + "/admin/replan", json={"returned": ["m0:0"], "cluster": "c.yaml"}, headers=admin)
    assert r.status_code == 200 and r.json()["added"] == ["c1"]
    assert coord.replanner.calls == [("c.yaml", None, ["m0:0"])]
    for body, param in [({"lost": "m0:0"}, "lost"), ({"cluster": 3}, "cluster"), ({"devices": []}, "devices")]:
        r = httpx.post(url + "/admin/replan", json=body, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(url + "/admin/replan", json={"returned": ["nope:0"]}, headers=admin)
    assert r.status_code == 400 and "nope:0" in r.json()["error"]["message"]
    r = httpx.post(url + "/admin/replan", json={"lost": ["m0:1", "m0:0", "m0:1"]}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lost" and "m0:1 more than once" in r.text
    coord.draining = True  # a re-plan while the server shuts down would start workers only to stop them
    r = httpx.post(url + "/admin/replan", json={}, headers=admin)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    assert len(coord.replanner.calls) == 2  # the malformed bodies never reached the planner


def test_an_idle_keep_alive_connection_outlives_the_clients_pools(serve_fake):
    """httpx (openai's client) re-uses an idle connection for up to 5 s: the server must still hold
    it then. At uvicorn's default keep-alive (5 s) it had closed it, and a request sent on it just
    then failed (`predict/run`, 2026-11-27). Here: one connection, idle 5.5 s, asked again on it."""
    import http.client
    import time
    from urllib.parse import urlsplit

    url, _, _ = serve_fake()
    conn = http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port, timeout=5)
    try:
        for round_ in range(2):
            if round_:
                time.sleep(5.5)
            conn.request("GET", "/health")  # on the same socket: http.client opens one only when it has none
            resp = conn.getresponse()  # a closed connection: RemoteDisconnected
            assert resp.status == 200, (round_, resp.status)
            resp.read()
    finally:
        conn.close()
