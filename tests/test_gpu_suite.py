"""The GPU suite (bench/gpu_suite.py) runs, reduced, on CPU in CI: so that the command a session lent a GPU runs first
cannot rot between GPU sessions. It is run as a session would run it (a subprocess), and its report is read back."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.comfy

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_suite_runs_reduced_on_cpu(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--reduced", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_suite_reduced.json").read_text())
    assert report["reduced"] and not report["errors"] and report["meta"]["device"] == "cpu"
    assert {r["layout"] for r in report["kernels"]} == {"contiguous", "strided"}
    assert all(r["ok"] for r in report["kernels"] + report["methods"])
    methods = {r["method"] for r in report["methods"]}
    assert {"ulysses 2", "ring 2", "cfg 2", "tensor 2", "pipefusion 2", "distrifusion 2", "ulysses 2, loop mode",
            "patch vae decode 2"} <= methods
    native = report["native"]
    assert [(r["precision"], r["sampler"]) for r in native] == [
        ("fp32", "KSampler"), ("fp32", "Hybrid d1"), ("fp8_e4m3fn", "KSampler"), ("fp8_e4m3fn", "Hybrid d1")]
    for r in native:
        assert "error" not in r and r["finite"] and r["first_s"] > 0 and r["warm_step_s"] > 0, r
    costs = [r["cost"] for r in native if "cost" in r]
    assert len(costs) == 2 and all(c["predicted_s"] > 0 and c["measured_s"] > 0 for c in costs)
    (session,) = report["session"]
    assert "error" not in session, session
    assert session["experts_loads"] == [1, 2, 2, 2], session  # two experts alternating, each loaded once
    assert 0 < session["lora_moved_bytes"] < session["weight_bytes"] and session["lora_keys_rewritten"] > 0, session
    assert session["resident_after_release"] == [[], []], session  # ComfyUI's unload released the ranks' models
    text = (tmp_path / "gpu_suite_reduced.md").read_text()
    assert "# GPU suite (reduced, CPU)" in text and "measured / predicted" in text and "A real session" in text
