"""The OpenAI-compatible front against an in-process fake engine: wire format, errors, streaming,
concurrency and disconnects. No worker processes, no torch."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from hetserve.policies.request_checks import RequestRefused, check_request
from hetserve.serve.fake import FakeBackend


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)


def test_openai_client_streams_a_completion_with_usage(serve_fake):
    url, backend, _ = serve_fake()
    chunks = list(client(url).completions.create(model="tiny", prompt="hello", max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}, seed=0))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "abcde"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 5, 10)


def test_openai_client_streams_a_chat_completion(serve_fake):
    url, _, _ = serve_fake()
    stream = client(url).chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=4, stream=True, seed=3, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "defg"
    prompt = "system: be brief\nuser: hi\nassistant:"
    assert chunks[-1].usage.prompt_tokens == len(prompt.encode())
    assert chunks[-1].usage.completion_tokens == 4


def test_a_chat_stream_names_the_role_once_as_openai_does(serve_fake):
    """The first delta carries the role; later ones only their content (no "role": null), the last an
    empty delta beside its finish reason."""
    url, _, _ = serve_fake()
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all("role" not in d for d in deltas[1:]) and all(set(d) <= {"content"} for d in deltas[1:]), deltas


def test_non_streaming_completion_and_chat_usage(serve_fake):
    url, _, _ = serve_fake(backend=FakeBackend(eos_at=3))
    c = client(url)
    r = c.completions.create(model="tiny", prompt="héllo", max_tokens=10, seed=1)
    assert r.choices[0].text == "bc" and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len("héllo".encode()) and r.usage.completion_tokens == 3  # <eos> counts
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], seed=0)
    assert chat.choices[0].message.content == "ab" and chat.choices[0].finish_reason == "stop"
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 3


def test_stop_string_cuts_text_and_frees_the_request(serve_fake):
    url, backend, _ = serve_fake()
    r = client(url).completions.create(model="tiny", prompt="p", max_tokens=20, seed=0, stop=["de"])
    assert r.choices[0].text == "abc" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 5
    assert len(backend.aborted) == 1 and not backend.running
    chunks = list(client(url).completions.create(model="tiny", prompt="p", max_tokens=20, seed=0,
                                                 stop=["xyz", "ef"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "abcd"


def test_token_id_prompts_are_accepted(serve_fake):
    url, _, _ = serve_fake()
    r = client(url).completions.create(model="tiny", prompt=[104, 105], max_tokens=2, seed=0)
    assert r.usage.prompt_tokens == 2 and r.choices[0].text == "ab"


def _assert_openai_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b"", None),
    (json.dumps({"model": "tiny"}).encode(), "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "temperature": 3}).encode(), "temperature"),
    (json.dumps({"model": "tiny", "prompt": "x", "n": 65}).encode(), "n"),
    (json.dumps({"model": "tiny", "prompt": "x", "bogus": 1}).encode(), "bogus"),
    (json.dumps({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}).encode(), "stop"),
])
def test_malformed_bodies_get_400_in_openai_shape(serve_fake, body, param):
    url, backend, _ = serve_fake()
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    _assert_openai_error(r, 400, param=param)
    assert not backend.placed  # nothing reached the engine


def test_malformed_chat_body(serve_fake):
    url, _, _ = serve_fake()
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
    _assert_openai_error(r, 400, param="messages")
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "robot", "content": "x"}]})
    _assert_openai_error(r, 400)


def test_unknown_model_is_404_and_openai_client_raises(serve_fake):
    url, _, _ = serve_fake()
    r = httpx.post(url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    _assert_openai_error(r, 404, param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        client(url).chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_max_tokens_beyond_context_is_400(serve_fake):
    url, backend, _ = serve_fake()  # max_context 256
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 252})
    err = _assert_openai_error(r, 400, param="max_tokens", code="context_length_exceeded")
    assert "256" in err["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 300, "max_tokens": 1})
    _assert_openai_error(r, 400, param="prompt", code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError):
        client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=1000)
    assert not backend.placed
    # exactly at the limit is fine
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 251})
    assert r.status_code == 200


def test_request_bigger_than_every_kv_pool_is_400(serve_fake):
    url, _, _ = serve_fake(backend=FakeBackend(kv_capacity=50))
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 100})
    _assert_openai_error(r, 400, code="context_length_exceeded")


@pytest.mark.parametrize("max_tokens, status", [(43, 200), (44, 400)])
def test_kv_refusals_follow_the_engines_rule_in_whole_blocks(serve_fake, max_tokens, status):
    # "hello" is 5 tokens; 5 + 43 = 48 tokens are three 16-token blocks (48 <= 50), 5 + 44 need a fourth (64)
    url, _, _ = serve_fake(backend=FakeBackend(kv_capacity=50))
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": max_tokens})
    assert r.status_code == status, r.text
    try:  # the engine's and the simulator's rule says the same
        check_request(5, max_tokens, 256, [("colocated", 50)], 16)
        refused = False
    except RequestRefused:
        refused = True
    assert refused == (status == 400)


def test_unknown_route_and_method_use_the_same_error_shape(serve_fake):
    url, _, _ = serve_fake()
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_engine_failure_is_500_or_an_error_event(serve_fake):
    class Broken(FakeBackend):
        async def generate(self, request_id, prompt_token_ids, params, replica=None):
            yield ord("a")
            raise RuntimeError("worker 3 died")

    url, _, _ = serve_fake(backend=Broken())
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "worker 3 died" in r.json()["error"]["message"]
    with httpx.stream("POST", url + "/v1/completions",
                      json={"model": "tiny", "prompt": "x", "max_tokens": 5, "stream": True}) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"


def test_models_health_and_metrics(serve_fake):
    url, backend, _ = serve_fake()
    backend.refused["handshake"] = 3
    backend.channels["p0.0"] = {"channel_transfers": 7, "resent": 1}
    models = client(url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(url + "/health").json()["status"] == "ok"
    client(url).completions.create(model="tiny", prompt="abc", max_tokens=3)
    text = httpx.get(url + "/metrics").text
    for series in ("hetserve_time_to_first_token_seconds_count 1.0",
                   "hetserve_time_per_output_token_seconds_count 1.0",
                   'hetserve_requests_total{endpoint="completions",outcome="length"} 1.0',
                   'hetserve_replica_kv_usage_ratio{replica="r0",role="colocated"}',
                   'hetserve_replica_preemptions_total{replica="r0",role="colocated"} 0.0',
                   'hetserve_replica_queued_requests{replica="r1",role="colocated"}',
                   'hetserve_link_bytes_total{dst="m0:1",kind="decode",src="m0:0"} 1024.0',
                   'hetserve_link_queueing_seconds_total{dst="m0:1",kind="prefill",src="m0:0"}',
                   'hetserve_refused_connections_total{reason="handshake"} 3.0',
                   'hetserve_refused_connections_total{reason="malformed"} 0.0',
                   'hetserve_device_channel_total{count="channel_transfers",worker="p0.0"} 7.0',
                   'hetserve_device_channel_total{count="resent",worker="p0.0"} 1.0'):
        assert series in text, series


def test_placement_policy_spreads_requests(serve_fake):
    from hetserve.policies.placement import make_placement

    url, backend, _ = serve_fake(placement=make_placement("rr"))
    c = client(url)
    for _ in range(4):
        c.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert backend.placed == ["r0", "r1", "r0", "r1"]


def test_fifty_concurrent_streaming_clients_all_complete(serve_fake):
    from hetserve.policies.placement import make_placement

    url, backend, coord = serve_fake(backend=FakeBackend(slots=8), placement=make_placement("jsq"))

    async def one(ac: openai.AsyncOpenAI, i: int):
        stream = await ac.completions.create(model="tiny", prompt=f"p{i}", max_tokens=8, stream=True, seed=i,
                                             stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return i, text, usage

    async def main():
        ac = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60,
                                http_client=openai.DefaultAsyncHttpxClient(
                                    limits=httpx.Limits(max_connections=64)))
        try:
            return await asyncio.gather(*(one(ac, i) for i in range(50)))
        finally:
            await ac.close()

    results = asyncio.run(main())
    assert len(results) == 50
    for i, text, usage in results:
        assert text == "".join(chr(ord("a") + (i + k) % 26) for k in range(8))
        assert usage.completion_tokens == 8
    assert len(backend.finished) == 50 and coord.in_flight == 0
    assert set(backend.placed) == {"r0", "r1"}


def test_client_disconnect_mid_stream_frees_its_slot(serve_fake, wait_until):
    backend = FakeBackend(replicas=1, slots=1, token_delay_s=0.01)
    url, _, coord = serve_fake(backend=backend)
    with httpx.Client(timeout=30) as hc:
        with hc.stream("POST", url + "/v1/completions",
                       json={"model": "tiny", "prompt": "x", "max_tokens": 200, "stream": True}) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert backend.running  # it holds the only slot
        # leaving the block closed the connection mid-stream
    assert wait_until(lambda: not backend.running and coord.in_flight == 0)
    assert len(backend.aborted) == 1
    # the slot is free again: the next request gets it and completes
    r = client(url).completions.create(model="tiny", prompt="x", max_tokens=3)
    assert r.usage.completion_tokens == 3
    assert 'outcome="aborted"' in httpx.get(url + "/metrics").text


def test_client_disconnect_while_waiting_non_streaming_frees_the_request(serve_fake, wait_until):
    backend = FakeBackend(replicas=1, slots=1, token_delay_s=0.01)
    url, _, coord = serve_fake(backend=backend)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 250}, timeout=0.3)
    assert wait_until(lambda: not backend.running and coord.in_flight == 0)
    assert len(backend.aborted) == 1


def test_one_stream_chunk_per_token_even_while_a_partial_character_is_held_back(serve_fake):
    """A token whose text is not complete yet (the first byte of "é") still streams a chunk, with
    empty text, so a client times the first token, not the first printable character."""

    class Utf8Backend(FakeBackend):
        async def generate(self, request_id, prompt_token_ids, params, replica=None):
            for t in (0xC3, 0xA9, ord("a")):
                await asyncio.sleep(0.002)
                yield t

    url, _, _ = serve_fake(Utf8Backend())
    chunks = list(client(url).completions.create(model="tiny", prompt="x", max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}))
    per_token = [c.choices[0].text for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert per_token == ["", "é", "a"]
    assert chunks[-1].usage.completion_tokens == 3


def test_replica_series_carry_each_replicas_figures():
    """/metrics' replica series are the backend's snapshot, figure for figure (pre-emptions included)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from hetserve.policies.base import ReplicaState
    from hetserve.serve.metrics import _ScrapeCollector, _backend_families

    states = [ReplicaState("d0", "decode", 2, 5, 0, 0.0, 300, 400, 1000, preemptions=3),
              ReplicaState("p0", "prefill", 1, 0, 40, 40.0, 0, 64, 1000, alive=False)]
    registry = CollectorRegistry()
    registry.register(_ScrapeCollector(lambda: (states, []), _backend_families))
    text = generate_latest(registry).decode()
    for series in ('hetserve_replica_preemptions_total{replica="d0",role="decode"} 3.0',
                   'hetserve_replica_preemptions_total{replica="p0",role="prefill"} 0.0',
                   'hetserve_replica_up{replica="p0",role="prefill"} 0.0',
                   'hetserve_replica_running_requests{replica="d0",role="decode"} 5.0',
                   'hetserve_replica_kv_usage_ratio{replica="d0",role="decode"} 0.4'):
        assert series in text, series
