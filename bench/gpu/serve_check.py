"""A Llama-2-7B-shaped bf16 model served through ``hetserve serve`` on one GPU: start-up time, prefill
time against the GPU's bf16 dense peak, and tokens/s at 32 concurrent streaming requests against
transformers' batched ``generate``, for a colocated and a prefill -> decode deployment. Run by
``bench/gpu/serve.sh``; ``--cpu`` runs the same code end to end with a tiny shape on the CPU.

The model folder has no weights file (``make-model --random-weights``): each worker draws its layers
on its device at start-up. Both deployments run one after the other, each ``hetserve serve`` as a
subprocess on 127.0.0.1, talked to over HTTP with the standard library only.

Prefill bound: FLOPs / peak, FLOPs = 2 x (matmul parameters of the layers) x tokens + 2 x hidden x
vocab (the LM head on the last row) + 2 x layers x tokens^2 x heads x head_dim (QK^T and PV, causal:
half of the full 4 x T^2 x d). Peak: the ``fp16_tensor_tflops`` column of hetserve/data/gpus.csv
(H200: 989.4 TFLOP/s dense; bf16 runs at the fp16 rate on Hopper).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu.results import StageReport
from bench.gpu.serve_client import Server, burst, free_port, post

ROOT = Path(__file__).resolve().parents[2]
GPUS_CSV = ROOT / "hetserve" / "data" / "gpus.csv"
GPU_SIZES = {"shape": ["--like", "llama-2-7b"], "dtype": "bfloat16", "prompts": (512, 2048), "concurrent": 32,
             "prompt_len": (112, 144), "max_tokens": 128, "kv": 16384, "start_s": 90, "channel": "auto"}
CPU_SIZES = {"shape": ["--layers", "4", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "512"],
             "dtype": "float32", "prompts": (128, 512), "concurrent": 4, "prompt_len": (24, 40), "max_tokens": 16,
             "kv": 4096, "start_s": 90, "channel": "on"}  # gloo between the CPU workers: the channel's code path
TARGET_PREFILL, TARGET_RATIO = 0.5, 5.0  # fraction of peak at the longest prompt; tokens/s vs transformers
# The fixed words of the log lines by which a served worker says it took a slower path without failing
# a request (the runtime's own strings, hetserve/runtime): a server's output line holding one is
# recorded under errors, since the figures measured after it are not those of the intended path.
FALLBACK_LOG = (
    "CUDA graph capture failed",  # model/runner.py: a bucket's capture failed, decode eager from then on
    "CUDA graphs off",  # model/runner.py, workers/worker.py: graphs never on (no Triton kernels, a gloo TP group)
    "Triton kernels cannot launch",  # kernels/__init__.py: the torch kernels run instead
    "the socket carries its transfers",  # workers/device_channel.py: "channel to PEER broken (...)"
    "its sender resends it by socket",  # workers/device_channel.py: a transfer refused on receipt
    "handling failed for a message",  # workers/transport.py: a message the reader thread could not handle
    "KV piece not installed",  # workers/kv_receiver.py: a received piece refused, its request re-run from its prompt
)
STOPPING = []  # set by SIGTERM (the time limit): servers get a short drain, then SIGKILL


def peak_tflops(gpu: str) -> tuple[str, float]:
    """(row, dense fp16/bf16 TFLOP/s) from gpus.csv; a name that is no row (``cpu``) falls back to H200."""
    rows = {r["name"]: r for r in csv.DictReader(GPUS_CSV.open())}
    row = rows.get(gpu) or rows["H200"]
    return row["name"], float(row["fp16_tensor_tflops"])


def layer_params(cfg: dict) -> tuple[int, int]:
    """(matmul parameters of one layer: Q, K, V, O, gate, up, down; heads x head_dim)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    return 2 * h * heads * hd + 2 * h * kv * hd + 3 * h * cfg["intermediate_size"], heads * hd


def prefill_flops(cfg: dict, tokens: int) -> float:
    per_layer, d = layer_params(cfg)
    layers = cfg["num_hidden_layers"]
    return 2 * layers * per_layer * tokens + 2 * cfg["hidden_size"] * cfg["vocab_size"] + 2 * layers * tokens ** 2 * d


def plan_and_cluster(kind: str, tmp: Path, gpu_type: str, layers: int) -> tuple[Path, Path]:
    """Colocated: one replica on m0:0. Prefill -> decode: m0:0 -> m0:1 (both cuda:0 on a one-GPU machine)."""
    n = 1 if kind == "colocated" else 2
    cluster = tmp / f"cluster-{n}-devices.yaml"
    cluster.write_text(f"name: one-box-{n}\nmachines:\n  - {{name: m0, gpu: {gpu_type}, count: {n}, site: local}}\n"
                       "network:\n  intra_site: {bandwidth_gbps: 100, latency_ms: 0.01}\n")
    def one(rid, role, dev):
        return {"id": rid, "role": role, "stages": [{"devices": [dev], "layers": [0, layers]}]}

    replicas = ([one("c0", "colocated", "m0:0")] if n == 1 else [one("p0", "prefill", "m0:0"), one("d0", "decode", "m0:1")])
    routes = [] if n == 1 else [{"from": "p0", "to": "d0", "weight": 1.0}]
    plan = tmp / f"plan-{n}-devices.json"
    plan.write_text(json.dumps({"model": "model", "cluster": f"one-box-{n}", "replicas": replicas, "kv_routes": routes}))
    return plan, cluster


def prompts(sizes: dict) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(rng.randint(*sizes["prompt_len"]))] for _ in range(sizes["concurrent"])]


def deployment(report: StageReport, kind: str, model: Path, cfg: dict, tmp: Path, sizes: dict, gpu_type: str, peak: float):
    row = report.data["deployments"].setdefault(kind, {"prefill": [], "throughput": None})
    plan, cluster = plan_and_cluster(kind, tmp, gpu_type, cfg["num_hidden_layers"])
    server = None
    try:
        with report.stage(f"{kind}: start-up"):
            server = Server(kind, ["--plan", str(plan), "--cluster", str(cluster), "--model", str(model),
                                   "--model-name", "model", "--kv-capacity", str(sizes["kv"]), "--dtype", sizes["dtype"],
                                   "--device-channel", sizes["channel"], "--drain-timeout", "5",
                                   "--log-level", "warning"], free_port())
            row["device_channel"] = sizes["channel"]
            row["startup_s"] = server.wait_ok(sizes["start_s"])
            row.update(server.printed_startup())
            row["gpu_mem_used_gb"] = gpu_mem_used_gb()
        if "startup_s" not in row:
            return
        for tokens in sizes["prompts"]:
            with report.stage(f"{kind}: prefill {tokens} tokens"):
                body = {"model": "model", "prompt": [random.Random(tokens).randrange(256) for _ in range(tokens)],
                        "max_tokens": 1, "ignore_eos": True}
                post(server.port, body)  # warm-up
                times = []
                for _ in range(3):
                    t = time.perf_counter()
                    post(server.port, body)
                    times.append(time.perf_counter() - t)
                bound = prefill_flops(cfg, tokens) / (peak * 1e12)
                row["prefill"].append({"tokens": tokens, "ttft_ms": [x * 1e3 for x in times],
                                       "median_ms": statistics.median(times) * 1e3, "flops": prefill_flops(cfg, tokens),
                                       "bound_ms": bound * 1e3, "fraction_of_peak": bound / statistics.median(times)})
        with report.stage(f"{kind}: {sizes['concurrent']} concurrent streaming requests"):
            ps = prompts(sizes)
            burst(server.port, ps, sizes["max_tokens"])  # warm-up: the same burst (first launches, allocator pools)
            row["throughput"] = burst(server.port, ps, sizes["max_tokens"])
            got, want = row["throughput"]["tokens"], len(ps) * sizes["max_tokens"]
            if got != want:
                raise RuntimeError(f"{got} completion tokens, {want} asked (ignore_eos)")
    finally:
        if server is not None:
            with report.stage(f"{kind}: stop"):
                row["stop"] = server.stop(quick=bool(STOPPING))
            row["fallbacks"] = fallbacks(server.lines)
            for line in row["fallbacks"]:
                report.error(f"{kind}: a worker fell back", line)
            report.save()


def fallbacks(lines: list[str]) -> list[str]:
    """The lines of a server's output that say a worker fell back (``FALLBACK_LOG``), each once, in order."""
    return list(dict.fromkeys(line for line in lines if any(words in line for words in FALLBACK_LOG)))


def gpu_mem_used_gb() -> float | None:
    """Memory in use on the GPU, every process's (the servers' workers and this one's context)."""
    import torch

    return (lambda free, total: (total - free) / 1e9)(*torch.cuda.mem_get_info()) if torch.cuda.is_available() else None


def transformers_baseline(report: StageReport, model: Path, device: str, sizes: dict) -> None:
    """transformers' batched greedy ``generate`` of the same prompts, left-padded, on a same-shape
    LlamaForCausalLM built on the device in the serve dtype (random init there, no file)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    base = report.data["transformers"] = {}
    dtype = getattr(torch, sizes["dtype"])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with report.stage("transformers: build on the device"):
        t = time.perf_counter()
        config = LlamaConfig.from_pretrained(model)
        config.dtype = dtype
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                hf = LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(before)
        sync()
        base["build_s"] = time.perf_counter() - t
    if "build_s" not in base:
        return
    with report.stage("transformers: batched generate"):
        ps, n = prompts(sizes), sizes["max_tokens"]
        width = max(map(len, ps))
        ids = torch.tensor([[config.pad_token_id] * (width - len(p)) + p for p in ps], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
        kw = {"attention_mask": mask, "do_sample": False, "pad_token_id": config.pad_token_id,
              "eos_token_id": config.eos_token_id}
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)  # warm-up
            sync()
            t = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            sync()
            wall = time.perf_counter() - t
        tokens = (out.shape[1] - width) * len(ps)
        base.update(requests=len(ps), max_tokens=n, tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                    dtype=str(next(hf.parameters()).dtype).removeprefix("torch."))
    del hf
    gc.collect()  # the model's memory back before the servers' workers take theirs
    if device == "cuda":
        torch.cuda.empty_cache()


def _g(x: float) -> str:
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(d: dict) -> str:
    m = d.get("model", {})
    lines = [f"{d['shape']} on {d['device']} ({d['dtype']}); bound peak {d['peak_tflops']} TFLOP/s dense "
             f"(gpus.csv row {d['peak_row']}, column fp16_tensor_tflops){' — dry run on CPU' if d['cpu'] else ''}", ""]
    if m:
        lines += [f"Model folder (make-model --random-weights, {m['make_s']:.1f} s, measured): {m['files']} files, "
                  f"{m['bytes']:,} bytes, weights files: {m['weight_files'] or 'none'}; "
                  f"{m['params']:.3g} parameters (from config.json)", ""]
    deps = d["deployments"]
    lines += ["| deployment | launch → /health ok, s (measured) | serve's 'up in', s (printed by serve) | "
              "each worker's stage, s (printed by serve) | GPU memory in use, GB (measured) | stop, s (clean) |",
              "|---|---:|---:|---|---:|---|"]
    for k, r in deps.items():
        stages = ", ".join(f"{w} {s:.2f}" for w, s in r.get("worker_stage_s", {}).items()) or "not printed"
        stop = r.get("stop") or {}
        lines.append(f"| {k} | {_f(r.get('startup_s'))} | {_f(r.get('up_s'))} | {stages} | "
                     f"{_f(r.get('gpu_mem_used_gb'))} | {_f(stop.get('stop_s'))} ({stop.get('clean', '-')}) |")
    lines += ["", "| deployment | prompt tokens | TTFT, max_tokens 1, median of 3, ms (measured) | "
              "bound = FLOPs / peak, ms | TFLOP | bound / measured | ≥ 0.5 at the longest |",
              "|---|---:|---:|---:|---:|---:|---|"]
    longest = max(d["prompts"])
    for k, r in deps.items():
        for p in r["prefill"]:
            met = ("yes" if p["fraction_of_peak"] >= TARGET_PREFILL else "no") if p["tokens"] == longest else ""
            lines.append(f"| {k} | {p['tokens']} | {p['median_ms']:.2f} | {_g(p['bound_ms'])} | "
                         f"{_g(p['flops'] / 1e12)} | {p['fraction_of_peak']:.2g} | {met} |")
    base = d.get("transformers") or {}
    lines += ["", "| who | requests | max_tokens | completion tokens | wall, s | tokens/s (measured) | "
              "vs transformers (≥ 5×) |", "|---|---:|---:|---:|---:|---:|---|"]
    for k, r in deps.items():
        t = r.get("throughput")
        if t:
            ratio = t["tokens_per_s"] / base["tokens_per_s"] if base.get("tokens_per_s") else None
            lines.append(f"| hetserve {k} (streaming HTTP, ignore_eos; first chunk median {t['ttft_median_s']:.2f} s) | "
                         f"{t['requests']} | {t['max_tokens']} | {t['tokens']} | {t['wall_s']:.2f} | "
                         f"{t['tokens_per_s']:.0f} | " + ("-" if ratio is None else
                                                          f"{ratio:.2f}× ({'yes' if ratio >= TARGET_RATIO else 'no'})") + " |")
    if base.get("tokens_per_s"):
        lines.append(f"| transformers generate ({base['dtype']}, batch, left-padded, greedy; built on the device in "
                     f"{base['build_s']:.1f} s) | "
                     f"{base['requests']} | {base['max_tokens']} | {base['tokens']} | {base['wall_s']:.2f} | "
                     f"{base['tokens_per_s']:.0f} | 1× |")
    lines += ["", f"Whole run {d['wall_s']:.0f} s."]
    if d["errors"]:
        lines += ["", f"**{len(d['errors'])} error(s)** (tracebacks in serve.json):", ""]
        lines += [f"- {e['stage']}: {e['error'].strip().splitlines()[-1]}" for e in d["errors"]]
    return "\n".join(lines)


def on_sigterm(*_) -> None:
    """The time limit: recorded, then the stages unwind (their servers stopped, the report saved)."""
    STOPPING.append(True)
    if REPORT:
        REPORT[0].data["errors"].append({"stage": "time limit", "error": "SIGTERM: stopped by the time limit"})
    sys.exit(143)


REPORT: list[StageReport] = []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU with a tiny shape")
    ap.add_argument("--out", default="out/gpu")
    ap.add_argument("--gpu", default="H200", help="the gpus.csv row for the cluster file and the peak")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    sizes = CPU_SIZES if args.cpu else GPU_SIZES
    device = "cpu" if args.cpu else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    row, peak = peak_tflops(args.gpu)
    import torch

    report = StageReport(out, "serve", {"cpu": args.cpu, "device": torch.cuda.get_device_name() if not args.cpu else "cpu",
                          "shape": "tiny Llama (dry run)" if args.cpu else "Llama-2-7B-shaped, random weights",
                          "dtype": sizes["dtype"], "peak_row": row, "peak_tflops": peak, "prompts": sizes["prompts"],
                          "deployments": {}}, table)
    REPORT.append(report)
    report.save()
    with tempfile.TemporaryDirectory() as tmp:
        tmp, model = Path(tmp), Path(tmp) / "model"
        with report.stage("model folder: make-model --random-weights"):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "hetserve.cli.main", "make-model", *sizes["shape"], "--random-weights",
                            "--max-positions", "4096", "-o", str(model)], check=True, cwd=ROOT)
            files = list(model.iterdir())
            cfg = json.loads((model / "config.json").read_text())
            report.data["model"] = {"make_s": time.perf_counter() - t, "files": len(files),
                                    "bytes": sum(f.stat().st_size for f in files),
                                    "weight_files": [f.name for f in files if f.suffix in (".safetensors", ".bin", ".pt")],
                                    "params": cfg["num_hidden_layers"] * layer_params(cfg)[0]
                                    + 2 * cfg["hidden_size"] * cfg["vocab_size"], "config": cfg}
        if "model" in report.data:
            # transformers first: the reference figure, in this process, then its memory freed; a
            # deployment that hangs until the time limit then leaves it measured
            transformers_baseline(report, model, device, sizes)
            for kind in ("colocated", "prefill->decode"):
                deployment(report, kind, model, cfg, tmp, sizes, args.gpu if not args.cpu else "H200", peak)
    report.save()
    print(table(report.data))
    if report.data["errors"]:
        print("FAILED: " + "; ".join(e["stage"] for e in report.data["errors"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
