#!/usr/bin/env bash
# A Llama-2-7B-shaped bf16 model served through `hetserve serve` on one GPU (bench/gpu/serve_check.py,
# its HTTP side in serve_client.py):
# a model folder with no weights file (`make-model --like llama-2-7b --random-weights`: each worker
# draws its layers on its device at start-up), served as a colocated replica, then as prefill ->
# decode (two workers sharing the one GPU), each `hetserve serve` a subprocess on 127.0.0.1. Per
# deployment: start-up (launch to /health ok, measured; serve's own printed start-up and each
# worker's stage time), prefill of a 512- and a 2,048-token prompt (max_tokens 1, median of 3 after a
# warm-up) against FLOPs / bf16 dense peak (gpus.csv's fp16_tensor_tflops: 989.4 TFLOP/s for H200),
# and tokens/s of 32 concurrent streaming requests (prompts of 112-144 tokens, 128 tokens each,
# ignore_eos) against transformers' batched greedy `generate` of the same prompts on a same-shape
# LlamaForCausalLM built on the GPU (run first, its memory freed before the servers start).
# Targets: prefill >= 50 % of peak at 2,048 tokens; >= 5x transformers' tokens/s. Writes
# $OUT/serve.json and $OUT/serve.md (default out/gpu), rewritten after every stage (a failed stage is
# recorded under "errors" and the next one runs; a kill by the time limit stops the servers and
# leaves the stages done), plus serve.log (the servers' output in it) and machine.txt. A worker's
# log line saying it fell back (a failed CUDA graph capture, Triton kernels that cannot launch, a
# device channel given up for the socket; serve_check.py's FALLBACK_LOG) is recorded under "errors"
# too. Exit status non-zero when a stage failed or a worker fell back. No network needed; expected 1.5-2.5 minutes on one H200. --cpu: the
# same script end to end on the CPU with a tiny shape (a dry run; out/gpu-cpu).
# Before the run, here: `make gpu-wheels`; the device tool's carry: [".whl"] (bench/gpu/env.sh).
# Knobs: SERVE_S (time limit, default 210 s), PY, OUT, GPU.
#   bench/gpu/serve.sh          on the GPU machine
#   bench/gpu/serve.sh --cpu    the dry run here
# The device plan (step.sh and dataflow.sh in one command, this in a second; the tool's timeouts):
# docs/benchmarks.md, the GPU rows.
set -u
. "$(dirname "$0")/args.sh"  # --cpu / --help; the repository root
if [ -n "$CPU_RUN" ]; then
  NEEDS="transformers fastapi starlette uvicorn prometheus_client"
else
  NEEDS="transformers triton fastapi starlette uvicorn prometheus_client"
fi
. bench/gpu/env.sh
timeout -k 10 "${SERVE_S:-210}" $PY bench/gpu/serve_check.py ${1:-} --gpu "$GPU" --out "$OUT" 2>&1 | tee "$OUT/serve.log"
rc=${PIPESTATUS[0]}
echo "serve rc $rc" | tee -a "$OUT/machine.txt"
exit "$rc"
