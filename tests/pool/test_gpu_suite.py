"""The GPU suite (bench/gpu_suite.py) and its device kit, rehearsed on CPU (the slow set, and the first step before any
device call: docs/doctor.md): so that what a session lent a GPU runs first has run here that day.

The rehearsal does what the GPU machine will do, on this machine: the kit is built (scripts/device_kit.py, this
Python's wheels; LZMA level 1 for speed - the device's cp312 kit is built at level 9), each part fits one device call
beside the tree, both install with `--no-index` into a fresh environment whose only other packages are the device
image's (links to this venv's copies of exactly the packages KINDS.md lists), and the reduced suite runs there, as
a subprocess, its report read back. A package ComfyUI imports that the image lacks and the kit forgot fails here, not
in the 15 minutes of a lent GPU. The kit packs the ComfyUI the tests run on (0.30.0 from the registry in CI).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.comfy

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))


def _fresh_env(tmp: Path, kit: Path) -> tuple[Path, Path]:
    """A venv without packages, seeing the installed kit and the image's packages only; (python, kit site)."""
    import device_kit
    venv, site = tmp / "fresh", tmp / "kitsite"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True)
    for part in ("part1", "part2"):
        device_kit.install(kit / part, site)
    standin = device_kit.standin(tmp / "image")
    (purelib,) = venv.glob("lib/python3*/site-packages")
    (purelib / "kit.pth").write_text(f"{site}\n{standin}\n")
    return venv / "bin" / "python", site


# 3.5 min on 2 cores: with the slow set, and before every device call (docs/doctor.md: the kit's steps start with it)
@pytest.mark.slow
def test_the_kit_installs_offline_and_the_gpu_suite_runs_from_it(tmp_path):
    import device_kit
    from comfy_env import comfyui_dir
    manifest = device_kit.build(tmp_path / "kit", f"{sys.version_info.major}.{sys.version_info.minor}",
                                comfyui_dir(), level=1)
    for part, m in manifest["parts"].items():
        assert m["with_tree_bytes"] <= device_kit.LIMIT, (part, m)
    assert any(n.startswith("comfy_kitchen") for n in manifest["parts"]["part2"]["files"])
    python, site = _fresh_env(tmp_path, tmp_path / "kit")
    probe = subprocess.run([str(python), "-c", "import sys, torch, av, comfy_kitchen, comfy_aimdo, comfyui_hybrid_parallel;"
                            "import importlib.util as u; print(u.find_spec('diffusers'), u.find_spec('selenium'))"],
                           capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split() == ["None", "None"], "the fresh environment sees packages the device image lacks"
    assert not list(site.glob("comfy_kitchen/backends/hip/*")), "the trimmed comfy-kitchen kept its AMD backend"
    env = {**os.environ, "COMFYUI_DIR": str(site / "ComfyUI")}
    env.pop("PYTHONPATH", None)
    res = subprocess.run([str(python), str(ROOT / "bench" / "gpu_suite.py"), "--reduced", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=1500, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_suite_reduced.json").read_text())
    assert report["reduced"] and not report["errors"] and report["meta"]["device"] == "cpu"
    assert list(report["section_seconds"]) == ["session", "native", "quant", "methods", "kernels"]
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
    assert [r["rel_vs_ksampler"] for r in native if r["sampler"] == "Hybrid d1"] == [0.0, 0.0]  # degree 1: bitwise
    costs = [r["cost"] for r in native if "cost" in r]
    assert len(costs) == 2 and all(c["predicted_s"] > 0 and c["measured_s"] > 0 for c in costs)
    quant = report["quant"]
    assert [r["form"] for r in quant] == list(__import__("gpu_quant").FORMS), quant
    for r in quant:
        assert "error" not in r and r["finite"], r
        assert r["rel"] == 0.0, r  # degree 1 in the process ComfyUI runs a prompt in (inference mode): bitwise
    (session,) = report["session"]
    assert "error" not in session, session
    assert session["dynamic_vram"] is False and session["patcher"] == "ModelPatcher", session  # CPU: ComfyUI's own
    assert session["hybrid_rel"] <= 1e-5 and session["parallel_model_rel"] <= 1e-5 and session["lora_rel"] <= 1e-5
    assert session["experts_loads"] == [1, 2, 2, 2], session  # two experts alternating, each loaded once
    assert 0 < session["lora_moved_bytes"] < session["weight_bytes"] and session["lora_keys_rewritten"] > 0, session
    assert session["resident_after_release"] == [[], []], session  # ComfyUI's unload released the ranks' models
    text = (tmp_path / "gpu_suite_reduced.md").read_text()
    assert "# GPU suite (reduced, CPU)" in text and "measured / predicted" in text and "A real session" in text
    assert "quantized layouts" in text


def test_the_suite_fits_one_device_command():
    """Each section's predicted seconds on an H100 (bench/gpu_plan.py) sum to the 9 minutes that leave a lent GPU's
    15 minutes room for the machine's start, the kit's first part and a rerun of what failed."""
    import gpu_plan
    import gpu_suite
    pred = gpu_plan.predict(gpu_suite)
    assert set(pred) == {"session", "native", "quant", "methods", "kernels"}
    assert all(v > 0 for v in pred.values()), pred
    assert sum(pred.values()) <= gpu_plan.BUDGET_S, gpu_plan.table(pred)
