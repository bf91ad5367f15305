"""Penalties and logprobs: the sampler's definitions on its own, then end to end through real workers
against transformers' logits of the same sequence (asymmetric pipeline with chunked prefill; P/D)."""

from __future__ import annotations

import pytest
import torch

from hetserve.runtime.params import SamplingParams
from hetserve.runtime.sampling import penalize, sample, token_logprobs

PROMPT = list(b"The quick brown fox jumps over the lazy dog, ") + [300, 7, 7, 301]  # 49 tokens
TOL = 1e-4


# ----------------------------------------------------------------------------- the sampler alone


def test_penalties_follow_their_definitions():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    history = ([1], [3, 3, 2])  # prompt saw token 1; output has 3 twice, 2 once
    got = penalize(row, history, presence=0.5, frequency=0.25, repetition=2.0)
    # repetition on 1 (prompt), 2, 3 (output): positive / 2, negative * 2; then frequency and presence
    want = torch.tensor([2.0, -2.0, 0.25 - 0.25 - 0.5, 1.5 - 0.5 - 0.5, -2.0])
    assert torch.allclose(got, want), got
    assert penalize(row, history, 0.0, 0.0, 1.0) is row  # neutral: untouched


def test_penalties_change_the_greedy_choice_and_nothing_without_history():
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0]])
    greedy = (0.0, 1.0, 0, 0)
    assert sample(logits, [greedy]).tolist() == [1]
    rep = (0.0, 1.0, 0, 1, 0.0, 0.0, 1.5, -1)
    assert sample(logits, [rep], [([], [1])]).tolist() == [2]  # 5 / 1.5 < 4.9
    pres = (0.0, 1.0, 0, 1, 0.2, 0.0, 1.0, -1)
    assert sample(logits, [pres], [([], [1])]).tolist() == [2]  # 5 - 0.2 < 4.9
    freq = (0.0, 1.0, 0, 1, 0.0, 0.06, 1.0, -1)
    assert sample(logits, [freq], [([], [1])]).tolist() == [1]  # 5 - 0.06 > 4.9 ...
    assert sample(logits, [freq], [([], [1, 1])]).tolist() == [2]  # ... 5 - 0.12 < 4.9: counts matter
    # sampled rows are penalised too: a token pushed far down is never drawn
    hot = (1.0, 1.0, 7, 0, 2.0, 2.0, 1.0, -1)
    draws = {sample(logits, [hot[:3] + (i,) + hot[4:]], [([], [1] * 50)]).item() for i in range(50)}
    assert 1 not in draws


def test_token_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(3, 40)
    tokens = torch.tensor([4, 0, 39])
    lp, ids, lps = token_logprobs(logits, tokens, 5)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(lp, ref[torch.arange(3), tokens])
    assert torch.equal(ids, ref.topk(5, -1).indices) and torch.allclose(lps, ref.topk(5, -1).values)
    with pytest.raises(ValueError):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError):
        SamplingParams(logprobs=21)


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def served(model_dirs, cluster_file):
    """One engine, two shapes (workers are what a test pays for): a P/D pair whose prefill replica
    ``p0`` is a pipeline of two stages with 1 and 2 layers (the first token and the prompt's logprobs
    come from its last stage, the rest from ``d0``), and a colocated replica ``c0``."""
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    from tests.runtime.conftest import LAYERS

    plan = Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
        {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, 1]},
                                                   {"devices": ["m0:1"], "layers": [1, LAYERS]}]},
        {"id": "d0", "role": "decode", "stages": [{"devices": ["m0:2"], "layers": [0, LAYERS]}]},
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:3"], "layers": [0, LAYERS]}]}],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]})
    eng = Engine.from_plan(plan, cluster_file, model_dirs["llama"],
                           EngineConfig(kv_capacity_tokens=4096, block_size=16))
    yield eng
    eng.shutdown()


def test_prompt_targets_of_chunks_cover_the_prompt_once():
    """Chunked prefill: the targets each chunk asks logprobs for, joined, are the prompt after its
    first token; the result rows land at their positions (``StepLogprobs``)."""
    from hetserve.runtime.sequence import StepLogprobs
    from hetserve.runtime.handle import RequestHandle
    from hetserve.runtime.sequence import Sequence

    h = RequestHandle(1, len(PROMPT))
    seq = Sequence(1, PROMPT, SamplingParams(prompt_logprobs=2), 0, frozenset(), h)
    joined = []
    for start in range(0, len(PROMPT), 16):
        q = min(16, len(PROMPT) - start)
        targets = (seq.step_extra(start, q) or {}).get("targets", [])  # the prompt's last position has none
        joined += targets
        if not targets:
            continue
        seq.num_cached = start
        n = len(targets)
        fake = {"p_lp": -torch.arange(start, start + n, dtype=torch.float32),
                "p_top_ids": torch.zeros(n, 2, dtype=torch.long), "p_top_lps": torch.zeros(n, 2)}
        h._prompt_logprobs(*StepLogprobs([seq], [q], fake).prompt[0])
    assert joined == PROMPT[1:]
    assert [lp for lp, _ in h.prompt_logprobs] == [-float(i) for i in range(len(PROMPT) - 1)]
    assert seq.step_extra(len(PROMPT), 1) is None  # decoding: nothing more to ask


@pytest.fixture(scope="module")
def hf_logits(model_dirs):
    """ids -> transformers' logits at every position (T, V), float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dirs["llama"]), torch_dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float()

    return run


def _check(pairs, ref_rows, tokens):
    for (lp, top), ref, tok in zip(pairs, ref_rows, tokens):
        assert abs(lp - ref[tok].item()) < TOL
        want = ref.topk(len(top))
        assert [i for i, _ in top] == want.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(top, want.values.tolist())) < TOL


@pytest.mark.parametrize("temperature, replica", [(0.0, "p0"), (0.9, "p0"), (0.9, "c0")])
def test_logprobs_match_transformers(served, hf_logits, temperature, replica):
    n = 6
    h = served.submit(PROMPT, SamplingParams(max_tokens=n, temperature=temperature, seed=3, ignore_eos=True,
                                             logprobs=5, prompt_logprobs=3), replica=replica)
    out = h.result(60)
    ref = torch.log_softmax(hf_logits(PROMPT + out), -1)  # row t predicts token t + 1
    assert len(h.logprobs) == n and len(h.prompt_logprobs) == len(PROMPT) - 1
    _check(h.logprobs, ref[len(PROMPT) - 1:], out)
    _check(h.prompt_logprobs, ref[:len(PROMPT) - 1], PROMPT[1:])


def test_penalties_end_to_end_equal_their_definition_on_transformers_logits(served, hf_logits):
    params = SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.3)
    out = served.submit(PROMPT, params, replica="p0").result(60)
    want: list[int] = []
    for _ in range(8):  # greedy on the penalised raw logits, one token at a time
        logits = hf_logits(PROMPT + want)[-1]
        want.append(int(penalize(logits, (sorted(set(PROMPT)), want), 0.5, 0.3, 1.3).argmax()))
    plain = served.submit(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)).result(60)
    assert out != plain  # the penalties changed something ...
    assert out == want  # ... exactly as defined


def test_prompt_scoring_over_http_equals_transformers_log_likelihood(served, hf_logits, model_dirs):
    """What lm-evaluation-harness's local-completions model sends: a list of prompts, ``echo``,
    ``max_tokens: 0``, ``logprobs``; each prompt's logprobs (and their sum) are transformers'."""
    import httpx

    from hetserve.serve.app import create_app
    from hetserve.serve.coordinator import Coordinator
    from hetserve.serve.engine_backend import EngineBackend
    from hetserve.serve.server import ServerThread
    from hetserve.serve.text import HFCodec

    codec = HFCodec.from_dir(model_dirs["llama"])
    prompts = ["The quick brown fox", "jumps over the lazy dog."]
    with ServerThread(create_app(Coordinator(EngineBackend(served), codec, "tiny"))) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompts, "echo": True, "max_tokens": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    for choice, prompt in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), prompts):
        ids = codec.encode(prompt)
        ref = torch.log_softmax(hf_logits(ids), -1)
        want = [ref[t, ids[t + 1]].item() for t in range(len(ids) - 1)]
        got = choice["logprobs"]["token_logprobs"]
        assert choice["text"] == prompt and got[0] is None and len(got) == len(ids)
        assert max(abs(a - b) for a, b in zip(got[1:], want)) < TOL
        assert abs(sum(got[1:]) - sum(want)) < TOL * len(want)


def test_n_choices_share_the_prompts_kv_blocks_and_each_equals_its_single_run(served):
    """n = 4 on a 512-token prompt with 32 new tokens holds the prompt's full blocks once (each choice
    re-prefills under a block of its own), and each choice is what a single request with its seed gives."""
    prompt = [(i * 7) % 250 + 1 for i in range(512)]
    blocks = served.schedulers["c0"].blocks

    def params(i):
        return SamplingParams(max_tokens=32, temperature=1.0, seed=100 + i, ignore_eos=True)

    def peak(run):
        blocks.peak_used_blocks = blocks.num_used_blocks
        out = run()
        return out, blocks.peak_used_blocks

    singles, one = peak(lambda: [served.submit(prompt, params(i), replica="c0").result(60) for i in range(4)])

    def group():
        first = served.submit(prompt, params(0), replica="c0")
        rest = [served.submit(prompt, params(i), replica="c0", share_prefix_with=first) for i in range(1, 4)]
        return [h.result(60) for h in [first, *rest]]

    choices, four = peak(group)
    assert choices == singles and len({tuple(c) for c in choices}) == 4
    assert four <= 1.3 * one, (four, one)
    assert blocks.num_used_blocks == 0  # every shared block went back once its last holder ended


def test_n_choices_over_http_each_equal_a_single_request_with_its_seed(served, model_dirs):
    import httpx

    from hetserve.serve.app import create_app
    from hetserve.serve.coordinator import Coordinator
    from hetserve.serve.engine_backend import EngineBackend
    from hetserve.serve.server import ServerThread
    from hetserve.serve.text import HFCodec

    body = {"model": "tiny", "prompt": "a prompt of some length " * 3, "max_tokens": 8, "temperature": 1.0,
            "seed": 7, "ignore_eos": True}
    with ServerThread(create_app(Coordinator(EngineBackend(served), HFCodec.from_dir(model_dirs["llama"]),
                                             "tiny"))) as srv:
        many = httpx.post(srv.url + "/v1/completions", json={**body, "n": 3}, timeout=60).json()
        singles = [httpx.post(srv.url + "/v1/completions", json={**body, "seed": 7 + i}, timeout=60).json()
                   for i in range(3)]
    texts = [c["text"] for c in sorted(many["choices"], key=lambda c: c["index"])]
    assert texts == [s["choices"][0]["text"] for s in singles] and len(set(texts)) == 3
