#!/usr/bin/env bash
# hetserve calibrate on a GPU machine: the engine on CUDA behind the real HTTP server, fitted
# against the datasheet of the GPU nvidia-smi names (GPU=... to choose another row of
# hetserve/data/gpus.csv). Written for a machine with python3, torch and transformers; the serving
# packages travel as wheels: before the run, here: `make gpu-wheels`; the device tool's carry:
# [".whl"] (bench/gpu/env.sh). $OUT is where the files go (default out/gpu). Two checkpoints: the
# demo's tiny Llama (what the CPU calibrations measure: all fixed costs) and a 0.76 B-parameter
# Llama in bf16 (where the GPU's compute and memory show). Each step has its own time limit so one
# failure leaves the others' output.
# Knobs (environment): GPU, REPS (rounds, default 5), SKIP_TINY / ONLY_TINY, TINY_S / BIG_S (time
# limits), PY (the Python to run), NO_WHEELS (ignore .whl).
set -u
cd "$(dirname "$0")/../.."
NEEDS="transformers fastapi starlette uvicorn prometheus_client"
. bench/gpu/env.sh

# 1. the demo's tiny Llama (float32, as on CPU), every probe
if [ -z "${SKIP_TINY:-}" ]; then
hs make-model --arch llama --layers 8 --hidden 256 --heads 4 --kv-heads 1 --ffn 768 -o /tmp/tiny-llama >/dev/null
timeout ${TINY_S:-170} $PY -m hetserve.cli.main calibrate --model /tmp/tiny-llama --gpu "$GPU" --reps ${REPS:-5} \
  -o "$OUT/calibration-tiny.json" 2>&1 | tee "$OUT/calibrate-tiny.log"
rc=${PIPESTATUS[0]}
echo "tiny rc $rc" | tee -a "$OUT/machine.txt"
[ "$rc" != 0 ] && exit "$rc"  # the CUDA path broke: the larger checkpoint would only break the same way
fi
[ -n "${ONLY_TINY:-}" ] && exit 0

# 2. a 0.76 B Llama (16 layers, hidden 2048, GQA 16/8 heads, bf16): longer prompts, larger batches;
# no speed probe (it runs the checkpoint on one CPU thread: seconds per read at this size)
hs make-model --arch llama --layers 16 --hidden 2048 --heads 16 --kv-heads 8 --ffn 5632 --max-positions 2048 \
  -o /tmp/llama-760m >/dev/null
$PY - <<'PYEOF'
import json, pathlib
p = pathlib.Path("/tmp/llama-760m/config.json")
c = json.loads(p.read_text()); c["torch_dtype"] = c["dtype"] = "bfloat16"; p.write_text(json.dumps(c, indent=2))
PYEOF
timeout ${BIG_S:-200} $PY -m hetserve.cli.main calibrate --model /tmp/llama-760m --gpu "$GPU" --reps ${REPS:-5} \
  --prompt-lengths 128,512,1024,1536 --batch-sizes 1,8,32 --no-speed-probe \
  -o "$OUT/calibration-llama-760m.json" 2>&1 | tee "$OUT/calibrate-llama-760m.log"
echo "760m rc ${PIPESTATUS[0]}" | tee -a "$OUT/machine.txt"
