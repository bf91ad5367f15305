"""One CPU decode step of a whole stage, in a fresh process per configuration: what the workers'
host-memory rule and OpenMP spin rule buy.

    .venv/bin/python -m bench.bench_step                    # h512, float32 + bfloat16, 3 rounds (~2 min)
    .venv/bin/python -m bench.bench_step --model h1024 --dtypes float32 --rounds 2 --json out.json

The stage is every layer of ``bench_vllm``'s random-weight Llama (``--model``: demo, h512, h1024),
built as a worker builds it (``load_stage``, a zeroed KV pool, the ``StepRunner``), and steps 32
sequences of 76-182 tokens (the vLLM benchmark's prompts plus 64 tokens) one token each: embed,
layers, LM head, argmax. Configurations, each its own process (the rules act when a process starts):

- ``threads``: 1 or 2 torch threads;
- ``memory``: ``default`` (glibc's thresholds) or ``kept`` (``workers.host_memory.keep_freed_memory``,
  what every worker does);
- ``spin`` (2 threads): ``default`` (libgomp's), ``bounded`` (``GOMP_SPINCOUNT=10000``, what a
  worker of several threads gets) or ``passive`` (``OMP_WAIT_POLICY=PASSIVE``);
- ``busy``: another process spins on one core meanwhile (what a front end and clients do to a
  worker on a 2-core host).

``--layouts``: instead, the linear weights' layouts (``model.cpu_weights``: float32 weights on a
CPU column-major, bfloat16 packed for oneDNN, float16 row-major) against each other, per dtype,
at decode batches of 1, 8 and 32 (2 threads, kept host memory, default spin).

Printed: the median step (ms) of each configuration over ``--rounds`` interleaved rounds (each the
median of 30 steps after 5 warm-ups), its min-max, and its ratio to the first row of its group.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.bench_vllm import MODELS, make_models
from bench.lib.workdir import workdir

SPIN_ENV = {"default": {}, "bounded": {"GOMP_SPINCOUNT": "10000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
# (threads, memory, spin, busy): groups of rows, each row compared with its group's first
GROUPS = [
    [(1, "default", "default", False), (1, "kept", "default", False)],
    [(2, "default", "bounded", False), (2, "kept", "bounded", False)],
    [(2, "kept", "default", False), (2, "kept", "bounded", False), (2, "kept", "passive", False)],
    [(2, "kept", "default", True), (2, "kept", "bounded", True), (2, "kept", "passive", True)],
]
CONFIGS = list(dict.fromkeys(c for g in GROUPS for c in g))  # each measured once


def child(model_dir: str, dtype_name: str, threads: int, memory: str, layout: str = "loaded",
          seqs: int = 32) -> float:
    """Median seconds of one decode step (runs in the configuration's own process); ``layout``:
    the linear weights as loaded, ``row`` / ``column`` major, or ``packed`` for oneDNN (bfloat16)."""
    import random

    import torch

    from hetserve.runtime.model.config import ArchConfig
    from hetserve.runtime.model.cpu_weights import linear_weight, pack_bfloat16_linears
    from hetserve.runtime.model.loader import load_stage
    from hetserve.runtime.model.runner import StepRunner
    from hetserve.runtime.workers.host_memory import keep_freed_memory
    from hetserve.runtime.workers.kv_pool import KVPool

    if memory == "kept":
        keep_freed_memory()
    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    cfg = ArchConfig.from_dir(model_dir)
    stage, _ = load_stage(cfg, model_dir, (0, cfg.num_layers), has_embed=True, has_head=True, dtype=dtype)
    if layout != "loaded":
        for mod in stage.modules():
            if isinstance(mod, torch.nn.Linear):
                w = linear_weight(mod).detach()
                if mod.weight is None:  # packed as loaded: back to a plain linear first
                    del mod.forward, mod.packed_weight
                w = w.t().contiguous().t() if layout == "column" else w.contiguous()
                mod.weight = torch.nn.Parameter(w, requires_grad=False)
        if layout == "packed":
            pack_bfloat16_linears(stage)
    block = 16
    pool = KVPool(cfg.num_layers, 2048 * block, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
    runner = StepRunner(stage, pool.layers(), block, cfg.hidden_size, dtype, torch.device("cpu"), max_blocks=64)
    rng = random.Random(0)
    starts = [rng.randrange(12, 119) + 64 for _ in range(seqs)]
    tables = [list(range(b * 32, (b + 1) * 32)) for b in range(seqs)]
    times = []
    with torch.inference_mode():
        for i in range(35):
            t = time.perf_counter()
            step = runner.prepare(starts, [1] * seqs, tables)
            h = stage.embed(torch.randint(0, cfg.vocab_size, (seqs,)), step.meta.positions[:seqs])
            stage.logits(runner.run(step, h)).argmax(-1)
            if i >= 5:
                times.append(time.perf_counter() - t)
            starts = [s + 1 for s in starts]
    return statistics.median(times)


def run_config(model_dir: Path, dtype: str, config: tuple, layout: str = "loaded", seqs: int = 32) -> float:
    threads, memory, spin, busy = config
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(SPIN_ENV[spin])
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        out = subprocess.run([sys.executable, "-m", "bench.bench_step", "--child", str(model_dir), dtype,
                              str(threads), memory, layout, str(seqs)], env=env, capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent.parent)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="h512", choices=sorted(MODELS))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", help="where the checkpoint is made (default: a temporary folder)")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--layouts", action="store_true", help="compare the linear weights' layouts instead")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        model_dir, dtype, threads, memory, layout, seqs = args.child
        print(child(model_dir, dtype, int(threads), memory, layout, int(seqs)))
        return
    work = Path(args.workdir) if args.workdir else workdir("hetserve-bench-step-")
    model_dir = make_models([args.model], work)[args.model]
    if args.layouts:
        compare_layouts(model_dir, args)
        return
    results: dict[str, dict[int, list[float]]] = {}
    for dtype in args.dtypes.split(","):
        results[dtype] = {i: [] for i in range(len(CONFIGS))}
        for _ in range(args.rounds):
            for i, config in enumerate(CONFIGS):
                results[dtype][i].append(run_config(model_dir, dtype, config))
        print(f"\n{args.model}, {dtype}: one decode step of 32 sequences (median of 30), {args.rounds} rounds\n")
        print("| threads | host memory | OpenMP spin | other core busy | step ms | min-max | vs group's first |")
        print("|---:|---|---|---|---:|---|---:|")
        ms = {c: [t * 1e3 for t in results[dtype][i]] for i, c in enumerate(CONFIGS)}
        for group in GROUPS:
            for config in group:
                threads, memory, spin, busy = config
                row, ratio = ms[config], statistics.median(ms[config]) / statistics.median(ms[group[0]])
                print(f"| {threads} | {memory} | {spin if threads > 1 else '-'} | {'yes' if busy else 'no'} | "
                      f"{statistics.median(row):.1f} | {min(row):.1f}-{max(row):.1f} | {ratio:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "configs": CONFIGS, "seconds": results}, indent=1))


def compare_layouts(model_dir: Path, args: argparse.Namespace) -> None:
    """Row-major, column-major and (bfloat16) oneDNN-packed linear weights, per dtype and decode
    batch, interleaved rounds."""
    config = (2, "kept", "default", False)
    results = {}
    for dtype in args.dtypes.split(","):
        layouts = ("row", "column", "packed") if dtype == "bfloat16" else ("row", "column")
        for seqs in (1, 8, 32):
            runs = {layout: [] for layout in layouts}
            for _ in range(args.rounds):
                for layout in runs:
                    runs[layout].append(run_config(model_dir, dtype, config, layout, seqs) * 1e3)
            results[f"{dtype} {seqs}"] = runs
    loaded = {"float32": "column", "bfloat16": "packed", "float16": "row"}
    print(f"\n{args.model}: one decode step (median of 30, ms), {args.rounds} interleaved rounds, 2 threads\n")
    print("| dtype | batch | row-major | column-major | packed | column / row | packed / row | loaded as |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for key, runs in results.items():
        dtype, seqs = key.split()
        med = {layout: statistics.median(v) for layout, v in runs.items()}
        packed = med.get("packed")
        packed_ms, packed_ratio = ("-", "-") if packed is None else (f"{packed:.1f}", f"{packed / med['row']:.2f}x")
        print(f"| {dtype} | {seqs} | {med['row']:.1f} | {med['column']:.1f} | {packed_ms} | "
              f"{med['column'] / med['row']:.2f}x | {packed_ratio} | {loaded.get(dtype, '?')} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "layouts": results}, indent=1))

if __name__ == "__main__":
    main()
