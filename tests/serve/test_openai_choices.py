"""Logprobs, echo / prompt scoring, n choices, lists of prompts and penalties over HTTP, in OpenAI's
shapes (fake engine, one server for the module; the numbers themselves are checked against
transformers in tests/runtime/test_sampler_logprobs.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from hetserve.serve.fake import FakeBackend, fake_logprob


@pytest.fixture(scope="module")
def server():
    from hetserve.serve.app import create_app
    from hetserve.serve.coordinator import Coordinator
    from hetserve.serve.fake import ByteCodec
    from hetserve.serve.server import ServerThread

    backend = FakeBackend(token_delay_s=0.001)
    srv = ServerThread(create_app(Coordinator(backend, ByteCodec(), "tiny")))
    try:
        yield srv.url, backend
    finally:
        srv.stop()


def _post(url, path, **body):
    r = httpx.post(url + path, json={"model": "tiny", **body}, timeout=20)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url, path, **body) -> list[dict]:
    with httpx.stream("POST", url + path, json={"model": "tiny", "stream": True, **body}, timeout=20) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _join(parts: list[dict]) -> dict:
    return {key: sum((p[key] for p in parts), []) for key in ("tokens", "token_logprobs", "top_logprobs",
                                                               "text_offset")}


def test_completion_logprobs_in_openais_shape_streamed_and_not(server):
    url, _ = server
    body = dict(prompt="hey", max_tokens=5, logprobs=2, seed=4)
    out = _post(url, "/v1/completions", **body)["choices"][0]
    lp = out["logprobs"]
    assert "".join(lp["tokens"]) == out["text"] and len(lp["tokens"]) == 5
    assert lp["token_logprobs"] == [fake_logprob(3 + i) for i in range(5)]
    assert lp["text_offset"] == list(range(5))
    for tok, top, chosen in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"]):
        assert len(top) == 2 and top[tok] == chosen
    chunks = [c["choices"][0] for c in _stream(url, "/v1/completions", **body) if c["choices"]]
    assert _join([c["logprobs"] for c in chunks if c["logprobs"]]) == lp


def test_echo_with_max_tokens_zero_scores_each_prompt_of_a_list(server):
    url, _ = server
    prompts = ["the cat", "hi"]
    out = _post(url, "/v1/completions", prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"] == {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}
    for choice, text in zip(out["choices"], ["the cat", "hi"]):
        lp = choice["logprobs"]
        assert choice["text"] == text and "".join(lp["tokens"]) == text
        assert lp["token_logprobs"] == [None] + [fake_logprob(i) for i in range(1, len(text))]
        assert lp["top_logprobs"][0] is None and all(len(t) == 1 for t in lp["top_logprobs"][1:])
    streamed = [c["choices"][0] for c in _stream(url, "/v1/completions", prompt=prompts, max_tokens=0, echo=True,
                                                 logprobs=1) if c["choices"]]
    by_index = {c["index"]: c for c in streamed}
    assert {i: c["text"] for i, c in by_index.items()} == {0: "the cat", 1: "hi"}
    assert by_index[0]["logprobs"] == out["choices"][0]["logprobs"]
    # echo while generating: the prompt, then the completion, logprobs for both
    gen = _post(url, "/v1/completions", prompt="ab", max_tokens=3, echo=True, logprobs=0)["choices"][0]
    assert gen["text"].startswith("ab") and len(gen["text"]) == 5
    assert gen["logprobs"]["token_logprobs"] == [None] + [fake_logprob(i) for i in range(1, 5)]


def test_chat_logprobs_streamed_and_not(server):
    url, _ = server
    body = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=3, seed=1)
    out = _post(url, "/v1/chat/completions", **body)["choices"][0]
    content = out["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == out["message"]["content"]
    for e in content:
        assert e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["token"] == e["token"] and e["top_logprobs"][0]["logprob"] == e["logprob"]
    chunks = [c["choices"][0] for c in _stream(url, "/v1/chat/completions", **body) if c["choices"]]
    assert sum((c["logprobs"]["content"] for c in chunks if c["logprobs"]), []) == content
    plain = _post(url, "/v1/chat/completions", **{**body, "logprobs": False, "top_logprobs": None})
    assert plain["choices"][0]["logprobs"] is None


def test_n_choices_each_equal_a_single_request_with_its_seed(server):
    url, backend = server
    out = _post(url, "/v1/completions", prompt="x", max_tokens=6, n=3, seed=10, temperature=0.8)
    texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) == 3 and out["usage"]["completion_tokens"] == 18 and out["usage"]["prompt_tokens"] == 1
    for i, text in enumerate(texts):
        assert _post(url, "/v1/completions", prompt="x", max_tokens=6, seed=10 + i,
                     temperature=0.8)["choices"][0]["text"] == text
    chunks = _stream(url, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}], max_tokens=3, n=2,
                     seed=5, stream_options={"include_usage": True})
    finished = {c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finished == {0, 1} and chunks[-1]["usage"]["completion_tokens"] == 6


def test_penalties_reach_the_engine(server):
    url, backend = server
    _post(url, "/v1/completions", prompt="pen", max_tokens=2, presence_penalty=0.5, frequency_penalty=-0.25,
          repetition_penalty=1.3)
    p = [p for p in backend.params.values() if p.repetition_penalty != 1.0][-1]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.3)
