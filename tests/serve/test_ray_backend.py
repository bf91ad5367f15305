"""``--backend ray``: the same plan served with every worker a Ray actor on its machine's node
returns the same greedy tokens as local processes, its listeners take their ports from
``--port-range``, and its workers' link counters reach the engine. One-machine Ray, listeners on
loopback."""

from __future__ import annotations

import shutil
import tempfile

import pytest

import ray  # noqa: E402  (make test installs the ray extra: a missing ray must fail, not skip)

PLAN = {"model": "tiny", "cluster": "demo-cpu", "replicas": [
    {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, 4]}]},
    {"id": "d0", "role": "decode", "stages": [{"devices": ["m1:0"], "layers": [0, 1]},
                                              {"devices": ["m1:1"], "layers": [1, 4]}]}],
    "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}
PROMPTS = ["hello", "the quick brown fox", "x" * 40]


@pytest.mark.long
@pytest.mark.slow
def test_ray_backend_returns_the_same_greedy_tokens_as_local(tmp_path, monkeypatch, wait_until):
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # Ray's socket paths must stay under 107 bytes, which pytest's tmp_path can exceed: a short
    # private folder of this test, removed at the end
    ray_tmp = tempfile.mkdtemp(prefix="hsray-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    try:
        _compare_backends(tmp_path, wait_until)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _compare_backends(tmp_path, wait_until):
    import openai

    from hetserve.planner.plan import Plan
    from hetserve.runtime.model.make import make_model
    from hetserve.runtime.workers.ray_backend import RayWorkerProcess
    from hetserve.runtime.params import SamplingParams
    from hetserve.serve.launch import ServeOptions, start_server
    from tests.runtime.test_port_range import free_run

    model = make_model(tmp_path / "tiny", "llama", layers=4, hidden=64, heads=4, kv_heads=2, max_positions=256)
    plan = Plan.from_dict(PLAN)
    tokens, texts = {}, {}
    for backend in ("local", "ray"):
        ports = free_run(4) if backend == "ray" else None  # the engine's endpoint and three workers'
        opts = ServeOptions(plan=plan, cluster="demo-cpu", model_dir=str(model), model_name="tiny", backend=backend,
                            port_range=ports)
        with start_server(opts) as srv:
            dep = srv.deployment
            if backend == "ray":
                used = [tuple(a) for a in (dep.engine.transport.address, *dep.engine.workers.addresses.values())]
                assert len(set(used)) == 4 and all(ports.lo <= port <= ports.hi for _, port in used), used
                assert all(isinstance(p, RayWorkerProcess) for p in dep.engine.procs.values())
                assert {p.machine for p in dep.engine.procs.values()} == {"m0", "m1"}
                assert ray.is_initialized()
                # the Ray-placed workers' endpoints refuse what local ones refuse
                from tests.runtime.attacks import attack

                for address in [dep.engine.transport.address, *dep.engine.workers.addresses.values()]:
                    attack(address, str(tmp_path / "pwned"))
            ids = [dep.coordinator.codec.encode(p) for p in PROMPTS]
            tokens[backend] = dep.engine.generate(ids, SamplingParams(max_tokens=10, temperature=0.0), timeout=120)
            # what the actors sent (the KV hand-off, the decode stages' activations), as they reported it
            assert wait_until(lambda: {(s.src, s.dst) for s in dep.engine.link_stats()
                                       if sum(s.bytes_sent.values()) > 0} >= {("m0:0", "m1:0"), ("m1:0", "m1:1")}, 10)
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
            texts[backend] = [c.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0).choices[0].text
                              for p in PROMPTS]
    assert not ray.is_initialized()  # the session this server started is shut down
    assert not (tmp_path / "pwned").exists()
    assert tokens["ray"] == tokens["local"]
    assert texts["ray"] == texts["local"]
