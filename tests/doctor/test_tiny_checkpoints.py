"""The tiny checkpoints every ComfyUI test loads (doctor/tiny_checkpoints.py), and the test environment's refusal of
a missing ComfyUI.

Why: every equivalence test compares the pack with ComfyUI on these files; were they not the same from one call to
the next, a reference written in one process would not be the one another process loads. A missing ComfyUI fails a
test with the command that installs it - never a skip, which would prove nothing."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import comfy_env

pytestmark = pytest.mark.comfy


def test_missing_comfyui_fails_with_install_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("COMFYUI_DIR", str(tmp_path))  # a directory without ComfyUI in it
    with pytest.raises(pytest.fail.Exception, match="scripts/setup_comfyui.sh"):
        comfy_env.setup_comfy()


def test_tiny_checkpoints_are_deterministic(tmp_path):
    comfy_env.setup_comfy()
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    a = tc.write_sd3(tmp_path / "a.safetensors", seed=3)
    b = tc.write_sd3(tmp_path / "b.safetensors", seed=3)
    c = tc.write_sd3(tmp_path / "c.safetensors", seed=4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["x_embedder.proj.weight"], c["x_embedder.proj.weight"])
    assert load_file(str(tmp_path / "a.safetensors")).keys() == a.keys()
