"""Wan variants in a real ComfyUI: Wan 2.1 VACE (ComfyUI's VaceWanModel) through WanVaceToVideo, against KSampler.

VaceWanModel subclasses WanModel and adds VACE blocks fed by a control latent (a control video, its masks and a
reference image's latent, joined in front of the video's frames). Wan's plan did not split those with the tokens
(ulysses 2 crashed mid-run on rank 0, cfg 2 with a reference image too, while subclasses inherited their base's
plan); VACE has its own plan (parallel/models/wan.py VACE_PLAN): the VACE blocks take their rows of the control
tokens, of the unsplit patch embedding and of the RoPE table. Tensor parallel is refused before any worker starts.
"""
import pytest

from comfy_server import assert_ok, error_text, latent, on_pool, rel, workflow

pytestmark = pytest.mark.comfy

W, H, FRAMES = 112, 80, 5  # VACE needs an even latent (ComfyUI's own KSampler fails on 13 x 9)
VACE = "tiny_wan_vace.safetensors"


@pytest.fixture(scope="module")
def vace_model(server):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = server.base / "models" / "diffusion_models" / VACE
    if not path.exists():
        tiny.write_wan(path, dim=256, ffn_dim=256, seed=19, model_type="vace")
    return VACE


def _graph(tag, degrees=None, node="model", reference=True, weight_dtype="default"):
    g = workflow(None, tag, W, H, family="wan", length=FRAMES, weight_dtype=weight_dtype)
    for k in ("5", "7", "8", "10", "11", "4"):
        g.pop(k, None)
    g["1"]["inputs"]["unet_name"] = VACE
    g["20"] = {"class_type": "EmptyImage", "inputs": {"width": W, "height": H, "batch_size": FRAMES, "color": 0x3c7fb2}}
    g["22"] = {"class_type": "EmptyImage", "inputs": {"width": W, "height": H, "batch_size": 1, "color": 0xd05a20}}
    g["21"] = {"class_type": "WanVaceToVideo", "inputs": {
        "positive": ["2", 0], "negative": ["3", 0], "vae": ["6", 0], "width": W, "height": H, "length": FRAMES,
        "batch_size": 1, "strength": 1.0, "control_video": ["20", 0],
        **({"reference_image": ["22", 0]} if reference else {})}}
    common = {"seed": 5, "steps": 2, "cfg": 4.0, "sampler_name": "euler", "scheduler": "normal",
              "positive": ["21", 0], "negative": ["21", 1], "latent_image": ["21", 2], "denoise": 1.0}
    g["5"] = {"class_type": "KSampler", "inputs": {"model": ["1", 0], **common}}
    g["10"] = {"class_type": "HPSaveLatentTensor", "inputs": {"samples": ["5", 0], "filename": f"lat_{tag}"}}
    return g if degrees is None else on_pool(g, degrees, node)


def test_wan_vace_equals_ksampler(server, vace_model):
    assert_ok(server, server.run(_graph("vace_ref")))
    ref = latent(server, "vace_ref")
    assert ref.shape[2] == 3  # 2 latent frames + the reference image's frame in front
    cases = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
             ("cfg2", {"cfg_degree": 2}, "model"), ("u2_hybrid", {"ulysses_degree": 2}, "sampler")]
    for name, degrees, node in cases:
        tag = f"vace_{name}"
        assert_ok(server, server.run(_graph(tag, degrees, node)))
        err = rel(latent(server, tag), ref)
        print(f"Wan VACE {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-5, (name, err)
    assert_ok(server, server.run(_graph("vace_noref", reference=False)))  # the reference frame matters
    assert latent(server, "vace_noref").shape[2] == 2


def test_wan_vace_fp8_equals_ksampler(server, vace_model):
    """Loaded fp8 (UNETLoader's weight_dtype): the ranks hold fp8 weights and compute as ComfyUI does."""
    assert_ok(server, server.run(_graph("vace8_ref", weight_dtype="fp8_e4m3fn")))
    assert_ok(server, server.run(_graph("vace8_u2", {"ulysses_degree": 2}, weight_dtype="fp8_e4m3fn")))
    err = rel(latent(server, "vace8_u2"), latent(server, "vace8_ref"))
    print(f"Wan VACE fp8 u2: latent relative error vs KSampler {err:.2e}")
    assert err <= 1e-5, err


def test_wan_vace_tensor_parallel_is_refused_before_any_worker_starts(server, vace_model):
    entry = server.run(_graph("vace_tp", {"tp_degree": 2}))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "Wan 2.1 VACE" in msg and "ulysses/ring/cfg" in msg, msg
