#!/usr/bin/env bash
# Third-party node packs users chain in front of samplers (ComfyUI-GGUF, ComfyUI-KJNodes), for a check by hand with
# the real packs: each snapshot HP_THIRDPARTY_DIR/*.tar.gz (a folder of your own; the project never holds their code)
# unpacked into VENV/thirdparty/<pack>, its requirements.txt installed into the venv (never touching torch: the
# project's constraints pin it). The tests' server copies them into its custom_nodes (tests/conftest.py). Without
# HP_THIRDPARTY_DIR nothing happens (CI, a fresh machine: the tests use their own stand-ins of the packs' mechanisms,
# tests/hp_gguf_loader and tests/hp_standin_nodes).
#   usage: scripts/setup_thirdparty.sh [VENV]      (default: .venv in the repo root)
# Idempotent: a pack whose marker is newer than its tarball is skipped.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv}
SRC=${HP_THIRDPARTY_DIR:-}
[ -n "$SRC" ] || exit 0
[ -d "$SRC" ] || { echo "setup_thirdparty.sh: HP_THIRDPARTY_DIR=$SRC is no folder" >&2; exit 2; }
mkdir -p "$VENV/thirdparty"
for tarball in "$SRC"/*.tar.gz; do
  [ -f "$tarball" ] || continue
  mark="$VENV/thirdparty/.$(basename "$tarball").installed"
  [ "$mark" -nt "$tarball" ] && continue
  tmp=$(mktemp -d)
  tar xzf "$tarball" -C "$tmp"
  for pack in "$tmp"/*/; do
    name=$(basename "$pack")
    rm -rf "$VENV/thirdparty/$name"
    mv "$pack" "$VENV/thirdparty/$name"
    if [ -f "$VENV/thirdparty/$name/requirements.txt" ]; then
      "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$ROOT/constraints.txt" \
        -r "$VENV/thirdparty/$name/requirements.txt"
    fi
  done
  rm -rf "$tmp"
  touch "$mark"
done
