#!/usr/bin/env bash
# On the GPU machine the device tool lends (no registry there): install the device kit offline, run the GPU suite.
# The kit (scripts/device_kit.py build, here first) is two parts, one per call, back to back onto the same held
# machine (its git-ignored .kitsite stays between calls while the machine is held):
#   run  carry [".kit/part1"]  command "bash scripts/device_run.sh part1"                    (~1 min with the start)
#   run  carry [".kit/part2"]  command "bash scripts/device_run.sh part2"  timeout_s 570     (the suite, ~8 min)
# Extra arguments after part2 go to bench/gpu_suite.py (a rerun of what failed: --sections quant,methods).
# Results land in $OUT (the device tool's folder that comes back), else bench/results.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=$PWD/.kitsite
part=${1:-}; shift || true
t0=$(date +%s)
case "$part" in
  part1) rm -rf "$SITE" ;;
  part2) if [ ! -f "$SITE/.part1" ]; then
           echo "part 1 of the kit is not installed on this machine (a fresh one: the last was given back)." >&2
           echo "Run 'bash scripts/device_run.sh part1' carrying .kit/part1 first, then this again at once." >&2
           exit 3
         fi ;;
  *) echo "usage: bash scripts/device_run.sh part1|part2 [gpu_suite arguments]" >&2; exit 2 ;;
esac
[ -d ".kit/$part" ] || { echo ".kit/$part is missing: carry it (build it here: python scripts/device_kit.py build)" >&2; exit 2; }
$PY scripts/device_kit.py install ".kit/$part" "$SITE" || exit 1
echo "kit $part installed in $(( $(date +%s) - t0 )) s"
[ "$part" = part1 ] && exit 0
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" COMFYUI_DIR="$SITE/ComfyUI" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
$PY bench/gpu_suite.py --plan
exec $PY bench/gpu_suite.py --out "${OUT:-bench/results}" "$@"
