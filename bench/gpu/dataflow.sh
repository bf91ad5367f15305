#!/usr/bin/env bash
# Where tensors go between two workers on a GPU: the KV hand-off (GB/s) and the pipeline hand-off
# (ms) between two worker processes of one machine, by the authenticated socket (device -> host ->
# loopback -> device, as before the device channel) and by the device channel (CUDA IPC where both
# workers share a GPU, NCCL with GPUS=2), both in one run. Llama-2-7B shapes in bf16: activations of
# 32 / 512 / 2,048 rows x 4,096, KV of 512 / 2,048 tokens x 32 layers x 32 KV heads x 128. Writes
# $OUT/dataflow.json and $OUT/dataflow.md (the table), rewritten after every hand-off measured (a
# failed one is recorded under "errors" and the next runs; the channel falling back to the socket is
# recorded with its stats), plus dataflow.log and machine.txt. Exit status non-zero when a hand-off
# failed or the channel fell back. No network needed; about 1-2 minutes on one H200 (the socket
# path's 1 GB hand-offs dominate).
# Before the run, here: `make gpu-wheels`; the device tool's carry: [".whl"] (bench/gpu/env.sh).
#   bench/gpu/dataflow.sh          on the GPU machine (GPU=, PY= as env.sh says; REPS= rounds, default 5;
#                                  GPUS=2 for NCCL between two GPUs; DATAFLOW_S= time limit, default 120 s)
#   bench/gpu/dataflow.sh --cpu    the dry run: the same script and helper on CPU, tiny shapes, gloo
#                                  (out/gpu-cpu)
# The device plan (this with step.sh in one command, serve.sh in a second; the tool's timeouts):
# docs/benchmarks.md, the GPU rows. This script measures the channel itself; serve.sh, a 7B-shaped
# model served through `hetserve serve`.
set -u
. "$(dirname "$0")/args.sh"  # --cpu / --help; the repository root
if [ -n "$CPU_RUN" ]; then
  DEVICE=cpu SHAPE=tiny
else
  DEVICE=cuda SHAPE=7b
fi
NEEDS=
. bench/gpu/env.sh
timeout -k 10 "${DATAFLOW_S:-120}" $PY -m bench.gpu.dataflow --device "$DEVICE" --shape "$SHAPE" --gpus "${GPUS:-1}" \
  --reps "${REPS:-5}" --out "$OUT" 2>&1 | tee "$OUT/dataflow.log"
rc=${PIPESTATUS[0]}
echo "dataflow rc $rc" | tee -a "$OUT/machine.txt"
exit "$rc"
