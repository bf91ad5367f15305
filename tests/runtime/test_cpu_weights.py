"""A CPU stage's linear weights in their dtype's layout compute what plain linears compute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetserve.runtime.model import cpu_weights
from hetserve.runtime.model.config import llama_arch
from hetserve.runtime.model.cpu_weights import linear_weight, pack_bfloat16_linears
from hetserve.runtime.model.make import random_stage

CFG = llama_arch(hidden=64, heads=4, kv_heads=2, ffn=160, layers=2, vocab=300)


def _linears(stage: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: mod for name, mod in stage.named_modules() if isinstance(mod, torch.nn.Linear)}


# oneDNN's packed bfloat16 linear refuses CPUs without AVX512 BW/VL/DQ or AVX-NE-CONVERT (its
# reorder raises). There the engine never packs (the probe says no, which the first test below
# checks against oneDNN's own flag) and linears stay plain, which the later tests cover; the packed
# path's own test runs wherever the CPU has those instructions.
needs_packing = pytest.mark.skipif(
    not cpu_weights.bfloat16_packing_works(),
    reason="this CPU lacks AVX512 BW/VL/DQ and AVX-NE-CONVERT, so oneDNN has no packed bfloat16 linear and the "
           "engine keeps linears plain here (tested below); the packed path runs only on CPUs that have them")


def test_the_packed_linear_works_where_onednn_has_bfloat16():
    """Where oneDNN has a bfloat16 GEMM the packed path is what runs; elsewhere the probe says no."""
    assert cpu_weights.bfloat16_packing_works() == torch.ops.mkldnn._is_mkldnn_bf16_supported()


@needs_packing
@pytest.mark.parametrize("shape", [(1,), (37,), (3, 5)])
def test_packed_bfloat16_linears_compute_what_plain_ones_do(shape):
    stage = random_stage(CFG, 2, "cpu", torch.bfloat16, seed=1, has_embed=True, has_head=True)
    linears = _linears(stage)
    assert len(linears) == 7 * 2 + 1 and all(m.weight is None for m in linears.values())
    gen = torch.Generator().manual_seed(2)
    for name, mod in linears.items():
        x = torch.randn(*shape, mod.in_features, generator=gen, dtype=torch.bfloat16)
        want = F.linear(x, linear_weight(mod), mod.bias)
        got = mod(x)
        assert got.shape == want.shape and got.dtype == torch.bfloat16, name
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2, msg=name)


def test_a_packed_linears_hooks_still_run():
    """Tensor parallelism adds its all-reduce as a forward hook: packing must keep it."""
    stage = random_stage(CFG, 1, "cpu", torch.bfloat16, seed=1, has_embed=False, has_head=False)
    down = stage.layers[0].mlp.down_proj
    down.register_forward_hook(lambda _m, _i, out: out * 2)
    x = torch.randn(4, down.in_features, dtype=torch.bfloat16)
    torch.testing.assert_close(down(x), 2 * F.linear(x, linear_weight(down), down.bias), rtol=1.6e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_only_bfloat16_is_packed(dtype):
    stage = random_stage(CFG, 1, "cpu", dtype, seed=1, has_embed=False, has_head=False)
    assert pack_bfloat16_linears(stage) == 0
    assert all(m.weight is not None and not hasattr(m, "packed_weight") for m in _linears(stage).values())


def test_without_onednn_bfloat16_linears_stay_plain(monkeypatch):
    monkeypatch.setattr(cpu_weights, "bfloat16_packing_works", lambda: False)
    stage = random_stage(CFG, 1, "cpu", torch.bfloat16, seed=1, has_embed=False, has_head=False)
    linears = _linears(stage)
    assert all(m.weight is not None and "forward" not in vars(m) for m in linears.values())
    x = torch.randn(3, CFG.hidden_size, dtype=torch.bfloat16)
    q = stage.layers[0].self_attn.q_proj
    assert torch.equal(q(x), F.linear(x, q.weight, q.bias))
