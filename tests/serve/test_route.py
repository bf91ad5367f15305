"""hetserve route in front of stand-in OpenAI backends (processes on 127.0.0.1, tests/export/route_standin.py):
the plan's weights are followed, a killed backend loses no request that had not streamed yet, the
vLLM disaggregated-proxy fields reach prefill and decode, bad input is refused as `hetserve serve`
refuses it."""

import argparse
import asyncio
import importlib.util
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

STANDIN = Path(__file__).resolve().parent.parent / "export" / "route_standin.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Exited(RuntimeError):
    """A server stopped before it answered: its port was taken between ``free_port`` and its bind."""


def wait_up(url: str, deadline_s: float = 30.0, alive=None) -> None:
    """Until ``url`` answers its health probe; ``Exited`` as soon as ``alive()`` says the server is gone."""
    t = time.monotonic() + deadline_s
    while time.monotonic() < t:
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code in (200, 401):  # 401: up, probes keyed
                return
        except httpx.HTTPError:
            pass
        if alive is not None and not alive():
            raise Exited(url)
        time.sleep(0.05)
    raise TimeoutError(url)


def load_standin():
    spec = importlib.util.spec_from_file_location("route_standin", STANDIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Backends:
    """Stand-in backends: uvicorn servers in threads of this process, and (``process=True``) processes
    started by this test, which it can kill (by pid)."""

    def __init__(self):
        self.procs: dict[str, subprocess.Popen] = {}
        self.servers: list = []
        self.urls: dict[str, str] = {}
        self.standin = load_standin()

    def start(self, specs, process=False, tries=3):
        """Each stand-in on a free port; one whose port another process took before it bound is
        started again on another (up to ``tries`` times)."""
        for bid, role, *delays in specs:
            for attempt in range(tries):
                port = free_port()
                alive = self._launch(bid, role, port, *(delays or (0.0, 0.0)), process=process)
                self.urls[bid] = f"http://127.0.0.1:{port}"
                try:
                    wait_up(self.urls[bid], alive=alive)
                    break
                except Exited:
                    if attempt == tries - 1:
                        raise

    def _launch(self, bid, role, port, first, chunk, process):
        """Start one stand-in; returns a callable that says whether it still runs."""
        import uvicorn

        if process:
            args = [sys.executable, str(STANDIN), "--port", str(port), "--id", bid, "--role", role,
                    "--first-byte-delay", str(first), "--chunk-delay", str(chunk)]
            proc = self.procs[bid] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return lambda: proc.poll() is None
        ns = argparse.Namespace(port=port, id=bid, role=role, first_byte_delay=first, chunk_delay=chunk)
        server = uvicorn.Server(uvicorn.Config(self.standin.build(ns), host="127.0.0.1", port=port, log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        self.servers.append(server)
        return thread.is_alive

    def stats(self, bid):
        return httpx.get(f"{self.urls[bid]}/stats", timeout=5).json()

    def kill(self, bid):
        self.procs[bid].send_signal(signal.SIGKILL)
        self.procs[bid].wait()

    def stop(self):
        for server in self.servers:
            server.should_exit = True
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def backends():
    b = Backends()
    b.start([("b0", "colocated"), ("b1", "colocated"), ("b2", "colocated"),
             ("p0", "prefill"), ("d0", "decode"), ("d1", "decode"), ("s0", "colocated", 0.3, 0.01)])
    # the one a test kills: its first byte takes 3 s, so none of its requests can have streamed when
    # the kill comes (0.15 s in, later on a loaded machine), however late
    b.start([("s1", "colocated", 3.0, 0.01)], process=True)
    yield b
    b.stop()


class RouteServer:
    """hetserve route's app under uvicorn in a thread of this process."""

    def __init__(self, deploy: dict, tmp_path, policy="weights", health_interval_s=0.2, auth=None):
        import uvicorn

        from hetserve.serve.route.app import Router
        from hetserve.serve.route.backends import BackendPool, config_from_deploy
        from hetserve.serve.route.server import create_app

        path = tmp_path / f"deploy-{id(self)}.json"
        path.write_text(json.dumps(deploy))
        self.router = Router(BackendPool(config_from_deploy(path), policy), health_interval_s=health_interval_s)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.router, auth), host="127.0.0.1", port=port,
                                                    log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_up(self.url)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def deploy_of(backends, ids_roles, weights=None, kv_routes=()):
    return {"engine": "vllm", "engine_version": "x", "plan": "plan.json",
            "replicas": [{"id": i, "role": r, "devices": [], "launch": [], "endpoint": backends.urls[i]}
                         for i, r in ids_roles],
            "router": {"argv": [], "weights": weights or {}, "kv_routes": [
                {"from": a, "to": b, "weight": w} for a, b, w in kv_routes]}}


async def post_many(url, bodies, concurrency=50):
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=30) as c:
        async def one(body):
            async with sem:
                r = await c.post(f"{url}/v1/completions", json=body)
                return r.status_code, r.json() if not body.get("stream") else r.text
        return await asyncio.gather(*(one(b) for b in bodies))


def test_weights_are_followed(backends, tmp_path):
    # no health checks: the stand-ins share this process, and a backend taken out would (rightly) skew the shares
    weights = {"b0": 0.5, "b1": 0.3, "b2": 0.2}
    # smooth weighted round robin gives each backend its exact share of every ten picks: a hundred
    # requests tell a weight read wrong as surely as more would
    N = 100
    before = {b: backends.stats(b)["served"] for b in weights}
    route = RouteServer(deploy_of(backends, [(b, "colocated") for b in weights], weights), tmp_path,
                        health_interval_s=0)
    try:
        out = asyncio.run(post_many(route.url, [{"model": "tiny", "prompt": "hi", "max_tokens": 2}] * N))
    finally:
        route.stop()
    assert all(s == 200 for s, _ in out)
    served = Counter(body["served_by"] for _, body in out)
    for b, w in weights.items():
        assert backends.stats(b)["served"] - before[b] == served[b]
        assert abs(served[b] / N - w) <= 0.05 * w, (served, weights)


def test_pd_follows_vllm_proxy_protocol_and_kv_weights(backends, tmp_path):
    before = backends.stats("d0")["served"], backends.stats("d1")["served"]
    route = RouteServer(deploy_of(backends, [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")],
                                  {"p0": 1.0}, [("p0", "d0", 0.75), ("p0", "d1", 0.25)]), tmp_path)
    try:
        bodies = [{"model": "tiny", "prompt": "hi", "max_tokens": 3, "min_tokens": 1,
                   **({"stream": True, "stream_options": {"include_usage": True}} if i % 2 else {})}
                  for i in range(40)]
        out = asyncio.run(post_many(route.url, bodies, concurrency=8))
    finally:
        route.stop()
    assert all(s == 200 for s, _ in out), out[:3]
    for (s, body), req in zip(out, bodies):
        if req.get("stream"):  # the decode backend's stream, whole
            assert body.count("data: ") == 4 and body.rstrip().endswith("[DONE]")
        else:
            assert body["served_by"] in ("d0", "d1") and len(body["choices"][0]["text"].split()) == 3
    for b in ("p0", "d0", "d1"):
        assert backends.stats(b)["problems"] == []
    d0, d1 = backends.stats("d0")["served"] - before[0], backends.stats("d1")["served"] - before[1]
    assert (d0, d1) == (30, 10)
    assert backends.stats("d0")["kv_from"].get("p0", 0) >= 30


def test_bad_input_refused_like_serve_and_never_forwarded(backends, tmp_path):
    before = backends.stats("b0")["served"]
    route = RouteServer(deploy_of(backends, [("b0", "colocated")]), tmp_path)
    try:
        r1 = httpx.post(f"{route.url}/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": 9})
        r2 = httpx.post(f"{route.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        r3 = httpx.post(f"{route.url}/v1/chat/completions", json={"model": "tiny", "messages": [], "bogus": 1})
        deep = b'{"model": "tiny", "prompt": "x", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        r4 = httpx.post(f"{route.url}/v1/completions", content=deep, headers={"content-type": "application/json"})
        r5 = httpx.post(f"{route.url}/v1/completions", content=b"", headers={"content-type": "application/json"})
        # over the limit by its Content-Length: refused before the body is read, as serve refuses it
        big = httpx.post(f"{route.url}/v1/completions", content=b" " * (9 << 20),
                         headers={"content-type": "application/json"})
        metrics = httpx.get(f"{route.url}/metrics").text
    finally:
        route.stop()
    for r in (r1, r2, r3, r4, r5):
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert r1.json()["error"]["param"] == "temperature"
    assert r4.json()["error"]["message"] == "request body is nested too deeply"
    assert r5.json()["error"]["message"] == "request body must be a JSON object"
    assert big.status_code == 413 and "this server takes at most" in big.json()["error"]["message"], big.text
    assert backends.stats("b0")["served"] == before
    assert 'hetserve_route_backend_up{backend="b0"} 1.0' in metrics


def test_keys_hold_route_as_they_hold_serve(backends, tmp_path):
    """``hetserve route --api-key``: /v1/* needs a key (401 in the OpenAI error shape, nothing
    forwarded), the probes stay open unless protected, and no /openapi.json bypasses the check."""
    from hetserve.serve.keys import APIAuth, KeySet

    before = backends.stats("b0")["served"]
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    open_probes = RouteServer(deploy_of(backends, [("b0", "colocated")]), tmp_path, auth=APIAuth(KeySet(["k1"])))
    try:
        missing = httpx.post(f"{open_probes.url}/v1/completions", json=body)
        wrong = httpx.get(f"{open_probes.url}/v1/models", headers={"Authorization": "Bearer nope"})
        schema = httpx.get(f"{open_probes.url}/openapi.json", headers={"Authorization": "Bearer k1"})
        assert backends.stats("b0")["served"] == before
        good = httpx.post(f"{open_probes.url}/v1/completions", json=body, headers={"Authorization": "Bearer k1"})
        health = httpx.get(f"{open_probes.url}/health")
    finally:
        open_probes.stop()
    for r in (missing, wrong):
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert schema.status_code == 404
    assert good.status_code == 200 and backends.stats("b0")["served"] == before + 1
    assert health.status_code == 200
    guarded = RouteServer(deploy_of(backends, [("b0", "colocated")]), tmp_path,
                          auth=APIAuth(KeySet(["k1"]), protect_probes=True))
    try:
        assert httpx.get(f"{guarded.url}/health").status_code == 401
        assert httpx.get(f"{guarded.url}/metrics", headers={"Authorization": "Bearer k1"}).status_code == 200
    finally:
        guarded.stop()


def test_killed_backend_loses_no_request_that_had_not_streamed(backends, tmp_path, caplog):
    route = RouteServer(deploy_of(backends, [("s0", "colocated"), ("s1", "colocated")], {"s0": 0.5, "s1": 0.5}),
                        tmp_path)

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as c:
            async def one(i):
                await asyncio.sleep(0.01 * i)  # arrivals before and after the kill
                r = await c.post(f"{route.url}/v1/completions",
                                 json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True})
                return r.status_code, r.text
            tasks = [asyncio.create_task(one(i)) for i in range(40)]
            await asyncio.sleep(0.15)  # s1 holds requests that have not streamed (its first byte takes 3 s)
            await asyncio.to_thread(backends.kill, "s1")
            return await asyncio.gather(*tasks)
    try:
        out = asyncio.run(scenario())
        metrics = httpx.get(f"{route.url}/metrics").text
        health = httpx.get(f"{route.url}/health")
    finally:
        route.stop()
    assert all(s == 200 for s, _ in out)
    # s0 still serves: degraded, as `serve` says of a replica down
    assert health.status_code == 200 and health.json() == {"status": "degraded", "backends": {"s0": True, "s1": False}}
    # none had streamed from s1 when it died: every request completes, all four tokens, on s0 at the end
    for _, text in out:
        assert '"error"' not in text and text.count("data: ") == 5, text
    assert sum(1 for _, t in out if '"served_by": "s0"' in t) == 40
    assert 'hetserve_route_backend_up{backend="s1"} 0.0' in metrics
    assert 'hetserve_route_retries_total{backend="s1"}' in metrics
    # the operator hears of it in the log, once, not only in /metrics
    downs = [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]
    assert len(downs) == 1 and "s1" in downs[0] and backends.urls["s1"] in downs[0], downs


def test_openai_client_runs_unchanged_against_route(backends, tmp_path):
    import openai

    route = RouteServer(deploy_of(backends, [("b0", "colocated"), ("b1", "colocated")]), tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{route.url}/v1", api_key="unused", max_retries=0)
        done = client.completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert len(done.choices[0].text.split()) == 3
        parts = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="hi", max_tokens=3,
                                                                      stream=True)]
        assert len(parts) == 3 and parts[0].endswith("-0")
        assert [m.id for m in client.models.list()] == ["tiny"]
        assert client.models.retrieve("tiny").id == "tiny"
        with pytest.raises(openai.NotFoundError) as err:  # as serve answers it
            client.models.retrieve("other")
        assert err.value.body["code"] == "model_not_found" and "'tiny'" in err.value.body["message"]
    finally:
        route.stop()


def test_health_checks_take_out_a_refusing_backend_at_once_and_a_slow_one_after_n_in_a_row():
    """A refused connection is an outage; one slow /health answer from a busy backend is not. The
    checks carry the backends' key."""
    from hetserve.serve.route.app import Router
    from hetserve.serve.route.backends import Backend, BackendPool, RouteConfig

    answers = {"slow": [], "gone": []}  # per host: what its next /health checks do, in order

    def handler(request):
        assert request.headers["authorization"] == "Bearer backend-key"  # probes guarded by the key pass
        kind = answers[request.url.host].pop(0)
        if kind == "timeout":
            raise httpx.ReadTimeout("slow", request=request)
        if kind == "refused":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200 if kind == "ok" else 503, json={})

    slow, gone = Backend("slow", "colocated", "http://slow"), Backend("gone", "colocated", "http://gone")

    async def scenario():
        router = Router(BackendPool(RouteConfig((slow, gone))), health_interval_s=0, health_failures=3,
                        api_key="backend-key")
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        seen = []
        answers["slow"] += ["timeout", "503", "ok", "timeout", "timeout", "timeout", "ok"]
        answers["gone"] += ["refused", "ok"] + ["ok"] * 5
        for _ in range(7):
            await asyncio.gather(router.check(slow), router.check(gone))
            seen.append((slow.alive, gone.alive))
        await router.close()
        return seen

    seen = asyncio.run(scenario())
    # slow: two failures, then a pass resets the count; three in a row take it out; a pass brings it back
    assert [s for s, _ in seen] == [True, True, True, True, True, False, True]
    # gone: out on the first refused connection, back on the next pass
    assert [g for _, g in seen] == [False, True, True, True, True, True, True]


def test_route_on_port_0_says_the_port_it_listens_on():
    """``--port 0``: the OS picks the port, and the start-up line names that one (as ``serve``'s does)."""
    import os
    import re

    proc = subprocess.Popen([sys.executable, "-m", "hetserve.cli.main", "route", "--backends", "http://127.0.0.1:9",
                             "--port", "0", "--health-interval", "0"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NO_PROXY": "127.0.0.1"})
    try:
        line = proc.stderr.readline()
        found = re.search(r"on (http://127\.0\.0\.1:(\d+)): 1 backend", line)
        assert found and found.group(2) != "0", line
        wait_up(found.group(1))
        assert httpx.get(found.group(1) + "/health").json()["backends"] == {"b0": True}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_stream_that_breaks_midway_ends_with_an_error_event_and_is_counted_once():
    """After its first bytes a stream cannot move: the client gets an error event and [DONE], the
    backend is taken out, and the attempt is counted once, as broken (not as a failed attempt too)."""
    from hetserve.serve.route.app import Router
    from hetserve.serve.route.backends import Backend, BackendPool, RouteConfig

    class Breaks(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": []}\n\n'
            raise httpx.ReadError("connection reset")

    b0 = Backend("b0", "colocated", "http://b0")

    async def scenario():
        router = Router(BackendPool(RouteConfig((b0,))), health_interval_s=0)
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(
            lambda request: httpx.Response(200, stream=Breaks())))
        status, _, stream = await router.answer("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
        got = [chunk async for chunk in stream]
        await router.close()
        return status, got, router.metrics.registry

    status, got, registry = asyncio.run(scenario())
    assert status == 200 and got[0].startswith(b"data: ") and b"failed mid-stream" in got[-2]
    assert got[-1] == b"data: [DONE]\n\n"  # as serve ends a stream that fails
    assert not b0.alive
    count = lambda outcome: registry.get_sample_value("hetserve_route_requests_total",  # noqa: E731
                                                      {"backend": "b0", "outcome": outcome}) or 0
    assert (count("broken"), count("failed")) == (1, 0)
