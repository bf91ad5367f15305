"""Logprobs of an OPT checkpoint (learned positions offset by two, a separate final norm, the tied
head) against transformers, through real workers: the sampled tokens' logprobs, the top 5 and the
prompt's logprobs equal ``log_softmax`` of transformers' float32 logits within 1e-4, on a colocated
replica and on a P/D pair (first token and prompt logprobs from the prefill replica, the rest from
the decode replica). Three workers and an OPT checkpoint take about 25 s to start: ``long``."""

from __future__ import annotations

import pytest
import torch

from hetserve.runtime.params import SamplingParams
from tests.runtime.test_sampler_logprobs import _check  # the same comparison as the Llama's

pytestmark = pytest.mark.long

PROMPT = list(b"OPT scores these bytes: ") + [300, 7, 7, 301]


@pytest.fixture(scope="module")
def served(model_dirs, cluster_file):
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from tests.runtime.conftest import LAYERS

    whole = [0, LAYERS]
    plan = Plan.from_dict({"model": "tiny-opt", "cluster": "runtime-test", "replicas": [
        {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": whole}]},
        {"id": "d0", "role": "decode", "stages": [{"devices": ["m0:1"], "layers": whole}]},
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:2"], "layers": whole}]}],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]})
    eng = Engine.from_plan(plan, cluster_file, model_dirs["opt"], EngineConfig(kv_capacity_tokens=1024, block_size=16))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference(model_dirs):
    """ids -> log_softmax of transformers' logits at every position (T, V), float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dirs["opt"]), torch_dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)

    return run


@pytest.mark.parametrize("temperature, replica", [(0.0, "c0"), (0.9, "c0"), (0.9, "p0")])
def test_opt_logprobs_match_transformers(served, reference, temperature, replica):
    n = 6
    h = served.submit(PROMPT, SamplingParams(max_tokens=n, temperature=temperature, seed=5, ignore_eos=True,
                                             logprobs=5, prompt_logprobs=3), replica=replica)
    out = h.result(60)
    ref = reference(PROMPT + out)  # row t predicts token t + 1
    assert len(h.logprobs) == n and len(h.prompt_logprobs) == len(PROMPT) - 1
    _check(h.logprobs, ref[len(PROMPT) - 1:], out)
    _check(h.prompt_logprobs, ref[:len(PROMPT) - 1], PROMPT[1:])
