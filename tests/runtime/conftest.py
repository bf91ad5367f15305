"""Fixtures for the runtime tests: tiny checkpoints, a 4-device cluster file, plan builders, HF references.

Checkpoints are built once per session in a tmp dir (``hetserve.runtime.model.make``); nothing is
downloaded. The reference for every equivalence test is transformers' own ``generate`` (greedy)
on the same checkpoint, one prompt at a time.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CLUSTER_YAML = """\
name: runtime-test
machines:
  - {name: m0, gpu: RTX-4090, count: 4}
"""

LAYERS = 3


@pytest.fixture(scope="session")
def cluster_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster") / "cluster.yaml"
    path.write_text(CLUSTER_YAML)
    return path


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """{"llama": dir, "opt": dir}: 3 layers, hidden 64, 4 heads (Llama: 2 KV heads, GQA)."""
    from hetserve.runtime.model.make import make_model

    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make_model(root / "llama", "llama", layers=LAYERS, hidden=64, heads=4, kv_heads=2, seed=1),
        "opt": make_model(root / "opt", "opt", layers=LAYERS, hidden=64, heads=4, seed=2),
    }


def colocated_plan():
    """Asymmetric colocated replica: TP 2 on layer 0, then TP 1 on layers 1-2."""
    from hetserve.planner.plan import Plan

    return Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0", "m0:1"], "layers": [0, 1]},
                                                     {"devices": ["m0:2"], "layers": [1, LAYERS]}]}]})


def disaggregated_plan():
    """Prefill TP 2 over all layers -> decode two pipeline stages of TP 1 (layers 0-1, 2)."""
    from hetserve.planner.plan import Plan

    return Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
        {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0", "m0:1"], "layers": [0, LAYERS]}]},
        {"id": "d0", "role": "decode", "stages": [{"devices": ["m0:2"], "layers": [0, 2]},
                                                  {"devices": ["m0:3"], "layers": [2, LAYERS]}]}],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]})


def single_plan(stages=((("m0:0",), (0, LAYERS)),)):
    from hetserve.planner.plan import Plan

    return Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
        {"id": "c0", "role": "colocated",
         "stages": [{"devices": list(d), "layers": list(l)} for d, l in stages]}]})


_HF_CACHE: dict = {}
_HF_OUTPUTS: dict = {}  # (model dir, prompts, max new tokens) -> the greedy outputs: the engine shapes of a file share them


def hf_greedy(model_dir, prompts, max_new_tokens):
    """transformers' greedy ``generate`` output (new tokens only) for each prompt, one at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(key).eval()
    model = _HF_CACHE[key]
    asked = (key, tuple(tuple(p) for p in prompts), max_new_tokens)
    if asked not in _HF_OUTPUTS:
        out = []
        with torch.no_grad():
            for p in prompts:
                ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)
                out.append(ids[0, len(p):].tolist())
        _HF_OUTPUTS[asked] = out
    return [list(tokens) for tokens in _HF_OUTPUTS[asked]]


@pytest.fixture(scope="session")
def plans():
    """Plan builders: plans.colocated(), plans.disaggregated(), plans.single(stages)."""
    import types

    return types.SimpleNamespace(colocated=colocated_plan, disaggregated=disaggregated_plan, single=single_plan)


@pytest.fixture(scope="session")
def hf_reference():
    """hf_reference(model_dir, prompts, max_new_tokens) -> transformers' greedy outputs."""
    return hf_greedy


@pytest.fixture(scope="module")
def two_torch_threads():
    """Two torch threads for a module's tests, where the test processes run one (tests/conftest.py):
    the C++ kernels split their rows between threads (``at::parallel_for``), and a split that drops or
    repeats rows shows only with more than one."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)
