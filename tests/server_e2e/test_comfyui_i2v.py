"""Image-to-video in a real ComfyUI: WanImageToVideo's concat latent + mask under every sequence method.

The tiny model has Wan 2.2 14B I2V's layout (in_dim 36 = 16 latent + 4 mask + 16 image-latent channels, no
CLIP vision); WanImageToVideo encodes the start image with the tiny Wan VAE and puts the concat latent and
mask into the conditioning; ComfyUI joins them to x before each diffusion-model call, so the workers get
one 36-channel tensor split with the sequence like any latent. Compared with KSampler on the same graph:
Parallel Model + KSampler with ulysses 2, ring 2, cfg 2 and ulysses 2 x ring 2, and Hybrid Sampler ulysses 2
(odd 13 x 9 latent, 5 frames -> 2 latent frames).
"""
import pytest

from comfy_server import PARTS, assert_ok, latent, on_pool, rel, workflow

pytestmark = pytest.mark.comfy

W, H, FRAMES = 104, 72, 5


@pytest.fixture(scope="module")
def i2v_model(server):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    name = "tiny_wan22_i2v.safetensors"
    tiny.write_wan(server.base / "models" / "diffusion_models" / name, dim=256, ffn_dim=256, seed=17, in_dim=36,
                   num_layers=2)  # two blocks: two PipeFusion stages
    return name


def _graph(model_name, tag, degrees=None, node="model", size=(W, H)):
    W, H = size
    g = workflow(None, tag, W, H, family="wan", length=FRAMES)
    for k in ("5", "7", "8", "10", "11", "4"):
        g.pop(k, None)
    g["1"]["inputs"]["unet_name"] = model_name
    g["20"] = {"class_type": "EmptyImage", "inputs": {"width": W, "height": H, "batch_size": 1, "color": 0x3c7fb2}}
    g["21"] = {"class_type": "WanImageToVideo", "inputs": {
        "positive": ["2", 0], "negative": ["3", 0], "vae": ["6", 0], "width": W, "height": H, "length": FRAMES,
        "batch_size": 1, "start_image": ["20", 0]}}
    common = {"seed": 5, "steps": 3, "cfg": 4.0, "sampler_name": "euler", "scheduler": "normal",
              "positive": ["21", 0], "negative": ["21", 1], "latent_image": ["21", 2], "denoise": 1.0}
    g["5"] = {"class_type": "KSampler", "inputs": {"model": ["1", 0], **common}}
    g["10"] = {"class_type": "HPSaveLatentTensor", "inputs": {"samples": ["5", 0], "filename": f"lat_{tag}"}}
    return g if degrees is None else on_pool(g, degrees, node)


CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("cfg2", {"cfg_degree": 2}, "model"), ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"),
         ("u2_hybrid", {"ulysses_degree": 2}, "sampler"),
         ("cfg2u2_hybrid", {"cfg_degree": 2, "ulysses_degree": 2}, "sampler")]
# CI: both sequence methods at once and the batch split composed with ulysses, through both nodes - one 4-rank world;
# the concat latent under u2, u2 x r2 and cfg 2 on the pool against ComfyUI's forward: tests/families/test_native_wan21_i2v.py
CI = ("u2r2", "cfg2u2_hybrid")


@pytest.mark.parametrize("part", PARTS)
def test_wan_image_to_video_equals_ksampler(server, i2v_model, part):
    assert_ok(server, server.run(_graph(i2v_model, "i2v_ref")))
    ref = latent(server, "i2v_ref")
    assert ref.shape[1] == 16 and ref.shape[2] == 2  # the sampled latent: 16 channels, 2 latent frames
    for name, degrees, node in [c for c in CASES if (c[0] in CI) == (part == "ci")]:
        tag = f"i2v_{name}"
        assert_ok(server, server.run(_graph(i2v_model, tag, degrees, node)))
        err = rel(latent(server, tag), ref)
        print(f"Wan I2V {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-4, (name, err)


def test_wan_image_to_video_in_loop_mode_and_pipefusion(server, i2v_model):
    """Loop mode and PipeFusion run the sampler in the workers, so ComfyUI's concat latent + mask (which it joins to
    x before each model call) travels once with the conditioning and the workers join it to their latent before
    each call: Hybrid Sampler ulysses 2 x ring 2 in loop mode on the odd latent, and PipeFusion pp2 x ulysses 2
    (warmup = all steps: the exact schedule) with cfg in the pipeline and pp2 with cfg 2 on an even one, vs KSampler
    (all three on one 4-rank world)."""
    even = (112, 80)
    assert_ok(server, server.run(_graph(i2v_model, "i2v_ref")))
    assert_ok(server, server.run(_graph(i2v_model, "i2v_ref_even", size=even)))
    refs = {"odd": latent(server, "i2v_ref"), "even": latent(server, "i2v_ref_even")}
    cases = [("u2r2_loop", {"ulysses_degree": 2, "ring_degree": 2, "sampling_mode": "loop"}, "odd"),
             ("pp2u2", {"pp_degree": 2, "ulysses_degree": 2, "num_pipeline_patch": 2, "warmup_steps": 3}, "even"),
             ("pp2_cfg2", {"pp_degree": 2, "cfg_degree": 2, "num_pipeline_patch": 3, "warmup_steps": 3}, "even")]
    for name, degrees, which in cases:
        tag = f"i2v_{name}"
        assert_ok(server, server.run(_graph(i2v_model, tag, degrees, "sampler", size=(W, H) if which == "odd" else even)))
        err = rel(latent(server, tag), refs[which])
        print(f"Wan I2V {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-4, (name, err)
