# Sourced first by the bench/gpu check scripts, with their arguments: none (on the GPU machine),
# --cpu (the dry run here: the project's .venv, out/gpu-cpu, no wheels) or --help (the calling
# script's header). Leaves the shell in the repository root; CPU_RUN=1 for the dry run.
case "${1:-}" in
  ""|--cpu) ;;
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  *) echo "$(basename "$0"): unknown argument '$1' (none, --cpu or --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.."
CPU_RUN=
if [ "${1:-}" = "--cpu" ]; then
  export GPU=${GPU:-cpu} PY=${PY:-.venv/bin/python} OUT=${OUT:-$PWD/out/gpu-cpu} NO_WHEELS=1
  CPU_RUN=1
fi
