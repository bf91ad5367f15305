"""One layer's decode attention on this CPU: hetserve's kernels against vLLM's native kernel.

    .venv/bin/python -m bench.bench_vllm_attention                       # h512 + h1024, fp32 + bf16, 1 and 2 threads
    .venv/bin/python -m bench.bench_vllm_attention --threads 1 --rounds 3 --json out.json

The shapes are ``bench_vllm``'s models mid-run: 32 sequences decoding one token each, contexts of
76-182 tokens (its prompts of 12-118 tokens plus 64 generated), ``h512`` (8 query heads, 4 KV heads,
head size 64) and ``h1024`` (16 / 8 / 64). Every sequence's keys and values are drawn from one seed
(the same torch in both environments draws the same numbers), written into each engine's own
paged pool by its own store operator, blocks shuffled, and attended by:

- ``hetserve gathered``: ``kernels.paged_decode_attention(impl="torch")``: the contexts gathered
  from the pool into a padded grid, then ``scaled_dot_product_attention`` (with the workers'
  host-memory rule, ``workers.host_memory``): what a step runs when its sequences are new;
- ``hetserve kept``: what a CPU worker with a float32 pool runs in a steady decode (a half-precision
  one gathers), the contexts kept from the step before (``model.context_grids``): this step's keys
  and values written through, then the same attention over the kept grid;
- ``hetserve native``: ``kernels.paged_decode_attention(impl="native")``, the C++ kernel reading the
  pool in place (``kernels.native``; what a CPU worker runs where it builds);
- ``vllm``: ``cpu_attention_with_kv_cache`` of vLLM's CPU backend (its C++ kernel: AMX tiles for
  bfloat16, AVX-512 otherwise), from vLLM's own environment (``--vllm-python``, see ``bench_vllm``).

Each engine's output is checked against a float64 attention of the same keys and values (so both
do the whole work) before it is timed. Each (engine, threads) runs in its own process; rounds
interleave the engines. Printed: microseconds per layer call (median of the rounds' medians) and
hetserve / vLLM; the block sizes are each engine's (hetserve's default 16, vLLM's CPU minimum 32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.bench_vllm import ROOT, vllm_python
from bench.lib.timing import median_us

SHAPES = {"h512": (8, 4, 64), "h1024": (16, 8, 64)}  # query heads, KV heads, head size
DTYPES = ("float32", "bfloat16")
BATCH, CONTEXTS, SEED = 32, (76, 183), 0
TOLERANCE = {"float32": 2e-3, "bfloat16": 2e-2}  # the kernels' checks (bench.check_kernels)


def make_case(shape: str, dtype_name: str):
    """(q (B, Hq, D), per-sequence keys and values (ctx, Hkv, D), float64 reference output)."""
    import torch

    hq, hkv, d = SHAPES[shape]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(SEED)
    ctx = torch.randint(*CONTEXTS, (BATCH,), generator=gen).tolist()
    q = torch.randn(BATCH, hq, d, generator=gen).to(dtype)
    keys = [torch.randn(c, hkv, d, generator=gen).to(dtype) for c in ctx]
    values = [torch.randn(c, hkv, d, generator=gen).to(dtype) for c in ctx]
    ref = []
    for b in range(BATCH):
        qg = q[b].double().view(hkv, hq // hkv, d)
        scores = torch.einsum("hgd,khd->hgk", qg, keys[b].double()) * d ** -0.5
        ref.append(torch.einsum("hgk,khd->hgd", scores.softmax(-1), values[b].double()).reshape(hq, d))
    return q, keys, values, torch.stack(ref)


def paged(ctx: list[int], block_size: int):
    """(block tables (B, NB) int32 over shuffled blocks, slot of every token in sequence order, blocks)."""
    import torch

    per_seq = [-(-c // block_size) for c in ctx]
    nb = max(per_seq)
    num_blocks = len(ctx) * nb
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(SEED + 1))
    tables = order.view(len(ctx), nb).to(torch.int32)
    slots = torch.cat([tables[b].long()[torch.arange(c) // block_size] * block_size + torch.arange(c) % block_size
                       for b, c in enumerate(ctx)])
    return tables, slots, num_blocks


def hetserve_child(shape: str, dtype_name: str, reps: int) -> dict[str, float]:
    import torch

    from hetserve.runtime import kernels
    from hetserve.runtime.model.attention import host_meta
    from hetserve.runtime.model.context_grids import ContextGrids
    from hetserve.runtime.workers.host_memory import keep_freed_memory

    keep_freed_memory()  # as every worker does: the grid's pages stay with the process between calls
    q, keys, values, ref = make_case(shape, dtype_name)
    ctx = [k.shape[0] for k in keys]
    block = 16
    tables, slots, num_blocks = paged(ctx, block)
    hkv, d = keys[0].shape[1:]
    kc = torch.zeros(num_blocks, block, hkv, d, dtype=q.dtype)
    vc = torch.zeros_like(kc)
    kernels.store_kv(torch.cat(keys), torch.cat(values), kc, vc, slots.to(torch.int32), impl="torch")
    lens = torch.tensor(ctx, dtype=torch.int32)
    scale = d ** -0.5

    def attend():
        return kernels.paged_decode_attention(q, kc, vc, tables, lens, scale, impl="torch")

    err = (attend().double() - ref).abs().max().item()
    # the pool as a worker's layer sees it, (slots, Hkv, D), and the grids kept over it
    pool_k, pool_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    grids = ContextGrids([(pool_k, pool_v)], block, 1 << 30)  # this pool holds just these contexts
    hm = host_meta([c - 1 for c in ctx], [1] * BATCH, tables.tolist(), block)
    new = torch.stack([keys[b][-1] for b in range(BATCH)]), torch.stack([values[b][-1] for b in range(BATCH)])
    new_slots = torch.from_numpy(hm.slot_mapping).to(torch.int32)

    def kept():  # a steady decode: every row kept, this step's token written through
        grids.write_through(pool_k, *new, new_slots)
        return grids.attend(q, pool_k, pool_v, scale)

    for _ in range(2):  # the first plan gathers every row, the second keeps them
        grids.plan(hm.parts[0][1], hm.parts[0][2], BATCH)
        err = max(err, (kept().double() - ref).abs().max().item())
    assert len(grids.step.fill_rows) == 0
    row = {"gathered": median_us(attend, reps, warmup=5), "kept": median_us(kept, reps, warmup=5)}
    if kernels.native.available():
        def native():
            return kernels.paged_decode_attention(q, kc, vc, tables, lens, scale, impl="native")

        err = max(err, (native().double() - ref).abs().max().item())
        row["native"] = median_us(native, reps, warmup=5)
    return {**row, "error": err}


def vllm_child(shape: str, dtype_name: str, reps: int) -> dict[str, float]:
    import torch
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    q, keys, values, ref = make_case(shape, dtype_name)
    ctx = [k.shape[0] for k in keys]
    block = 32
    tables, slots, num_blocks = paged(ctx, block)
    hq, (hkv, d) = q.shape[1], keys[0].shape[1:]
    isa = _get_attn_isa(q.dtype, block, d)
    if isa == "amx":
        torch._C._cpu._init_amx()  # the process asks the kernel for AMX tile state, as vLLM's worker does
    # vLLM's layout: (blocks, KV heads, 2 * block, D), keys in the first half of each block's rows
    kv = torch.zeros(num_blocks, hkv, 2 * block, d, dtype=q.dtype)
    kc, vc = kv.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(torch.cat(keys), torch.cat(values), kc, vc, slots, isa)
    lens = torch.tensor(ctx, dtype=torch.int32)
    qsl = torch.arange(BATCH + 1, dtype=torch.int32)
    out = torch.empty_like(q)
    meta = ops.cpu_attn_get_scheduler_metadata(BATCH, hq, hkv, d, lens, q.dtype, qsl, True, -1, isa, False)

    def attend():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=lens,
            scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=tables, softcap=0.0,
            scheduler_metadata=meta, s_aux=None)
        return out

    err = (attend().double() - ref).abs().max().item()
    return {"vllm": median_us(attend, reps, warmup=5), "error": err, "isa": isa}


def child(system: str, threads: int, reps: int) -> None:
    import torch

    torch.set_num_threads(threads)
    run = hetserve_child if system == "hetserve" else vllm_child
    rows = {f"{shape}/{dtype}": run(shape, dtype, reps) for shape in SHAPES for dtype in DTYPES}
    print(json.dumps(rows))


def run_child(python: str, system: str, threads: int, reps: int) -> dict:
    out = subprocess.run([python, "-m", "bench.bench_vllm_attention", "--child", system, str(threads), str(reps)],
                         cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"bench_vllm_attention: the {system} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts (default 1,2)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--reps", type=int, default=200, help="timed calls per case in a round (default 200)")
    ap.add_argument("--vllm-python", help="vLLM's interpreter (default .vllm-venv/bin/python)")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        system, threads, reps = args.child
        child(system, int(threads), int(reps))
        return
    pythons = {"hetserve": sys.executable, "vllm": vllm_python(args.vllm_python)}
    runs: dict[int, dict[str, list[dict]]] = {}
    for threads in map(int, args.threads.split(",")):
        runs[threads] = {s: [] for s in pythons}
        for _ in range(args.rounds):
            for system, python in pythons.items():
                runs[threads][system].append(run_child(python, system, threads, args.reps))
    print("\nOne layer's decode attention, 32 sequences of 76-182 tokens: microseconds per call "
          f"(median of {args.rounds} rounds; measured)\n")
    print("| model | dtype | threads | hetserve gathered | hetserve kept | hetserve native | vLLM (kernel) "
          "| gathered / vLLM | kept / vLLM | native / vLLM | max error h / v |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    failed = False
    for threads, by_system in runs.items():
        for case in by_system["hetserve"][0]:
            h = statistics.median(r[case]["gathered"] for r in by_system["hetserve"])
            s = statistics.median(r[case]["kept"] for r in by_system["hetserve"])
            n = statistics.median(r[case].get("native", float("nan")) for r in by_system["hetserve"])
            v = statistics.median(r[case]["vllm"] for r in by_system["vllm"])
            eh, ev = (max(r[case]["error"] for r in by_system[k]) for k in ("hetserve", "vllm"))
            failed |= max(eh, ev) > TOLERANCE[case.split("/")[1]]
            model, dtype = case.split("/")
            isa = by_system["vllm"][0][case]["isa"]
            print(f"| {model} | {dtype} | {threads} | {h:.0f} | {s:.0f} | {n:.0f} | {v:.0f} ({isa}) | {h / v:.2f}x | "
                  f"{s / v:.2f}x | {n / v:.2f}x | {eh:.1e} / {ev:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps({str(t): r for t, r in runs.items()}, indent=1))
    if failed:
        sys.exit("bench_vllm_attention: an output is off its float64 reference by more than the kernels' tolerance")


if __name__ == "__main__":
    main()
