# Sourced by the bench/gpu scripts (from the repository root): the Python environment, the GPU's row
# of gpus.csv, and $OUT/machine.txt (appended to, so scripts run one after another in one command
# keep each other's lines).
# Wheels: the GPU machine has torch, triton, transformers, numpy, scipy, networkx and a few more, but
# not the serving packages (pydantic, fastapi, uvicorn, openai, ...): bench/gpu/wheels.txt lists what
# is carried, and why. Before the run, here:
# `make gpu-wheels` (fills .whl/); the device tool's carry: [".whl"]. The wheels are installed into
# /tmp/site once per machine (skipped when /tmp/site already holds these wheels); NO_WHEELS=1: ignore .whl.
# Knobs: PY (the Python to run, default python3), GPU (a row of hetserve/data/gpus.csv; default from
# the name nvidia-smi gives), OUT (default out/gpu), NEEDS (modules the calling script needs beyond
# the engine's own: each script sets it).
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  wheels=$(cd .whl && ls -- *.whl)
  if [ "$wheels" = "$(cat /tmp/site/.hetserve-wheels 2>/dev/null)" ]; then
    echo "wheels: /tmp/site already holds .whl's"
  else
    PIP_ROOT_USER_ACTION=ignore $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl \
      || { echo "env.sh: installing .whl/*.whl into /tmp/site failed (wheels for another Python?)" >&2; exit 1; }
    echo "$wheels" > /tmp/site/.hetserve-wheels
  fi
  export PYTHONPATH=/tmp/site:$PWD
fi
hs() { $PY -m hetserve.cli.main "$@"; }
if [ -z "${GPU:-}" ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
    *H200*) GPU=H200 ;;
    *"H100 80GB HBM3"*) GPU=H100-SXM-80G ;;
    *H100*PCIe*) GPU=H100-PCIe-80G ;;
    *) echo "set GPU to a row of hetserve/data/gpus.csv (nvidia-smi names no GPU these scripts know)"; exit 2 ;;
  esac
fi
{ echo "== $(basename "$0") $*"; date -u
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,compute_mode --format=csv 2>&1
  else
    echo "nvidia-smi: none"
  fi
  nproc; } | tee -a "$OUT/machine.txt"
# Every module the engine imports on the calling script's path, each one tried: the missing ones named.
$PY - ${NEEDS:-} <<'PYEOF' 2>&1 | tee -a "$OUT/machine.txt"
import importlib, sys
ALIAS = {"opentelemetry-api": "opentelemetry"}  # a wheel whose module has another name
with open("bench/gpu/wheels.txt") as f:  # what `make gpu-wheels` fetches, as module names
    WHEELS = {ALIAS.get(n, n.replace("-", "_")) for n in
              (line.split("==")[0].strip().lower() for line in f if line.strip() and not line.startswith("#"))}
missing = {}
for m in ["torch", "numpy", "scipy", "networkx", "yaml", "msgpack", "safetensors", "rich", "pydantic", *sys.argv[1:]]:
    try:
        importlib.import_module(m)
    except Exception as e:  # noqa: BLE001 - each named below, by the module that is not there
        root = (e.name or m).split(".")[0] if isinstance(e, ModuleNotFoundError) else m
        missing[root] = f"{type(e).__name__}: {e}" + (f" (importing {m})" if root != m else "")
print("python", sys.version.split()[0])
if "torch" not in missing:
    import torch
    print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.version.cuda)
for m in ("transformers", "triton", "pydantic", "fastapi"):
    if m in sys.modules:
        print(m, getattr(sys.modules[m], "__version__", "?"))
if missing:
    for m, why in missing.items():
        print(f"missing: {m} ({why})")
    if set(missing) & WHEELS:
        print("run `make gpu-wheels` here and carry .whl (the device tool's carry: [\".whl\"])")
    if set(missing) - WHEELS:
        print("not in .whl (`make gpu-wheels`): " + ", ".join(sorted(set(missing) - WHEELS))
              + ": this machine needs them installed")
    sys.exit(1)
PYEOF
[ "${PIPESTATUS[0]}" = 0 ] || { echo "env.sh: modules missing (above; also in $OUT/machine.txt)" >&2; exit 1; }
