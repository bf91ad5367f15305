#!/usr/bin/env bash
# hetserve compare on a GPU machine: served vs simulated for the demo's tiny Llama on two
# plan devices that share the machine's one GPU, priced by the committed GPU calibration of that
# checkpoint (examples/calibrations/; CAL=... for another), as calibrated (`compare` leaves the speed
# probe out for a GPU calibration: it times the CPU). Three cells: prefill/decode at a light and a
# heavy rate, and a two-stage pipeline.
# Before the run, here: `make gpu-wheels`; the device tool's carry: [".whl"] (bench/gpu/env.sh).
# Knobs as bench/gpu/calibrate_gpu.sh (env.sh), and N (requests per cell, default 48).
set -u
cd "$(dirname "$0")/../.."
NEEDS="transformers fastapi starlette uvicorn prometheus_client openai"
. bench/gpu/env.sh
CAL=${CAL:-examples/calibrations/h200-2026-11-28/tiny-llama.json}
N=${N:-48}
hs make-model --arch llama --layers 8 --hidden 256 --heads 4 --kv-heads 1 --ffn 768 -o /tmp/tiny-llama >/dev/null
cat > /tmp/gpu2.yaml <<YAML
name: gpu2
description: two plan devices on this machine's GPU (the engine maps both to cuda:0)
machines:
  - {name: g, gpu: $GPU, count: 2}
YAML
plan() {  # $1: prefill-decode | pipeline-2
  if [ "$1" = prefill-decode ]; then
    echo '{"model": "tiny-llama", "cluster": "gpu2", "replicas": [
      {"id": "p0", "role": "prefill", "stages": [{"devices": ["g:0"], "layers": [0, 8]}]},
      {"id": "d0", "role": "decode", "stages": [{"devices": ["g:1"], "layers": [0, 8]}]}],
      "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}'
  else
    echo '{"model": "tiny-llama", "cluster": "gpu2", "replicas": [
      {"id": "c0", "role": "colocated", "stages": [{"devices": ["g:0"], "layers": [0, 4]},
                                                    {"devices": ["g:1"], "layers": [4, 8]}]}], "kv_routes": []}'
  fi
}
for cell in prefill-decode:10 prefill-decode:40 pipeline-2:10; do
  name=${cell%%:*} rate=${cell##*:}
  plan "$name" > "/tmp/$name.json"
  timeout ${CELL_S:-90} $PY -m hetserve.cli.main compare --plan "/tmp/$name.json" --cluster /tmp/gpu2.yaml \
    --model /tmp/tiny-llama --workload-class LPLD --rate "$rate" -n "$N" --max-input 128 --max-output 32 \
    --efficiency "$CAL" -o "/tmp/compare-$name-$rate" > "$OUT/compare-$name-$rate.log" 2>&1
  echo "$name at $rate req/s: rc $?" | tee -a "$OUT/machine.txt"
  cp "/tmp/compare-$name-$rate/compare.json" "$OUT/compare-$name-$rate.json" 2>/dev/null
done
