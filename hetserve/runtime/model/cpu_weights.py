"""How a stage's linear weights are laid out on a CPU, chosen once per dtype after loading.

- float32: column-major (``column_major_weights``): the same values, in the layout this CPU's
  GEMM multiplies most decode batches by faster.
- bfloat16: packed once into oneDNN's blocked layout (``pack_bfloat16_linears``), the layout its
  AMX / AVX512-BF16 kernels read; a plain bfloat16 ``F.linear`` re-lays the weight out on every
  call. The packed multiply gives the same numbers as ``F.linear`` (the same oneDNN kernels).
- float16 stays row-major: without AMX-FP16 the packed multiply is no faster here.

``python -m bench.bench_step --layouts`` measures each layout against the others.
"""

from __future__ import annotations

import functools
import logging
import types

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def arrange_cpu_weights(model: nn.Module) -> None:
    """Every linear of ``model`` (on a CPU) in its dtype's layout (module docstring)."""
    column_major_weights(model)
    pack_bfloat16_linears(model)


def column_major_weights(model: nn.Module) -> None:
    """Store every float32 ``nn.Linear`` weight (out, in) as the transpose of an (in, out)
    contiguous tensor. A decode step of 32 sequences of the 8-layer h512 / h1024 models takes
    6-7 % less; at 8 sequences h1024's 13 % less but h512's 16 % more; one sequence within 4 %."""
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if isinstance(mod, nn.Linear) and w.dtype == torch.float32 and w.is_contiguous() and w.dim() == 2:
            mod.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)


def pack_bfloat16_linears(model: nn.Module) -> int:
    """Give every bfloat16 CPU ``nn.Linear`` of ``model`` a oneDNN-packed weight and a forward that
    multiplies by it; the module's ``weight`` is dropped (the packed copy replaces it, not doubles
    it). Hooks on the module (tensor parallelism's all-reduce) still run. Returns how many linears
    were packed: none where this torch build or CPU has no oneDNN bfloat16 GEMM."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight is not None
               and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"]
    if not linears or not bfloat16_packing_works():
        return 0
    for mod in linears:
        mod.packed_weight = torch.ops.mkldnn._reorder_linear_weight(mod.weight.detach(), None)
        mod.weight = None
        mod.forward = types.MethodType(_packed_forward, mod)
    return len(linears)


def linear_weight(mod: nn.Linear) -> torch.Tensor:
    """``mod``'s weight as a plain (out, in) tensor, whichever layout it is kept in."""
    return mod.weight if mod.weight is not None else mod.packed_weight.to_dense()


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


@functools.cache
def bfloat16_packing_works() -> bool:
    """Whether oneDNN's packed bfloat16 linear exists here and agrees with ``F.linear`` on a probe."""
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=gen, dtype=torch.bfloat16) for s in ((5, 64), (48, 64), (48,)))
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        ok = got.shape == (5, 48) and torch.allclose(got, F.linear(x, w, b), rtol=2e-2, atol=2e-2)
    except (RuntimeError, AttributeError) as exc:
        log.warning("bfloat16 linears stay unpacked: oneDNN's packed linear failed here (%s)", exc)
        return False
    if not ok:
        log.warning("bfloat16 linears stay unpacked: oneDNN's packed linear disagrees with F.linear here")
    return ok
