#!/usr/bin/env bash
# The benchmark suite in one command: installs matplotlib (plots) into the venv if missing, then
# runs every section and writes bench/results/summary.md, summary.json and the PNG plots.
#   bash bench/run.sh [--quick] [--only comm,transport,overhead,scaling,memory,vae]
# PYTHON picks the interpreter (default: .venv/bin/python of this repo, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
for cand in .venv/bin/python python3; do
  [ -n "$PY" ] && break
  command -v "$cand" >/dev/null 2>&1 && PY="$cand"
done
"$PY" -c "import matplotlib" 2>/dev/null || "$PY" -m pip install -q matplotlib
exec "$PY" -m bench.run_all "$@"
