#!/usr/bin/env bash
# The engine's step on one GPU (bench/gpu/step_check.py): greedy tokens = transformers' with and
# without CUDA graphs (a Llama and an OPT checkpoint from `hetserve make-model`), the tiny model's ms
# per layer per decode step at batch 1 and 8, and a Llama-2-7B-shaped bf16 decode step (random
# weights made on the GPU) at batch 1/8/32/64 and context 512/2048 against (weights + KV bytes) /
# 4.8 TB/s. Writes $OUT/step.json and $OUT/step.md (default out/gpu). Needs torch with CUDA and
# triton; no network. --cpu: the same script end to end on the CPU with tiny sizes (a dry run).
# Knobs: STEP_S (time limit, default 340 s), PY, OUT.
#   bench/gpu/step.sh          on the GPU machine
#   bench/gpu/step.sh --cpu    the dry run here
set -u
case "${1:-}" in
  ""|--cpu) ;;
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  *) echo "step.sh: unknown argument '$1' (none, --cpu or --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "--cpu" ]; then
  OUT=${OUT:-$PWD/out/gpu-cpu}
  mkdir -p "$OUT"
  export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  PY=${PY:-.venv/bin/python}
  timeout ${STEP_S:-340} $PY bench/gpu/step_check.py --cpu --out "$OUT" 2>&1 | tee "$OUT/step.log"
else
  . bench/gpu/env.sh
  timeout ${STEP_S:-340} $PY bench/gpu/step_check.py --out "$OUT" 2>&1 | tee "$OUT/step.log"
fi
rc=${PIPESTATUS[0]}
echo "step rc $rc"
exit "$rc"
