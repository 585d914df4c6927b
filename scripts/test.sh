#!/usr/bin/env bash
# The test command of README.md (and of CI): set up, then run the test suite.
# Extra arguments go to pytest. HP_FULL=1 also runs the exhaustive matrix marked `slow`.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
bash scripts/setup_comfyui.sh .venv >/dev/null || exit 1
bash scripts/setup_browser.sh .venv || exit 1; export HP_REQUIRE_BROWSER=1  # browser tests fail, never skip, here
MARK=()
[ "${HP_FULL:-0}" = "1" ] || MARK=(-m "not slow")
.venv/bin/python -m pytest -q -ra "${MARK[@]}" "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit $rc
