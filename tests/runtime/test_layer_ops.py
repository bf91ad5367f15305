"""A Llama layer's small ops (``kernels.rms_norm``, ``kernels.rotary``) against transformers' own,
in the C++ kernels and the plain-torch fallback; the C++ ``store_kv``'s refusals."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from hetserve.runtime import kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["native", "torch"]


# the C++ kernels split their rows between threads: checked with two (``two_torch_threads``)
pytestmark = pytest.mark.usefixtures("two_torch_threads")


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (37, 96), (3, 5, 128)])
def test_rms_norm_is_transformers(impl, dtype, shape):
    x = 3 * _randn(*shape, dtype=dtype, seed=1)
    hf = LlamaRMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(_randn(shape[-1], dtype=torch.float32, seed=2))
    hf = hf.to(dtype)
    got, want = kernels.rms_norm(x, hf.weight, 1e-5, impl=impl), hf(x)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:  # the sum of squares in another order: float32 rounding only
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # rounded where transformers rounds: a value off by more than one step of dtype is a bug
        diff = (got.float() - want.float()).abs()
        step = want.float().abs() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny
        assert (diff <= 1.01 * step).all()
        assert (diff > 0).float().mean() <= 0.02


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 4, 2, 16), (29, 8, 8, 64), (7, 6, 2, 96)])
def test_rotary_is_transformers(impl, dtype, tokens, heads, kv_heads, head_dim):
    q = _randn(tokens, heads, head_dim, dtype=dtype, seed=3)
    k = _randn(tokens, kv_heads, head_dim, dtype=dtype, seed=4)
    angles = torch.arange(tokens, dtype=torch.float32)[:, None] * 0.37 ** torch.arange(head_dim // 2)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got = kernels.rotary(q, k, cos, sin, impl=impl)
    want = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # (T, H, D) with cos (T, 1, D)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape
        if dtype == torch.float32:  # a fused multiply-add may skip one rounding
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        else:  # each product rounded, then the sum: bit for bit
            assert torch.equal(g, w)


def test_mixed_dtypes_take_the_torch_path():
    """A float32 weight on bfloat16 activations promotes as in transformers (the C++ op wants one dtype)."""
    x, w = _randn(4, 32, dtype=torch.bfloat16, seed=5), _randn(32, dtype=torch.float32, seed=6)
    got = kernels.rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float32
    assert torch.equal(got, kernels.rms_norm(x, w, 1e-6, impl="torch"))


def test_native_store_kv_refuses_a_slot_outside_the_pool_and_writes_nothing():
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.ones(3, 2, 8), torch.ones(3, 2, 8)
    for bad in (64, -2):
        with pytest.raises(RuntimeError, match=f"slot {bad} of row 2 is outside the pool of 64 slots"):
            kernels.store_kv(k, v, k_cache, v_cache, torch.tensor([0, 5, bad], dtype=torch.int32), impl="native")
        assert not k_cache.any() and not v_cache.any()
