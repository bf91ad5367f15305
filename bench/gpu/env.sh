# Sourced by the bench/gpu scripts: the Python environment and the GPU's row of gpus.csv.
# The serving packages travel as wheels in .whl where the machine lacks them (NO_WHEELS=1: ignore
# .whl); PY is the Python to run; GPU is chosen from the name nvidia-smi gives unless set.
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PY:-python3}
hs() { $PY -m hetserve.cli.main "$@"; }
if [ -z "${GPU:-}" ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
    *H200*) GPU=H200 ;;
    *"H100 80GB HBM3"*) GPU=H100-SXM-80G ;;
    *H100*PCIe*) GPU=H100-PCIe-80G ;;
    *) echo "set GPU to a row of hetserve/data/gpus.csv (nvidia-smi names no GPU these scripts know)"; exit 2 ;;
  esac
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; nproc; date -u; } 2>&1 | tee "$OUT/machine.txt"
$PY -c "import torch, transformers, fastapi, uvicorn, pydantic, openai; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)" >>"$OUT/machine.txt" 2>&1 || { cat "$OUT/machine.txt"; exit 1; }
