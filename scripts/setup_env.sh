#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned CPU torch and the pack installed editable (test extra: pytest, selenium, gguf).
# Works on a fresh machine that has only Python 3.11, pip and gcc.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import comfyui_hybrid_parallel.parallel, pytest" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.installed ] || [ constraints.txt -nt .venv/.installed ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
  touch .venv/.installed
fi
