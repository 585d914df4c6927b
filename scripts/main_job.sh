#!/usr/bin/env bash
# README command 1: set up everything on a fresh machine, then run a headless ComfyUI workflow
# through Parallel Config -> Hybrid Sampler -> Patch VAE Decode on a tiny embedded SD3 model (CPU),
# next to the KSampler -> VAEDecode reference. Extra arguments go to examples/run_workflow.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_comfyui.sh .venv >/dev/null
exec .venv/bin/python examples/run_workflow.py "$@"
