"""Engine behaviour with real worker processes: KV admission, many concurrent requests, sampling
parameters, streaming, aborts, dead workers, start-up failures and plan/checkpoint mismatches."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from hetserve.errors import InfeasibleError, PlanError, RuntimeFailure
from hetserve.runtime.params import SamplingParams

PROMPT = list(b"continuous batching")


@pytest.fixture(scope="module")
def engine(model_dirs, cluster_file, plans):
    """Colocated Llama, two pipeline stages of TP 1 (layers 0, then 1-2)."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    plan = plans.single(((("m0:0",), (0, 1)), (("m0:1",), (1, 3))))
    eng = Engine.from_plan(plan, cluster_file, model_dirs["llama"], EngineConfig(kv_capacity_tokens=8192))
    yield eng
    eng.shutdown()


@pytest.mark.timeout(120)
def test_fifty_concurrent_requests_complete_with_exact_counts(engine):
    handles = []
    for i in range(50):
        prompt = [(7 * i + j) % 256 for j in range(3 + i % 17)]
        handles.append(engine.submit(prompt, SamplingParams(max_tokens=5 + i % 11, ignore_eos=True)))
    outs = [h.result(timeout=90) for h in handles]
    assert [len(o) for o in outs] == [5 + i % 11 for i in range(50)]
    assert all(h.finish_reason == "length" for h in handles)
    stats = engine.stats()
    assert stats["failed"] == 0
    assert stats["replicas"]["c0"]["steps"] < sum(len(o) for o in outs)  # requests shared steps


@pytest.mark.timeout(60)
def test_batched_output_equals_solo_output(engine):
    """Continuous batching does not change a request's greedy tokens."""
    solo = engine.submit(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True)).result(timeout=30)
    crowd = [engine.submit([i % 256] * (i + 1), SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(10)]
    again = engine.submit(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    assert again.result(timeout=30) == solo
    for h in crowd:
        h.result(timeout=30)


@pytest.mark.timeout(60)
def test_max_tokens_and_stop_tokens(engine):
    greedy = engine.submit(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True)).result(timeout=30)
    assert len(greedy) == 16
    stop = greedy[5]
    cut = greedy.index(stop) + 1
    h = engine.submit(PROMPT, SamplingParams(max_tokens=16, stop_token_ids=(stop,), ignore_eos=True))
    assert h.result(timeout=30) == greedy[:cut]
    assert h.finish_reason == "stop"
    one = engine.submit(PROMPT, SamplingParams(max_tokens=1))
    assert one.result(timeout=30) == greedy[:1] and one.finish_reason in ("length", "stop")


@pytest.mark.timeout(60)
def test_seeded_sampling_is_reproducible(engine):
    def run(seed, **kw):
        p = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True, **kw)
        return engine.submit(PROMPT, p).result(timeout=30)

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c
    greedy = engine.submit(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True)).result(timeout=30)
    assert run(9, top_p=1e-6) == greedy  # top-p keeping one token is greedy


@pytest.mark.timeout(60)
def test_async_streaming_and_abort(engine):
    expected = engine.submit(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True)).result(timeout=30)

    async def stream():
        return [t async for t in engine.submit(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))]

    assert asyncio.run(stream()) == expected
    long = engine.submit(PROMPT, SamplingParams(max_tokens=900, ignore_eos=True))
    it = iter(long)
    next(it)
    long.abort()
    rest = list(it)
    assert long.finish_reason == "abort" and len(rest) < 899
    deadline = time.monotonic() + 10
    while engine.stats()["replicas"]["c0"]["kv_used_blocks"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats()["replicas"]["c0"]["kv_used_blocks"] == 0


@pytest.mark.timeout(60)
def test_bad_requests_are_rejected_at_submit(engine):
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit([10_000])
    with pytest.raises(ValueError, match="empty"):
        engine.submit([])
    with pytest.raises(ValueError, match="context"):
        engine.submit([1] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="replica"):
        engine.submit([1], replica="nope")


@pytest.mark.timeout(120)
def test_request_whose_kv_does_not_fit_waits_then_completes(model_dirs, cluster_file, plans, hf_reference):
    """A 64-token pool holds one request of 20 + 40 tokens: the second waits for the first to finish."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    eng = Engine.from_plan(plans.single(), cluster_file, model_dirs["llama"],
                           EngineConfig(kv_capacity_tokens=64, block_size=16))
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        prompts = [list(range(20)), list(range(100, 120))]
        a, b = eng.submit(prompts[0], params), eng.submit(prompts[1], params)
        max_waiting = 0
        while not a.finished:
            max_waiting = max(max_waiting, eng.stats().get("waiting", 0))
            time.sleep(0.005)
        outs = [a.result(timeout=60), b.result(timeout=60)]
        assert [len(o) for o in outs] == [40, 40]
        assert max_waiting == 1
        assert b.first_token_time >= a.finish_time  # admitted only once a's KV was freed
        with pytest.raises(InfeasibleError):
            eng.submit(list(range(30)), SamplingParams(max_tokens=40))  # 70 tokens can never fit
        # greedy outputs still match transformers (compared up to transformers' own eos stop)
        ref = hf_reference(model_dirs["llama"], prompts, 40)
        for got, want in zip(outs, ref):
            assert got[:len(want)] == want
    finally:
        eng.shutdown()


@pytest.mark.timeout(120)
def test_worker_start_failure_is_reported(model_dirs, cluster_file, plans, tmp_path):
    """A checkpoint missing a tensor of stage 2: the worker's error reaches the caller, nothing hangs."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hetserve.runtime.engine import Engine

    broken = tmp_path / "broken"
    shutil.copytree(model_dirs["llama"], broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    plan = plans.single(((("m0:0",), (0, 2)), (("m0:1",), (2, 3))))
    with pytest.raises(RuntimeFailure, match=r"worker m0:1 .* failed to load its shard.*down_proj"):
        Engine.from_plan(plan, cluster_file, broken)


def test_plan_checkpoint_mismatch_is_a_plan_error(model_dirs, cluster_file, plans):
    from hetserve.runtime.engine import Engine

    plan = plans.single(((("m0:0",), (0, 2)), (("m0:1",), (2, 4))))  # 4 layers, checkpoint has 3
    with pytest.raises(PlanError, match=r"stages reach layer 4, beyond the checkpoint .*3 layers") as err:
        Engine.from_plan(plan, cluster_file, model_dirs["llama"])
    assert str(model_dirs["llama"]) in str(err.value)  # which checkpoint: the folder, not its architecture
    tp3 = plans.single(((("m0:0", "m0:1", "m0:2"), (0, 3)),))  # 3 does not divide 4 heads
    with pytest.raises(PlanError, match="TP degree 3"):
        Engine.from_plan(tp3, cluster_file, model_dirs["llama"])


def test_stage_too_big_for_device_memory_is_a_plan_error(cluster_file, plans, tmp_path):
    """A Llama-2-70B-shaped config on one 24 GB device: refused before any process starts."""
    from hetserve.runtime.engine import Engine

    big = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672,
           "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
           "max_position_embeddings": 4096, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(big))
    with pytest.raises(PlanError, match=r"device m0:0 \(RTX-4090.*weights and activation buffers need"):
        Engine.from_plan(plans.single(((("m0:0",), (0, 80)),)), cluster_file, tmp_path)
    with pytest.raises(PlanError, match="KV pool"):
        from hetserve.runtime.engine_config import EngineConfig

        small = dict(big, num_hidden_layers=3, hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
                     num_key_value_heads=8)
        (tmp_path / "config.json").write_text(json.dumps(small))
        Engine.from_plan(plans.single(), cluster_file, tmp_path, EngineConfig(kv_capacity_tokens=10 ** 9))
