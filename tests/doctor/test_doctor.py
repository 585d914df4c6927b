"""The self-check users run first (`python -m comfyui_hybrid_parallel.doctor`), run here as CI runs it on CPU.

It is started the way a user in ComfyUI's custom_nodes starts it (the pack's folder, not an installed
package), its JSON is read back, and its comparisons are shown able to fail: a serial reference
shifted by 1e-4 must fail every method row, degree 1 included, and the exit code must say so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.comfy

PACK = Path(__file__).resolve().parents[2]


def _run(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, str(PACK / "doctor"), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=PACK.parent)


# CI: the quick doctor in fp32 (every method, the kernels, the report); its fp8 rows with the slow set - fp8 weights on
# every method are the pool tests' (families/test_native_pool.py, engine/test_shard.py)
@pytest.mark.parametrize("precisions", ["fp32", pytest.param("fp32,fp8_e4m3fn", marks=pytest.mark.slow)])
def test_quick_doctor_passes_on_cpu_and_writes_its_report(tmp_path, precisions):
    out = tmp_path / "report.json"
    res = _run("--quick", "--precisions", precisions, "--timing-runs", "1", "--json", str(out))
    print(res.stdout[-4000:])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["gloo"] and env["comfyui"]
    from comfyui_hybrid_parallel.workers.bridge.seams import TESTED
    assert report["comfyui"]["ok"] and report["comfyui"]["tested"] and report["comfyui"]["version"] in TESTED
    assert f"ComfyUI {report['comfyui']['version']}: every seam the pack uses is present" in res.stdout
    kernels = {(r["dtype"], r["backend"]) for r in report["kernels"]}
    assert {("float32", "cpu_flash"), ("float32", "math"), ("bfloat16", "cpu_flash")} <= kernels
    for r in report["kernels"]:
        assert r["ok"] and r["ring_rel"] <= r["bound"], r
        assert r["ms"] > 0 if r["layout"] == "contiguous" else "ms" not in r, r
    assert {r["layout"] for r in report["kernels"]} == {"contiguous", "strided"}  # ring's inputs after Ulysses
    methods = {r["method"] for r in report["methods"]}
    assert methods == {"degree 1", "ulysses 2", "ring 2", "cfg 2", "data 2", "tensor 2", "pipefusion 2",
                       "distrifusion 2", "ulysses 2, loop mode", "patch vae decode 2", "ulysses 2, sharded weights"}
    assert {r["precision"] for r in report["methods"]} == set(precisions.split(","))
    assert [r["precision"] for r in report["methods"] if r["method"] == "patch vae decode 2"] == ["fp32"]
    for r in report["methods"]:
        assert r["ok"] and not r.get("skipped") and r["device"] == "cpu", r
        assert r["rel"] <= r["bound"] and r["ms"] > 0 and r["serial_ms"] > 0
        if r["world"] == 1:
            assert r["rel"] == 0.0 and r["bound"] == 0.0  # bitwise
        else:
            assert r["bound"] == 1e-5  # fp32 compute on CPU, fp8 weights included (manual cast)
    assert report["failed"] == 0 and "OK" in res.stdout


def test_cuda_requested_without_cuda_is_refused_with_the_fix():
    res = _run("--devices", "cuda", env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)  # no GPU, on any machine
    assert res.returncode == 2
    assert "torch sees no CUDA device" in res.stderr and "--devices cpu" in res.stderr


def test_a_wrong_result_fails_the_row_and_the_exit_code(tmp_path, monkeypatch):
    """The doctor's comparisons can fail: shift its serial reference by 1e-4 relative (ten times the exact bound)
    and every method row fails, degree 1 (bitwise) included."""
    from comfy_env import setup_comfy
    setup_comfy()
    from comfyui_hybrid_parallel.doctor import cli, methods

    plan = [(m, "cpu") for m in methods.MESHES if m.name in ("degree 1", "ulysses 2", "pipefusion 2")]
    real_serial, real_loop = methods._Case.serial, methods._Case.serial_loop
    monkeypatch.setattr(methods._Case, "serial", lambda self, inp: real_serial(self, inp) * (1 + 1e-4))
    monkeypatch.setattr(methods._Case, "serial_loop", lambda self, *a: real_loop(self, *a) * (1 + 1e-4))
    rows = methods.check_methods(plan, ["fp32"], tmp_path, progress=print)
    assert [r["method"] for r in rows] == ["degree 1", "ulysses 2", "pipefusion 2"]
    for r in rows:
        assert not r["ok"], r
        assert r["rel"] > 5e-5 and ("bitwise" in r["error"] if r["world"] == 1 else "over the bound" in r["error"])

    # and the command's exit code follows the rows
    monkeypatch.setattr(cli, "check_methods", lambda *a, **k: rows)
    monkeypatch.setattr(cli, "check_kernels", lambda *a, **k: [])
    assert cli.main(["--quick", "--devices", "cpu", "--json", str(tmp_path / "r.json")]) == cli.EXIT_MISMATCH
    assert json.loads((tmp_path / "r.json").read_text())["failed"] == 3
