"""The engine's step on one GPU: a tiny Triton kernel launched first (its own process, a time
limit), greedy tokens against transformers with and without CUDA graphs, the tiny model's time per
layer per decode step, and a Llama-2-7B-shaped decode step against its memory-bandwidth bound. Run
by ``bench/gpu/step.sh``; ``--cpu`` runs the same code end to end with tiny sizes on the CPU (graphs
off there, Triton under its interpreter), to check the script itself.

Two times per decode step: ``forward_ms``, the runner's forward alone (``StepRunner.run``: the
layers, replayed as a CUDA graph where captured), and ``step_ms``, the whole step as the engine's
last stage runs it: the step's metadata to the device (``prepare``), the tokens' embedding, the
forward, the LM head on each sequence's last row and greedy sampling, its tokens copied to the host.

Bound: a decode step's forward reads every layer weight once and each sequence's KV once, so it
takes at least ``(layer weight bytes + KV bytes) / HBM bandwidth``; 4.8 TB/s is the H200's HBM3e
bandwidth on NVIDIA's H200 datasheet (hetserve/data/gpus.csv holds the same row).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu.results import StageReport
from hetserve.runtime.model.config import LLAMA2_7B, ArchConfig, llama_arch
from hetserve.runtime.model.loader import build_stage
from hetserve.runtime.model.make import make_model, random_stage
from hetserve.runtime.model.runner import StepRunner
from hetserve.runtime.sampling import sample
from hetserve.runtime.workers.kv_pool import KVPool

HBM_BYTES_PER_S = 4.8e12  # H200, NVIDIA datasheet
BLOCK = 16
PROMPTS = [list(b"Hello, heterogeneous world!"), [5, 9, 2], list(range(40, 90))]
# a cold Triton compiles its launcher with the C compiler (seconds); a launch that hangs must not
# take the whole run's time limit
TRITON_LAUNCH_S = 45
GREEDY = (0.0, 1.0, 0, 0)  # a sampling key: temperature 0, top_p 1, seed 0, token index 0


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


def _mean_ms(fn, device, reps) -> float:
    """Mean ms of ``fn()`` over ``reps`` calls after three warm-up calls, the device synced around."""
    for _ in range(3):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / reps * 1e3


def _decode_inputs(runner, batch):
    per_seq = runner.max_blocks
    return [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]


def forward_ms(runner, batch, context, hidden, dtype, device, reps):
    """Mean ms of the forward alone (``runner.run``) of one decode step of ``batch`` sequences at
    ``context``: its metadata prepared once, outside the clock."""
    step = runner.prepare([context - 1] * batch, [1] * batch, _decode_inputs(runner, batch))
    h = torch.randn(batch, hidden, device=device, dtype=dtype) * 0.1
    return _mean_ms(lambda: runner.run(step, h), device, reps)


def step_ms(stage, runner, batch, context, device, reps):
    """Mean ms of one whole decode step of ``batch`` sequences at ``context``, as the engine's last
    stage runs it (hetserve/runtime/workers/worker.py): prepare, embed the host's token ids, forward,
    LM head on each sequence's last row, greedy sampling with its tokens copied to the host."""
    tables, ids, keys = _decode_inputs(runner, batch), [t % 256 for t in range(batch)], [GREEDY] * batch

    def one():
        step = runner.prepare([context - 1] * batch, [1] * batch, tables)
        h = stage.embed(torch.tensor(ids, device=device), step.meta.positions[:step.num_tokens])
        h = runner.run(step, h)
        return sample(stage.logits(h[step.meta.last_token[:batch]]), keys)

    return _mean_ms(one, device, reps)


class Report(StageReport):
    """The run's results, rewritten to ``step.json`` and ``step.md`` after every stage (``results``),
    so that a stage that fails or a kill by the time limit leaves what the earlier stages measured."""

    def __init__(self, out: Path, device, big_shape: str):
        self.cuda = device.type == "cuda"
        super().__init__(out, "step", {"device": torch.cuda.get_device_name(device) if self.cuda else "cpu",
                                       "torch": torch.__version__, "greedy": [], "tiny_timing": [],
                                       "big_shape": big_shape, "big": {"rows": []}}, table)

    def graphs_row(self, stage: str, row: dict) -> None:
        """Keep ``row``; on CUDA, graphs asked but off after the run is a failed capture: an error."""
        if self.cuda and row["asked_graphs"] and not row["graphs"]:
            row["error"] = "CUDA graph capture failed: graphs off"
            if {"stage": stage, "error": row["error"]} not in self.data["errors"]:  # once per stage
                self.error(stage, row["error"])

    def failures(self) -> list[str]:
        """What failed: each stage with an error, and greedy tokens that differ from transformers'."""
        out = [e["stage"] for e in self.data["errors"]]
        out += [f"greedy tokens differ from transformers' ({r['arch']}, graphs {r['graphs']})"
                for r in self.data["greedy"] if not r["equal"]]
        return out


def triton_launch(report: Report, device) -> None:
    """bench/gpu/triton_launch.py in a process of its own, given ``TRITON_LAUNCH_S``: its line kept
    under ``triton_launch``; a failure or no answer in time is an error and the next stage runs."""
    with report.stage("triton: one tiny kernel compiled and launched"):
        env = {**os.environ, **({"TRITON_INTERPRET": "1"} if device.type == "cpu" else {})}
        t = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_launch.py")), device.type],
                               capture_output=True, text=True, timeout=TRITON_LAUNCH_S, env=env)
        except subprocess.TimeoutExpired:
            report.data["triton_launch"] = {"ok": False, "s": time.perf_counter() - t}
            raise RuntimeError(f"a tiny Triton kernel gave no answer within {TRITON_LAUNCH_S} s") from None
        out = (p.stdout + p.stderr).strip()
        print(out, flush=True)
        report.data["triton_launch"] = {"ok": p.returncode == 0, "s": time.perf_counter() - t,
                                        "output": out.splitlines()[-20:]}
        if p.returncode:
            last = out.splitlines()[-1] if out else "no output"
            raise RuntimeError(f"a tiny Triton kernel failed (exit {p.returncode}): {last}")


def tiny_checks(report: Report, root: Path, device, n, reps):
    """Per architecture and graphs setting: greedy tokens against transformers', then ms per layer."""
    for arch in ("llama", "opt"):
        with report.stage(f"tiny {arch}: checkpoint and transformers' greedy tokens") as st:
            d = make_model(root / arch, arch, layers=4, hidden=64, heads=4, kv_heads=2 if arch == "llama" else None,
                           seed=1)
            cfg = ArchConfig.from_dir(d)
            stage = build_stage(cfg, d, (0, cfg.num_layers), has_embed=True, has_head=True, device=device)
            want = hf_greedy(str(d), PROMPTS, n, device)
        if not st.ok:
            continue
        for graphs in (False, True):
            name = f"tiny {arch}, graphs {'on' if graphs else 'off'}"
            with report.stage(name):
                pool = KVPool(cfg.num_layers, 64 * 64 * BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
                runner = _runner(stage, cfg, pool, device, torch.float32, graphs)
                with torch.inference_mode():
                    got = greedy(stage, runner, PROMPTS, n, device)
                    # generate stops at the checkpoint's eos; the loop here does not
                    equal = all(g[:len(w)] == w for g, w in zip(got, want))
                    row = {"arch": arch, "graphs": runner.graphs, "asked_graphs": graphs, "equal": equal}
                    report.graphs_row(name, row)
                    report.data["greedy"].append(row)
                    print(f"greedy = transformers: {row}", flush=True)
                    report.save()
                    for batch in (1, 8):
                        ms = forward_ms(runner, batch, 64, cfg.hidden_size, torch.float32, device, reps)
                        t = {"arch": arch, "graphs": runner.graphs, "asked_graphs": graphs, "batch": batch,
                             "forward_ms_per_layer": ms / cfg.num_layers,
                             "step_ms": step_ms(stage, runner, batch, 64, device, reps)}
                        report.graphs_row(name, t)
                        report.data["tiny_timing"].append(t)
                        print(f"tiny timing: {t}", flush=True)
                        report.save()


def big_decode(report: Report, device, dtype, shape, batches, contexts, reps):
    """A Llama of ``shape`` with random weights made on the device (no file), its embedding and LM head
    too: decode steps, the forward against the bound and the whole step; each row is kept as measured,
    a failed row recorded and the next one run."""
    big = report.data["big"]
    with report.stage("big: random weights and KV pool") as st:
        cfg = llama_arch(**{**shape, "max_positions": max(contexts)})
        stage = random_stage(cfg, (0, cfg.num_layers), device, dtype, seed=0, has_embed=True, has_head=True)
        weight_bytes = sum(p.numel() * p.element_size() for p in stage.layers.parameters())  # what the forward reads
        max_b = max(batches)
        pool = KVPool(cfg.num_layers, max_b * max(contexts), cfg.num_kv_heads, cfg.head_dim, dtype, device)
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * pool.k.element_size()
        big.update(weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token)
    if not st.ok:
        return
    for graphs in (False, True) if device.type == "cuda" else (False,):
        name = f"big, graphs {'on' if graphs else 'off'}"
        runner = None
        with report.stage(name):
            runner = _runner(stage, cfg, pool, device, dtype, graphs, max_batch=max_b)
        for context in contexts if runner is not None else ():
            for batch in batches:
                with report.stage(f"{name}, batch {batch}, context {context}"), torch.inference_mode():
                    ms = forward_ms(runner, batch, context, cfg.hidden_size, dtype, device, reps)
                    bound = (weight_bytes + batch * context * kv_per_token) / HBM_BYTES_PER_S * 1e3
                    row = {"graphs": runner.graphs, "asked_graphs": graphs, "batch": batch, "context": context,
                           "forward_ms": ms, "bound_ms": bound, "forward_ms_per_layer": ms / cfg.num_layers,
                           "bound_fraction": bound / ms,
                           "step_ms": step_ms(stage, runner, batch, context, device, reps)}
                    report.graphs_row(name, row)
                    big["rows"].append(row)
                    print(f"big decode: {row}", flush=True)
        del runner


TINY_BIG = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "layers": 2, "vocab": 300}


def _graphs(r) -> str:
    """Graphs as run; where asked for and off, why (an error on CUDA)."""
    if r.get("asked_graphs") and not r["graphs"]:
        return f"False (asked: {r.get('error') or 'none on this device'})"
    return str(r["graphs"])


def table(result) -> str:
    lines = ["| check | graphs | result |", "|---|---|---|"]
    launch = result.get("triton_launch")
    if launch:
        said = (launch.get("output") or ["no answer"])[-1]
        lines.append(f"| a tiny Triton kernel launched ({launch['s']:.1f} s) | - | {'ok' if launch['ok'] else 'FAILED'}: "
                     f"{said.replace('|', '/')} |")
    lines += [f"| greedy = transformers, {r['arch']} | {_graphs(r)} | {'equal' if r['equal'] else 'DIFFERENT'} |"
              for r in result["greedy"]]
    lines += ["", "forward: the runner's forward alone (StepRunner.run); whole step: prepare + embedding + "
              "forward + LM head + greedy sampling, tokens to the host (as the engine's last stage runs it)",
              "", "| tiny model | graphs | batch | forward ms / layer / decode step | whole step, ms |",
              "|---|---|---:|---:|---:|"]
    lines += [f"| {r['arch']} | {_graphs(r)} | {r['batch']} | {r['forward_ms_per_layer']:.3f} | {r['step_ms']:.3f} |"
              for r in result["tiny_timing"]]
    big = result["big"]
    if "weight_bytes" in big:
        lines += ["", (f"{result['big_shape']} ({big['weight_bytes'] / 1e9:.2f} GB layer weights, "
                  f"{big['kv_bytes_per_token'] / 1e3:.0f} kB KV per token), forward bound = (layer weights + KV) / "
                  f"{HBM_BYTES_PER_S / 1e12} TB/s"),
                  "", "| graphs | batch | context | forward ms | bound ms | bound / forward | whole step ms |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {_graphs(r)} | {r['batch']} | {r['context']} | {r['forward_ms']:.2f} | {r['bound_ms']:.2f} | "
                  f"{r['bound_fraction']:.2f} | {r['step_ms']:.2f} |" for r in big["rows"]]
    if result["errors"]:
        lines += ["", f"**{len(result['errors'])} error(s)** (tracebacks in step.json):", ""]
        lines += [f"- {e['stage']}: {e['error'].strip().splitlines()[-1]}" for e in result["errors"]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU with tiny sizes")
    ap.add_argument("--out", default="out/gpu")
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, device, "tiny Llama (dry run)" if args.cpu else "Llama-2-7B-shaped, bf16, random weights")
    report.save()
    triton_launch(report, device)
    with tempfile.TemporaryDirectory() as tmp:
        tiny_checks(report, Path(tmp), device, n=8 if args.cpu else 24, reps=5 if args.cpu else 50)
    big_decode(report, device, torch.float32 if args.cpu else torch.bfloat16, TINY_BIG if args.cpu else LLAMA2_7B,
               batches=(1, 2) if args.cpu else (1, 8, 32, 64),
               contexts=(32, 64) if args.cpu else (512, 2048), reps=3 if args.cpu else 20)
    report.save()
    print(table(report.data))
    if report.failures():
        print("FAILED: " + "; ".join(report.failures()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
