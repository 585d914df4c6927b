#!/usr/bin/env bash
# The third-party node packs users chain in front of samplers (ComfyUI-GGUF, ComfyUI-KJNodes), as a user installs
# them: each snapshot in ../shared/thirdparty/*.tar.gz unpacked into VENV/thirdparty/<pack>, its requirements.txt
# installed into the venv (never touching torch: the project's constraints pin it). The tests' server copies them
# into its custom_nodes (tests/conftest.py). Without ../shared/thirdparty nothing happens (a user's machine: the
# tests use their own stand-ins).
#   usage: scripts/setup_thirdparty.sh [VENV]      (default: .venv in the repo root)
# Idempotent: a pack whose marker is newer than its tarball is skipped.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv}
SRC=${HP_THIRDPARTY_DIR:-$ROOT/../shared/thirdparty}
[ -d "$SRC" ] || exit 0
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
