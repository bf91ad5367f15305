"""The paged-attention kernels against their per-sequence references on many random shapes, and
the torch path's decode time against an earlier revision's on this CPU.

    .venv/bin/python -m bench.check_kernels [--shapes 200] [--impls triton native torch] [--seed 0]
                                            [--timing-only | --no-timing] [--base REV] [--json out.json]

Part 1: for each kernel (store_kv, decode, prefill) and implementation, ``--shapes`` random shapes
(half float32, half bfloat16; GQA ratios 1/4/8, 1-2 KV heads, head sizes 16-128, block sizes 8-32,
batches 1-64, contexts ending anywhere in a block, empty rows, decode split 1-4 ways) through
``hetserve.runtime.kernels.cases`` (NaN in every slot no sequence owns) against
``hetserve.runtime.kernels.reference``. Triton runs under its interpreter on CPU. Printed: one row
per (kernel, impl, dtype): shapes, their ranges, max abs error, tolerance, pass. Exit status 1 if
a row fails.

Part 2 (with ``--base REV``, a git revision): one decode step of one layer (write the new K/V,
attend) with one torch thread, float32 and bfloat16: ``kernels/torch_impl.py`` as it was at ``REV``
against the working tree's, on the same pool. Printed: microseconds (fastest of ``--reps``, the two
taking turns) and new / base (below 1: the working tree is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: see kernels.triton_kernels

import torch

from hetserve.runtime import kernels
from hetserve.runtime.kernels import cases, reference

KERNELS = ("store_kv", "decode", "prefill")


@dataclass
class Row:
    kernel: str
    impl: str
    dtype: str
    shapes: int
    ranges: str
    max_abs_error: float
    tolerance: float
    passed: bool


def random_shape(rng: random.Random, dtype: str, prefill: bool) -> cases.Shape:
    """Mostly small batches (the interpreter runs one program at a time), now and then up to 64."""
    batch = rng.choice([rng.randint(1, 4), rng.randint(1, 4), rng.randint(5, 16), rng.randint(17, 64)])
    longest = 160 if batch <= 4 else (48 if batch <= 16 else 16)
    context_lens = tuple(rng.choice([0, rng.randint(1, longest)]) if rng.random() < 0.1 else rng.randint(1, longest)
                         for _ in range(batch))
    q_lens = tuple(rng.randint(min(1, n), min(n, 32)) for n in context_lens) if prefill else None
    return cases.Shape(context_lens=context_lens, num_kv_heads=rng.choice([1, 2]), group=rng.choice([1, 4, 8]),
                       head_dim=rng.choice([16, 24, 64, 80, 128]), block_size=rng.choice([8, 16, 32]),
                       dtype=dtype, q_lens=q_lens)


def error_of(kernel: str, impl: str, shape: cases.Shape, seed: int, rng: random.Random) -> float:
    """Max abs error of one run against the reference (store_kv: 0 when bit-exact, inf otherwise)."""
    if kernel == "store_kv":
        k, v, k_cache, v_cache, slots = cases.store_inputs(shape, seed)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        kernels.store_kv(k, v, k_cache, v_cache, slots, impl=impl)
        reference.store_kv(k, v, k_ref, v_ref, slots)
        return 0.0 if torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref) else float("inf")
    case = cases.make_case(shape, seed)
    if kernel == "decode":
        args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
        ref = reference.paged_decode_attention(*args)
        if impl == "triton":
            from hetserve.runtime.kernels import triton_kernels
            out = triton_kernels.paged_decode_attention(*args, num_splits=rng.choice([None, 1, 2, 3, 4]))
        else:
            out = kernels.paged_decode_attention(*args, impl=impl)
    else:
        args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc, case.context_lens,
                case.scale)
        ref = reference.paged_prefill_attention(*args)
        out = kernels.paged_prefill_attention(*args, impl=impl)
    if out.dtype != cases.DTYPES[shape.dtype] or not torch.isfinite(out).all():
        return float("inf")
    return (out.double() - ref).abs().max().item() if out.numel() else 0.0


def ranges(shapes: list[cases.Shape]) -> str:
    def span(values):
        return f"{min(values)}-{max(values)}"
    return (f"B {span([len(s.context_lens) for s in shapes])}, ctx {span([max(s.context_lens) for s in shapes])}, "
            f"Hq/Hkv {span([s.group for s in shapes])}, D {span([s.head_dim for s in shapes])}, "
            f"bs {span([s.block_size for s in shapes])}")


def check(kernel: str, impl: str, num_shapes: int, seed: int) -> list[Row]:
    rows = []
    for dtype in ("fp32", "bf16"):
        rng = random.Random(f"{kernel}/{dtype}/{seed}")
        shapes = [random_shape(rng, dtype, prefill=kernel == "prefill") for _ in range(num_shapes // 2)]
        worst = max(error_of(kernel, impl, s, seed + i, rng) for i, s in enumerate(shapes))
        tol = 0.0 if kernel == "store_kv" else cases.TOLERANCE[dtype]
        rows.append(Row(kernel, impl, dtype, len(shapes), ranges(shapes), worst, tol, worst <= tol))
    return rows


def torch_impl_at(rev: str) -> types.ModuleType:
    """``hetserve/runtime/kernels/torch_impl.py`` as it was at git revision ``rev``, as a module."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:hetserve/runtime/kernels/torch_impl.py"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    module = types.ModuleType(f"torch_impl_at_{rev}")
    exec(compile(src, f"{rev}:torch_impl.py", "exec"), module.__dict__)
    return module


def decode_steps(base: types.ModuleType, batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, block_size: int = 16):
    """One layer's decode step on CPU (write each sequence's new K/V, attend over its context), as
    (base revision's, working tree's) callables over the same pool."""
    from hetserve.runtime.kernels import torch_impl

    gen = torch.Generator().manual_seed(0)
    contexts = [max(1, context - 37 * i % context) for i in range(batch)]  # distinct lengths, <= context
    blocks_per_seq = -(-(context + 1) // block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    k, v = torch.randn(2, batch, kv_heads, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = torch.randn(2, batch * blocks_per_seq, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    table = torch.tensor(tables, dtype=torch.int32)
    lens = torch.tensor(contexts, dtype=torch.int32) + 1  # the new token included
    slots = torch.tensor([t[c // block_size] * block_size + c % block_size for t, c in zip(tables, contexts)])

    def step(impl):
        return lambda: (impl.store_kv(k, v, k_cache, v_cache, slots),
                        impl.paged_decode_attention(q, k_cache, v_cache, table, lens, scale))
    return step(base), step(torch_impl)


def best_us(steps, reps: int) -> list[float]:
    """Fastest of ``reps`` runs of each step in microseconds, the steps taking turns so a busy
    machine slows them alike; the fastest run is the one least disturbed by other work."""
    best = [float("inf")] * len(steps)
    with torch.inference_mode():
        for _ in range(2):  # warm-up
            for step in steps:
                step()
        for _ in range(reps):
            for i, step in enumerate(steps):
                t = time.perf_counter()
                step()
                best[i] = min(best[i], time.perf_counter() - t)
    return [b * 1e6 for b in best]


TIMING_CASES = [  # (batch, context, Hq, Hkv, D): the benchmarks' tiny Llama, then a 7B-like layer
    (4, 256, 4, 2, 64), (32, 130, 8, 4, 64), (64, 512, 4, 2, 64), (16, 1024, 32, 8, 128), (64, 512, 32, 8, 128)]


def timing(base_rev: str, reps: int) -> list[dict]:
    base = torch_impl_at(base_rev)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch, context, heads, kv_heads, head_dim in TIMING_CASES:
            old, new = best_us(decode_steps(base, batch, context, heads, kv_heads, head_dim, dtype), reps)
            out.append({"dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context,
                        "heads": f"{heads}/{kv_heads}", "head_dim": head_dim, "base_us": old, "new_us": new,
                        "ratio": new / old})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=int, default=200, help="random shapes per kernel and impl (half per dtype)")
    ap.add_argument("--impls", nargs="+", choices=kernels.IMPLS,
                    help="default: triton, torch, and native where the C++ kernels build")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=30, help="timed decode steps per case (fastest)")
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--timing-only", action="store_true")
    part.add_argument("--no-timing", action="store_true")
    ap.add_argument("--base", help="time the torch path against its version at this git revision")
    ap.add_argument("--json", help="write the rows and timings here")
    args = ap.parse_args(argv)
    args.impls = args.impls or ["triton", *(["native"] if kernels.native.available() else []), "torch"]
    if args.timing_only and not args.base:
        ap.error("--timing-only times the torch path against --base REV: give a revision")
    torch.set_num_threads(1)  # tiny tensors; and the engine's workers run one thread by default
    rows, times = [], []
    if not args.timing_only:
        print(f"{'kernel':9} {'impl':6} {'dtype':5} {'shapes':>6}  {'max abs err':>11} {'tol':>7}  pass  ranges")
        for kernel in KERNELS:
            for impl in args.impls:
                for row in check(kernel, impl, args.shapes, args.seed):
                    rows.append(row)
                    print(f"{row.kernel:9} {row.impl:6} {row.dtype:5} {row.shapes:6d}  {row.max_abs_error:11.2e} "
                          f"{row.tolerance:7.0e}  {'yes' if row.passed else 'NO':4}  {row.ranges}", flush=True)
    if args.base and not args.no_timing:
        print(f"\ndecode step, one layer, CPU, 1 thread: kernels/torch_impl.py at {args.base} (base) vs now")
        print(f"{'dtype':8} {'B':>3} {'ctx':>5} {'Hq/Hkv':>6} {'D':>4} {'base us':>9} {'new us':>9} {'new/base':>8}")
        for t in timing(args.base, args.reps):
            times.append(t)
            print(f"{t['dtype']:8} {t['batch']:3d} {t['context']:5d} {t['heads']:>6} {t['head_dim']:4d} "
                  f"{t['base_us']:9.0f} {t['new_us']:9.0f} {t['ratio']:8.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "decode_timing": times}, f, indent=1)
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
