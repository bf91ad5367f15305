#!/usr/bin/env bash
# The engine's step on one GPU (bench/gpu/step_check.py): first a tiny Triton kernel compiled and
# launched (bench/gpu/triton_launch.py, its own process, 45 s at most: a Triton that cannot build its
# launcher here is one error under "errors", and the run goes on), then greedy tokens = transformers'
# with and without CUDA graphs (a Llama and an OPT checkpoint from `hetserve make-model`), the tiny
# model's decode step at batch 1 and 8, and a Llama-2-7B-shaped bf16 decode step (random weights made
# on the GPU) at batch 1/8/32/64 and context 512/2048. Each decode step timed twice: the forward alone
# (the runner's layers; the 7B one against (layer weights + KV bytes) / 4.8 TB/s) and the whole step
# as the engine runs it (prepare + embedding + forward + LM head + sampling, tokens to the host).
# Writes $OUT/step.json and $OUT/step.md (default out/gpu), rewritten after every stage (a failed
# stage is recorded under "errors" and the next one runs; a kill by the time limit leaves the stages
# done), plus step.log and machine.txt. Exit status non-zero when a stage failed, CUDA graphs were
# asked but captured none, or greedy tokens differ. Needs torch with CUDA and triton; no network.
# --cpu: the same script end to end on the CPU with tiny sizes (a dry run; out/gpu-cpu).
# Before the run, here: `make gpu-wheels`; the device tool's carry: [".whl"] (bench/gpu/env.sh).
# Knobs: STEP_S (time limit, default 150 s; expected about 1-1.5 minutes on one H200), PY, OUT, GPU.
#   bench/gpu/step.sh          on the GPU machine
#   bench/gpu/step.sh --cpu    the dry run here
# The device plan (this with dataflow.sh in one command, serve.sh in a second; the tool's timeouts):
# docs/benchmarks.md, the GPU rows.
set -u
. "$(dirname "$0")/args.sh"  # --cpu / --help; the repository root
if [ -n "$CPU_RUN" ]; then
  NEEDS=transformers
else
  NEEDS="transformers triton"
fi
. bench/gpu/env.sh
timeout -k 10 "${STEP_S:-150}" $PY bench/gpu/step_check.py ${1:-} --out "$OUT" 2>&1 | tee "$OUT/step.log"
rc=${PIPESTATUS[0]}
echo "step rc $rc" | tee -a "$OUT/machine.txt"
exit "$rc"
