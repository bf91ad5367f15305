"""The HTTP front over the real engine: worker processes running a tiny random-weight Llama (GQA)
on a disaggregated plan (prefill TP 2 -> decode with two pipeline stages), through the official
``openai`` client."""

from __future__ import annotations

import asyncio
import os

import httpx
import openai
import pytest


PLAN = {"model": "tiny", "cluster": "demo-cpu", "algorithm": "manual", "replicas": [
    {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0", "m0:1"], "layers": [0, 4]}]},
    {"id": "d0", "role": "decode", "stages": [{"devices": ["m1:0"], "layers": [0, 2]},
                                              {"devices": ["m1:1"], "layers": [2, 4]}]}],
    "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}
CONTEXT = 256
PROMPTS = ["hello", "the quick brown fox", "x" * 40]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from hetserve.runtime.model.make import make_model

    return make_model(tmp_path_factory.mktemp("model") / "tiny", "llama", layers=4, hidden=64, heads=4, kv_heads=2,
                      max_positions=CONTEXT)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    from hetserve.planner.plan import Plan

    path = tmp_path_factory.mktemp("plan") / "plan.json"
    Plan.from_dict(PLAN).save(path)
    return path


@pytest.fixture(scope="module")
def server(tiny_model, plan_file):
    from hetserve.serve.launch import ServeOptions, start_server

    opts = ServeOptions(plan=str(plan_file), cluster="demo-cpu", model_dir=str(tiny_model), model_name="tiny",
                        kv_capacity_tokens=CONTEXT, placement="jsq")
    with start_server(opts) as srv:
        yield srv


def greedy_tokens(deployment, prompts=PROMPTS, max_tokens=12):
    from hetserve.runtime.params import SamplingParams

    codec = deployment.coordinator.codec
    return deployment.engine.generate([codec.encode(p) for p in prompts],
                                      SamplingParams(max_tokens=max_tokens, temperature=0.0), timeout=60)


@pytest.fixture(scope="module")
def local_greedy(server):
    return greedy_tokens(server.deployment)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_openai_client_streams_completion_and_chat_from_the_engine(server, local_greedy):
    c = client(server.url)
    codec = server.deployment.coordinator.codec
    stream = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(codec.encode(PROMPTS[1]))
    assert usage.completion_tokens == len(local_greedy[1])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert text == codec.decode(local_greedy[1])  # the same tokens as the engine's own greedy run
    full = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0)
    assert full.choices[0].text == text  # greedy: streaming and not give the same completion
    assert full.choices[0].finish_reason in ("length", "stop")

    chat = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    prompt = codec.render_chat([("user", "hi")])
    assert chat[-1].usage.prompt_tokens == len(codec.encode(prompt))
    assert 1 <= chat[-1].usage.completion_tokens <= 6


def test_seeded_sampling_is_reproducible(server):
    c = client(server.url)
    a = c.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    b = c.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    assert a.choices[0].text == b.choices[0].text


def test_bad_requests_get_openai_errors(server):
    url = server.url
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": CONTEXT})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "hello"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(url + "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 100000], "max_tokens": 2})
    assert r.status_code == 400 and "[0," in r.json()["error"]["message"]


def test_fifty_concurrent_streaming_clients_complete(server):
    codec = server.deployment.coordinator.codec

    async def one(ac, i):
        prompt = f"request {i}"
        stream = await ac.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                             stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return prompt, usage

    async def main():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120,
                                http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=64)))
        try:
            return await asyncio.gather(*(one(ac, i) for i in range(50)))
        finally:
            await ac.close()

    results = asyncio.run(main())
    assert len(results) == 50
    for prompt, usage in results:
        assert usage is not None and usage.prompt_tokens == len(codec.encode(prompt))
        assert 1 <= usage.completion_tokens <= 8
    stats = server.deployment.engine.stats()
    assert stats["failed"] == 0


def test_disconnect_mid_stream_aborts_and_frees_kv(server, wait_until):
    engine = server.deployment.engine

    def idle():
        s = engine.stats()
        return s.get("running", 1) == 0 and s.get("waiting", 1) == 0 and \
            all(r["kv_used_blocks"] == 0 for r in s["replicas"].values())

    assert wait_until(idle, timeout_s=20.0, poll_s=0.05)
    with httpx.Client(timeout=60) as hc:
        with hc.stream("POST", server.url + "/v1/completions",
                       json={"model": "tiny", "prompt": "go", "max_tokens": 240, "temperature": 0.8,
                             "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break  # the first token is out: the request holds KV on a replica
    assert wait_until(idle, timeout_s=20.0, poll_s=0.05)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'hetserve_requests_total{endpoint="completions",outcome="aborted"} 1.0' in metrics
    # the room is free again: a request needing the whole pool runs
    r = client(server.url).completions.create(model="tiny", prompt="go", max_tokens=240, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_metrics_report_latency_queues_and_kv(server):
    client(server.url).completions.create(model="tiny", prompt="metrics", max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    assert "hetserve_time_to_first_token_seconds_bucket" in text
    assert "hetserve_time_per_output_token_seconds_sum" in text
    for rid, role in (("p0", "prefill"), ("d0", "decode")):
        assert f'hetserve_replica_kv_capacity_tokens{{replica="{rid}",role="{role}"}} {float(CONTEXT)}' in text
        assert f'hetserve_replica_queued_requests{{replica="{rid}",role="{role}"}}' in text
    # each worker's start-up, as it measured it
    loads = {w: load["seconds"] for w, load in server.deployment.engine.worker_loads().items()}
    assert loads and all(f'hetserve_worker_load_seconds{{worker="{w}"}} {s!r}' in text for w, s in loads.items())


def _scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metric_values_match_what_was_served(server):
    """Counter and histogram *values* after three requests of exactly 5 tokens each (ignore_eos)."""
    codec = server.deployment.coordinator.codec
    before = _scrape(server.url)
    prompts = ["one", "two two", "three three three"]
    for p in prompts:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": p, "max_tokens": 5, "ignore_eos": True, "temperature": 0})
        assert r.json()["usage"]["completion_tokens"] == 5
    after = _scrape(server.url)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('hetserve_requests_total{endpoint="completions",outcome="length"}') == 3
    assert delta("hetserve_generation_tokens_total") == 15
    assert delta("hetserve_prompt_tokens_total") == sum(len(codec.encode(p)) for p in prompts)
    assert delta("hetserve_time_to_first_token_seconds_count") == 3
    assert delta("hetserve_time_per_output_token_seconds_count") == 3
    assert delta("hetserve_e2e_request_latency_seconds_count") == 3
    ttft, e2e = delta("hetserve_time_to_first_token_seconds_sum"), delta("hetserve_e2e_request_latency_seconds_sum")
    assert 0 < ttft < e2e
    assert after["hetserve_requests_in_flight"] == 0


def test_stop_string_ends_the_text_and_the_engine_request(server, local_greedy, wait_until):
    codec = server.deployment.coordinator.codec
    text = codec.decode(local_greedy[1])
    # the first character that has not appeared before it (random weights: skip undecodable bytes)
    k = next(i for i in range(1, len(text)) if text[i] not in text[:i] and text[i] != "\ufffd")
    r = client(server.url).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                              stop=[text[k]])
    assert r.choices[0].text == text[:k] and r.choices[0].finish_reason == "stop"
    engine = server.deployment.engine
    assert wait_until(lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0, timeout_s=20)


TWO = {"model": "tiny", "cluster": "demo-cpu", "algorithm": "manual", "replicas": [
    {"id": f"c{i}", "role": "colocated", "stages": [{"devices": [f"m0:{i}"], "layers": [0, 4]}]} for i in range(2)]}


def test_two_replicas_spread_reject_what_no_pool_holds_and_fail_cleanly(tiny_model, tmp_path):
    """rr placement uses both replicas; a request bigger than every KV pool (64) but inside the context
    (256) is a 400; when every replica is dead a stream ends with one error event and [DONE], /health 503."""
    import json
    import os
    import signal

    from hetserve.planner.plan import Plan
    from hetserve.serve.launch import ServeOptions, start_server

    Plan.from_dict(TWO).save(tmp_path / "two.json")
    opts = ServeOptions(plan=str(tmp_path / "two.json"), cluster="demo-cpu", model_dir=str(tiny_model),
                        model_name="tiny", kv_capacity_tokens=64, placement="rr")
    with start_server(opts) as srv:
        for i in range(4):
            httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": f"p{i}", "max_tokens": 3},
                       timeout=60).raise_for_status()
        steps = {rid: s["steps"] for rid, s in srv.deployment.engine.stats()["replicas"].items()}
        assert all(n > 0 for n in steps.values()), steps
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 100})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "KV" in r.json()["error"]["message"]

        events = []
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "x", "max_tokens": 60, "ignore_eos": True,
                                "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    if not events:
                        for pid in srv.deployment.engine.worker_pids().values():
                            os.kill(pid, signal.SIGKILL)
                    events.append(line[6:])
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
        assert httpx.get(srv.url + "/health").status_code == 503


def test_a_tokenizer_that_fails_to_load_stops_the_workers_started_meanwhile(tiny_model, plan_file, tmp_path,
                                                                             monkeypatch):
    """The tokenizer loads while the workers start; when it fails, the error names the folder and the
    workers started meanwhile are stopped, not left running."""
    import shutil

    from hetserve.errors import SpecError
    from hetserve.runtime.engine import Engine
    from hetserve.serve.launch import ServeOptions, build

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "tokenizer.json").write_text("{not json")
    started = []
    real = Engine.from_plan
    monkeypatch.setattr(Engine, "from_plan", lambda *a, **k: started.append(real(*a, **k)) or started[-1])
    with pytest.raises(SpecError, match="tokenizer") as err:
        build(ServeOptions(plan=str(plan_file), cluster="demo-cpu", model_dir=str(broken), model_name="tiny"))
    assert str(broken) in str(err.value)
    (engine,) = started
    assert engine._closed and all(not os.path.exists(f"/proc/{pid}") for pid in engine.worker_pids().values())


def test_an_interrupted_start_does_not_wait_for_the_tokenizer(plan_file, tiny_model, monkeypatch):
    """Ctrl-C (or SIGTERM) while the workers start ends ``build`` at once, with the tokenizer still
    loading, and nothing left holds the process's exit: its loader is a daemon thread (an
    executor's thread is joined at exit, which kept an interrupted ``serve`` alive for seconds)."""
    import threading

    from hetserve.runtime.engine import Engine
    from hetserve.serve.launch import ServeOptions, build
    from hetserve.serve.text import HFCodec

    release, loading = threading.Event(), threading.Event()

    def slow_tokenizer(path):
        loading.set()
        release.wait(30)
        raise RuntimeError("released")

    def interrupted(*args, **kwargs):
        assert loading.wait(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(HFCodec, "from_dir", staticmethod(slow_tokenizer))
    monkeypatch.setattr(Engine, "from_plan", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            build(ServeOptions(plan=str(plan_file), cluster="demo-cpu", model_dir=str(tiny_model), model_name="tiny"))
        loaders = [t for t in threading.enumerate() if t.name.startswith("hetserve-tokenizer")]
        assert loaders and all(t.daemon for t in loaders)  # still loading, and not joined at exit
    finally:
        release.set()
