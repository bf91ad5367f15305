"""lm-evaluation-harness's ``local-completions`` model scoring a log-likelihood task against ``hetserve serve``.

    .venv/bin/python -m bench.bench_lmeval --client-bin .bench-venv/bin [--replicas 2]

Starts ``hetserve serve`` (a subprocess, as a user would) with colocated replicas of a random-weight
Llama (4 layers, hidden 64, float32, its byte-level tokenizer) on ``demo-cpu``, then runs
``lm_eval --model local-completions`` on ``bench/lmeval/hetserve_tiny_mc.yaml`` (8 multiple-choice
questions from ``bench/lmeval/tiny_mc.jsonl``; nothing is downloaded). lm_eval sends each
(question, choice) as token ids with ``echo: true``, ``max_tokens: 1``, ``logprobs: 1`` and sums the
returned prompt logprobs of the choice's tokens.

The same scores are computed here with transformers on the same checkpoint (``log_softmax`` of its
float32 logits over question + choice), and every sample's score and greedy flag are compared:
the table prints each question's choices (hetserve vs transformers), the largest difference, the
accuracy both ways, and the server's ``hetserve_requests_total`` for the run (errors must be 0).
Exits non-zero when a score differs by more than ``--tol`` or a request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_clients import diff, free_port, server_metrics

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "bench" / "lmeval"
TASK = "hetserve_tiny_mc"
LAYERS = 4


def plan(replicas: int) -> dict:
    return {"model": "tiny", "cluster": "demo-cpu", "algorithm": "manual", "replicas": [
        {"id": f"c{i}", "role": "colocated", "stages": [{"devices": [f"m0:{i}"], "layers": [0, LAYERS]}]}
        for i in range(replicas)]}


def start_server(model: Path, plan_file: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "HF_HUB_OFFLINE": "1"}
    env.pop("HETSERVE_API_KEY", None)
    return subprocess.Popen([sys.executable, "-m", "hetserve.cli.main", "serve", "--plan", str(plan_file),
                             "--cluster", "demo-cpu", "--model", str(model), "--port", str(port),
                             "--log-level", "warning"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("hetserve serve exited:\n" + server.stdout.read()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("hetserve serve did not become ready")


def run_lm_eval(bin_dir: Path, url: str, model: Path, out: Path) -> list[dict]:
    """lm_eval's per-sample records (``--log_samples``) of the task."""
    args = (f"base_url={url}/v1/completions,model=tiny,tokenizer_backend=huggingface,tokenizer={model},"
            f"num_concurrent=4,max_retries=1,tokenized_requests=True")
    cmd = [str(bin_dir / "lm_eval"), "--model", "local-completions", "--model_args", args, "--tasks", TASK,
           "--include_path", str(TASK_DIR), "--output_path", str(out), "--log_samples", "--batch_size", "1"]
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OPENAI_API_KEY": "unused"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=ROOT)
    found = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))
    if proc.returncode != 0 or not found:
        raise RuntimeError("lm_eval failed:\n" + proc.stdout[-3000:] + proc.stderr[-3000:])
    return [json.loads(line) for line in found[-1].read_text().splitlines() if line.strip()]


def reference_scores(model: Path, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """(Σ logprob of the continuation's tokens after the context, whether each was the argmax), by
    transformers on the same checkpoint, tokenised as lm_eval tokenises (no special tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    out = []
    for context, continuation in pairs:
        ctx = tok(context, add_special_tokens=False).input_ids
        cont = tok(context + continuation, add_special_tokens=False).input_ids[len(ctx):]
        with torch.no_grad():
            lp = torch.log_softmax(lm(torch.tensor([ctx + cont])).logits[0].float(), -1)
        rows = lp[len(ctx) - 1:len(ctx) - 1 + len(cont)]
        picked = rows[torch.arange(len(cont)), torch.tensor(cont)]
        out.append((float(picked.sum()), bool((rows.argmax(-1) == torch.tensor(cont)).all())))
    return out


def compare(samples: list[dict], model: Path) -> tuple[list[tuple], float, float, float]:
    """Per question: (question, [(choice, hetserve, transformers)]), the largest |difference|, and the
    accuracy from each side's scores."""
    pairs, served = [], []
    for s in samples:
        args = s["arguments"]  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...} (or a list)
        for arg, resp in zip(args.values() if isinstance(args, dict) else args, s["filtered_resps"]):
            pairs.append((arg["arg_0"], arg["arg_1"]) if isinstance(arg, dict) else tuple(arg))
            served.append((float(resp[0]), str(resp[1]) == "True"))  # the log keeps them as text
    ref = reference_scores(model, pairs)
    worst = max(abs(a[0] - b[0]) for a, b in zip(served, ref))
    if any(a[1] != b[1] for a, b in zip(served, ref)):
        worst = float("inf")  # a greedy flag that differs is a different distribution
    rows, i, hits = [], 0, [0, 0]
    for s in samples:
        k = len(s["arguments"])
        got, want = served[i:i + k], ref[i:i + k]
        for side, scores in enumerate((got, want)):
            hits[side] += max(range(k), key=lambda j: scores[j][0]) == int(s["target"])
        rows.append((s["doc"]["question"], [(pairs[i + j][1], got[j][0], want[j][0]) for j in range(k)]))
        i += k
    return rows, worst, hits[0] / len(samples), hits[1] / len(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--client-bin", required=True, help="folder holding the lm_eval executable")
    ap.add_argument("--replicas", type=int, default=2, help="colocated CPU replicas (demo-cpu has 4 slots)")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest |hetserve - transformers| score allowed")
    args = ap.parse_args()
    from hetserve.planner.plan import Plan
    from hetserve.runtime.model.make import make_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_model(tmp / "tiny", "llama", layers=LAYERS, hidden=64, heads=4, kv_heads=2, seed=0)
        Plan.from_dict(plan(args.replicas)).save(tmp / "plan.json")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        os.environ["NO_PROXY"] = "127.0.0.1,localhost"
        server = start_server(model, tmp / "plan.json", port)
        try:
            wait_ready(url, server)
            before = server_metrics(url)
            t0 = time.monotonic()
            samples = run_lm_eval(Path(args.client_bin), url, model, tmp / "out")
            wall = time.monotonic() - t0
            srv = diff(server_metrics(url), before)
        finally:
            server.terminate()
            server.wait(60)
        rows, worst, acc_served, acc_ref = compare(samples, model)
    # a request that ran to its end finished by "stop" or "length"; any other outcome is a failure
    errors = sum(v for k, v in srv["requests"].items() if k.split("/")[-1] not in ("stop", "length"))
    print(f"\nlm_eval local-completions, task {TASK} ({len(samples)} questions, "
          f"{sum(len(c) for _, c in rows)} log-likelihood requests), {args.replicas} colocated CPU replicas, "
          f"lm_eval wall {wall:.1f} s; server requests_total this run: {srv['requests']}\n")
    print("| question | choice | hetserve logprob | transformers logprob | |diff| |")
    print("|---|---|---:|---:|---:|")
    for question, choices in rows:
        for j, (choice, got, want) in enumerate(choices):
            q = question if j == 0 else ""
            print(f"| {q} | {choice.strip()} | {got:.6f} | {want:.6f} | {abs(got - want):.1e} |")
    print(f"\nlargest |diff| {worst:.2e} (tolerance {args.tol:g}); accuracy hetserve {acc_served:.3f}, "
          f"transformers {acc_ref:.3f}; failed requests {errors}")
    if worst > args.tol or acc_served != acc_ref or errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
