#!/usr/bin/env bash
# Headless Chromium for the browser tests (tests/web/test_web_browser.py): Debian's chromium and
# chromium-driver packages, and selenium in the venv. No browser is downloaded: selenium is driven
# with /usr/bin/chromedriver explicitly, so selenium-manager never runs.
#   usage: scripts/setup_browser.sh [VENV]      (default: .venv in the repo root)
# Idempotent: apt-get runs only when a binary is missing, pip only when selenium is not importable.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv}
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
fi
if ! "$VENV/bin/python" -c "import selenium" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "selenium>=4.20"
fi
