"""Compile every Triton kernel the engine launches for a CUDA GPU (sm_90), on a machine without one.

Run as a script, in a process where triton was imported without ``TRITON_INTERPRET`` (the
interpreter accepts kernels that the GPU compiler refuses, e.g. a plain module-level float read
inside ``@triton.jit``). The public wrappers run on CPU tensors with their launches recorded instead
of run: each launch's arguments become the signature ``triton.compile`` gets, the keyword arguments
its constexprs, as a CUDA launch would give them (16-bit inputs not widened). Prints one line per
compiled kernel; exits 1 naming the kernel and the compiler's error on the first failure.
"""

import os
import sys

assert "TRITON_INTERPRET" not in os.environ, "run without TRITON_INTERPRET: the GPU compiler is what is checked"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hetserve.runtime.kernels import triton_kernels as tk  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
           torch.int64: "i64"}
launches: list[tuple] = []


class _Recorder:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **constexprs: launches.append((self.fn, args, constexprs))


def _signature(fn, args, constexprs) -> dict:
    names = triton.jit(fn).arg_names
    sig = {}
    for name, a in zip([n for n in names if n not in constexprs], args):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + _DTYPES[a.dtype]
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return {n: sig.get(n, "constexpr") for n in names}


def record_launches() -> None:
    tk._kernel = lambda fn, device: _Recorder(fn)
    tk._widen = lambda q: False
    g = torch.Generator().manual_seed(0)
    # the tiny models' float32 shapes, and a 7B-size bf16 one with grouped KV heads
    for dtype, (hq, hkv, dim), splits_asked in ((torch.float32, (4, 2, 16), (1, 4)),
                                                (torch.bfloat16, (32, 8, 128), (4,))):
        blocks, bs, B = 8, 16, 2
        k_cache = torch.zeros(blocks, bs, hkv, dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        kv = torch.randn(5, hkv, dim, generator=g).to(dtype)
        tk.store_kv(kv, kv, k_cache, v_cache, torch.arange(5, dtype=torch.int32))
        tables = torch.arange(B * 4, dtype=torch.int32).reshape(B, 4)
        lens = torch.tensor([20, 33], dtype=torch.int32)
        q = torch.randn(B, hq, dim, generator=g).to(dtype)
        for splits in splits_asked:
            tk.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, num_splits=splits)
        qp = torch.randn(7, hq, dim, generator=g).to(dtype)
        tk.paged_prefill_attention(qp, k_cache, v_cache, tables, torch.tensor([0, 3, 7], dtype=torch.int32),
                                   lens, 0.1)


def main() -> int:
    record_launches()
    seen = set()
    for fn, args, constexprs in launches:
        sig = _signature(fn, args, constexprs)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted(constexprs.items())))
        if key in seen:
            continue
        seen.add(key)
        label = f"{fn.__name__} {sorted(constexprs.items())}"
        try:
            triton.compile(ASTSource(triton.jit(fn), sig, constexprs=constexprs), target=TARGET)
        except Exception as exc:  # noqa: BLE001 - the compiler's error is the report
            print(f"FAILED {label}: {type(exc).__name__}: {str(exc)[-1500:]}")
            return 1
        print(f"compiled {label}")
    return 0 if seen else 1


if __name__ == "__main__":
    sys.exit(main())
