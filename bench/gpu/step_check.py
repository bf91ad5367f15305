"""The engine's step on one GPU: greedy tokens against transformers with and without CUDA graphs,
the tiny model's time per layer per decode step, and a Llama-2-7B-shaped decode step against its
memory-bandwidth bound. Run by ``bench/gpu/step.sh``; ``--cpu`` runs the same code end to end with
tiny sizes on the CPU (graphs off there), to check the script itself.

Bound: a decode step reads every weight once and each sequence's KV once, so it takes at least
``(weight bytes + KV bytes) / HBM bandwidth``; 4.8 TB/s is the H200's HBM3e bandwidth on NVIDIA's
H200 datasheet (hetserve/data/gpus.csv holds the same row).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hetserve.runtime.model.config import LLAMA2_7B, ArchConfig, llama_arch
from hetserve.runtime.model.loader import build_stage
from hetserve.runtime.model.make import make_model, random_stage
from hetserve.runtime.model.runner import StepRunner
from hetserve.runtime.workers.kv_pool import KVPool

HBM_BYTES_PER_S = 4.8e12  # H200, NVIDIA datasheet
BLOCK = 16
PROMPTS = [list(b"Hello, heterogeneous world!"), [5, 9, 2], list(range(40, 90))]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runner(stage, cfg, pool, device, dtype, graphs, max_batch=64):
    return StepRunner(stage, pool.layers(), BLOCK, cfg.hidden_size, dtype, device, max_batch=max_batch,
                      max_blocks=pool.k.shape[1] // BLOCK // max_batch, graphs=graphs)


def greedy(stage, runner, prompts, n, device):
    """Greedy tokens of every prompt, prefilled in one step, then decoded together through the runner."""
    per_seq = runner.max_blocks
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(len(prompts))]
    out = [[] for _ in prompts]
    starts, feeds = [0] * len(prompts), [list(p) for p in prompts]
    for _ in range(n):
        step = runner.prepare(starts, [len(f) for f in feeds], tables)
        ids = torch.tensor([t for f in feeds for t in f], device=device)
        h = runner.run(step, stage.embed(ids, step.meta.positions[:step.num_tokens]))
        tokens = stage.logits(h[step.meta.last_token[:len(prompts)]]).argmax(-1).tolist()
        for b, t in enumerate(tokens):
            out[b].append(t)
        starts = [s + len(f) for s, f in zip(starts, feeds)]
        feeds = [[t] for t in tokens]
    return out


def hf_greedy(model_dir, prompts, n, device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p], device=device), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def decode_ms(runner, batch, context, hidden, dtype, device, reps):
    """Mean ms of one decode step of ``batch`` sequences at ``context`` through the runner's layers."""
    per_seq = runner.max_blocks
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    step = runner.prepare([context - 1] * batch, [1] * batch, tables)
    h = torch.randn(batch, hidden, device=device, dtype=dtype) * 0.1
    for _ in range(3):
        runner.run(step, h)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        runner.run(step, h)
    _sync(device)
    return (time.perf_counter() - t0) / reps * 1e3


def tiny_checks(root: Path, device, n, reps):
    rows, timing = [], []
    for arch in ("llama", "opt"):
        d = make_model(root / arch, arch, layers=4, hidden=64, heads=4, kv_heads=2 if arch == "llama" else None, seed=1)
        cfg = ArchConfig.from_dir(d)
        stage = build_stage(cfg, d, (0, cfg.num_layers), has_embed=True, has_head=True, device=device)
        want = hf_greedy(str(d), PROMPTS, n, device)
        for graphs in (False, True):
            pool = KVPool(cfg.num_layers, 64 * 64 * BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
            runner = _runner(stage, cfg, pool, device, torch.float32, graphs)
            with torch.inference_mode():
                got = greedy(stage, runner, PROMPTS, n, device)
                # generate stops at the checkpoint's eos; the loop here does not
                equal = all(g[:len(w)] == w for g, w in zip(got, want))
                rows.append({"arch": arch, "graphs": runner.graphs, "asked_graphs": graphs, "equal": equal})
                for batch in (1, 8):
                    ms = decode_ms(runner, batch, 64, cfg.hidden_size, torch.float32, device, reps)
                    timing.append({"arch": arch, "graphs": runner.graphs, "batch": batch,
                                   "ms_per_layer": ms / cfg.num_layers})
    return rows, timing


def big_decode(device, dtype, shape, batches, contexts, reps):
    """A Llama of ``shape`` with random weights made on the device (no file), decode steps vs the bound."""
    cfg = llama_arch(**{**shape, "max_positions": max(contexts)})
    stage = random_stage(cfg, (0, cfg.num_layers), device, dtype, seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    max_b = max(batches)
    pool = KVPool(cfg.num_layers, max_b * max(contexts), cfg.num_kv_heads, cfg.head_dim, dtype, device)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * pool.k.element_size()
    out = []
    for graphs in (False, True) if device.type == "cuda" else (False,):
        runner = _runner(stage, cfg, pool, device, dtype, graphs, max_batch=max_b)
        with torch.inference_mode():
            for context in contexts:
                for batch in batches:
                    ms = decode_ms(runner, batch, context, cfg.hidden_size, dtype, device, reps)
                    bound = (weight_bytes + batch * context * kv_per_token) / HBM_BYTES_PER_S * 1e3
                    out.append({"graphs": runner.graphs, "batch": batch, "context": context, "ms": ms,
                                "bound_ms": bound, "ms_per_layer": ms / cfg.num_layers, "bound_fraction": bound / ms})
        del runner
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token, "rows": out}


TINY_BIG = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "layers": 2, "vocab": 300}


def table(result) -> str:
    lines = ["| check | graphs | result |", "|---|---|---|"]
    lines += [f"| greedy = transformers, {r['arch']} | {r['graphs']} | {'equal' if r['equal'] else 'DIFFERENT'} |"
              for r in result["greedy"]]
    lines += ["", "| tiny model | graphs | batch | ms / layer / decode step |", "|---|---|---:|---:|"]
    lines += [f"| {r['arch']} | {r['graphs']} | {r['batch']} | {r['ms_per_layer']:.3f} |" for r in result["tiny_timing"]]
    big = result["big"]
    lines += ["", (f"{result['big_shape']} ({big['weight_bytes'] / 1e9:.2f} GB weights, "
              f"{big['kv_bytes_per_token'] / 1e3:.0f} kB KV per token), bound = bytes / {HBM_BYTES_PER_S / 1e12} TB/s"),
              "", "| graphs | batch | context | ms / step | bound ms | bound / measured |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['graphs']} | {r['batch']} | {r['context']} | {r['ms']:.2f} | {r['bound_ms']:.2f} | "
              f"{r['bound_fraction']:.2f} |" for r in big["rows"]]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU with tiny sizes")
    ap.add_argument("--out", default="out/gpu")
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        greedy_rows, tiny_timing = tiny_checks(Path(tmp), device, n=8 if args.cpu else 24, reps=5 if args.cpu else 50)
    shape = TINY_BIG if args.cpu else LLAMA2_7B
    big = big_decode(device, torch.float32 if args.cpu else torch.bfloat16, shape,
                     batches=(1, 2) if args.cpu else (1, 8, 32, 64),
                     contexts=(32, 64) if args.cpu else (512, 2048), reps=3 if args.cpu else 20)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "greedy": greedy_rows, "tiny_timing": tiny_timing,
              "big_shape": "tiny Llama (dry run)" if args.cpu else "Llama-2-7B-shaped, bf16, random weights",
              "big": big, "wall_s": time.perf_counter() - t0}
    (out / "step.json").write_text(json.dumps(result, indent=2) + "\n")
    text = table(result)
    (out / "step.md").write_text(text + "\n")
    print(text)
    if not all(r["equal"] for r in greedy_rows):
        raise SystemExit("greedy tokens differ from transformers'")


if __name__ == "__main__":
    main()
