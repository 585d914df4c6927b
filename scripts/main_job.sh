#!/usr/bin/env bash
# README command 1: set up everything on a fresh machine, then draw a caption with the pack's trained demo
# model (examples/demo_model, shipped) in a headless ComfyUI through Parallel Config -> Hybrid Sampler ->
# Patch VAE Decode (CPU), next to the KSampler -> VAE Decode reference; saves both side by side with their
# difference. Extra arguments go to examples/run_workflow.py (--caption "a red circle on a gray background").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_comfyui.sh .venv >/dev/null
exec .venv/bin/python examples/run_workflow.py "$@"
