"""A step's attention when it mixes prompts and decodes: one padded grid vs a grid per kind.

    .venv/bin/python -m bench.bench_attention [--reps 200] [--context 140] [--json out.json]

``runtime.model.attention.paged_attention`` on one layer of the benchmarks' tiny Llama (4 query heads,
2 KV heads, head size 64, one torch thread), for a prompt of 32 / 128 / 512 tokens beside 0 / 1 / 4 /
16 decoding sequences of ``--context`` tokens each. *One grid* (``build_attn_meta(grouped=False)``) pads every decode to the prompt's query rows; *grouped* (the
runtime now) attends the decodes in their own grid. Printed: microseconds per layer (median over
``--reps`` after a warm-up), and one grid / grouped, measured in the same run. The cost model prices a
mixed step as its prompt's and decodes' work without padding (``CostModel.mixed_step_time``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def per_layer_us(prompt: int, decodes: int, context: int, grouped: bool, reps: int) -> float:
    import torch

    from hetserve.runtime.model.attention import build_attn_meta, paged_attention

    heads, kv_heads, head_dim, block = 4, 2, 64, 16
    blocks = -(-max(prompt, context + 1) // block)
    starts, q_lens = [0] * (prompt > 0) + [context] * decodes, [prompt] * (prompt > 0) + [1] * decodes
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(q_lens))]
    meta = build_attn_meta(starts, q_lens, tables, block, grouped=grouped)
    T, slots = sum(q_lens), len(q_lens) * blocks * block
    q, k, v = torch.randn(T, heads, head_dim), torch.randn(T, kv_heads, head_dim), torch.randn(T, kv_heads, head_dim)
    kc, vc = torch.randn(slots, kv_heads, head_dim), torch.randn(slots, kv_heads, head_dim)
    times = []
    with torch.inference_mode():
        for i in range(reps + 10):
            t = time.perf_counter()
            paged_attention(q, k, v, kc, vc, meta, head_dim ** -0.5)
            if i >= 10:
                times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def main() -> int:
    import torch
    from bench.lib.console import wide_console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--context", type=int, default=140, help="each decoding sequence's context tokens")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    table = Table(title=f"attention per layer, µs (measured, median of {args.reps}; decodes of {args.context} "
                        "tokens of context)")
    for col in ("prompt tokens", "decodes", "one grid", "grouped", "one grid / grouped"):
        table.add_column(col, justify="right")
    rows = []
    for prompt in (32, 128, 512):
        for decodes in (0, 1, 4, 16):
            one = per_layer_us(prompt, decodes, args.context, False, args.reps)
            grouped = per_layer_us(prompt, decodes, args.context, True, args.reps)
            rows.append({"prompt": prompt, "decodes": decodes, "one_grid_us": one, "grouped_us": grouped})
            table.add_row(str(prompt), str(decodes), f"{one:,.0f}", f"{grouped:,.0f}", f"{one / grouped:.2f}")
    wide_console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
