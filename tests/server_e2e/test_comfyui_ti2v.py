"""Wan 2.2 TI2V 5B in a real ComfyUI: Wan22ImageToVideoLatent's start frame under every sequence method, and
Parallel VAE Decode of the result with the Wan 2.2 VAE.

The tiny model has TI2V 5B's layout (48-channel latents in and out: ComfyUI detects WAN22_T2V and builds its WAN22
class). Wan22ImageToVideoLatent encodes the start image with the Wan 2.2 VAE into the first latent frame and sets
a noise mask that keeps it; with that mask WAN22 turns the timestep into one value per latent frame (0 for the kept
start frame), which the workers must hand to each rank's own tokens. The VAE is the size ComfyUI forces for any Wan
2.2 VAE it detects (705M parameters, written in bf16, float32 in ComfyUI on CPU): no smaller file loads.

Compared with plain KSampler on the same graph (odd 3 x 4 latent, 5 frames -> 2 latent frames): Parallel Model +
KSampler under ulysses 2 x ring 2 and Hybrid Sampler under cfg 2 x ulysses 2 (one 4-rank world; ulysses, ring, cfg
alone and the Parallel VAE Decode of the result with the slow set).
"""
import pytest
from safetensors.torch import load_file

from comfy_server import PARTS, assert_ok, latent, on_pool, parallel_config_node, rel, workflow

pytestmark = pytest.mark.comfy

W, H, FRAMES = 64, 48, 5  # latent 4 wide, 3 tall (odd: the patch embedding pads it), 2 latent frames


@pytest.fixture(scope="module")
def ti2v_files(server):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    unet, vae = "tiny_wan22_ti2v.safetensors", "tiny_wan22_vae.safetensors"
    tiny.write_wan(server.base / "models" / "diffusion_models" / unet, dim=256, ffn_dim=256, seed=23, in_dim=48,
                   out_dim=48)
    tiny.write_wan22_vae(server.base / "models" / "vae" / vae, seed=24)  # 1.4 GB, ~15 s on 2 cores
    return unet, vae


def _graph(files, tag, degrees=None, node="model"):
    g = workflow(None, tag, W, H, family="wan", length=FRAMES)
    for k in ("4", "5", "7", "8", "10", "11"):
        g.pop(k, None)
    g["1"]["inputs"]["unet_name"], g["6"]["inputs"]["vae_name"] = files
    g["20"] = {"class_type": "EmptyImage", "inputs": {"width": W, "height": H, "batch_size": 1, "color": 0x3c7fb2}}
    g["21"] = {"class_type": "Wan22ImageToVideoLatent", "inputs": {
        "vae": ["6", 0], "width": W, "height": H, "length": FRAMES, "batch_size": 1, "start_image": ["20", 0]}}
    common = {"seed": 5, "steps": 3, "cfg": 4.0, "sampler_name": "euler", "scheduler": "normal",
              "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["21", 0], "denoise": 1.0}
    g["5"] = {"class_type": "KSampler", "inputs": {"model": ["1", 0], **common}}
    g["10"] = {"class_type": "HPSaveLatentTensor", "inputs": {"samples": ["5", 0], "filename": f"lat_{tag}"}}
    return g if degrees is None else on_pool(g, degrees, node)


def _image(server, name):
    return load_file(str(server.output(f"{name}.safetensors")))["images"]


CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "model"),
         ("u2_hybrid", {"ulysses_degree": 2}, "sampler"),
         ("cfg2u2_hybrid", {"cfg_degree": 2, "ulysses_degree": 2}, "sampler")]
# CI: both sequence methods at once and the batch split composed with ulysses, through both nodes - one 4-rank world;
# the per-frame timesteps under every method on the pool against ComfyUI's forward: tests/families/test_native_wan22.py
CI = ("u2r2", "cfg2u2_hybrid")


@pytest.mark.parametrize("part", PARTS)
def test_ti2v_equals_ksampler(server, ti2v_files, part):
    g = _graph(ti2v_files, "ti2v_ref")
    g["22"] = {"class_type": "HPSaveLatentTensor", "inputs": {"samples": ["21", 0], "filename": "lat_ti2v_in"}}
    assert_ok(server, server.run(g))
    ref, start = latent(server, "ti2v_ref"), latent(server, "ti2v_in")
    assert ref.shape == (1, 48, 2, H // 16, W // 16)
    # the noise mask kept the encoded start frame and denoised the next one: the per-frame timestep path ran
    assert rel(ref[:, :, 0], start[:, :, 0]) <= 1e-6 and start[:, :, 0].abs().max() > 0
    assert (ref[:, :, 1] - start[:, :, 1]).abs().max() > 1e-2
    for name, degrees, node in [c for c in CASES if (c[0] in CI) == (part == "ci")]:
        tag = f"ti2v_{name}"
        assert_ok(server, server.run(_graph(ti2v_files, tag, degrees, node)))
        err = rel(latent(server, tag), ref)
        print(f"Wan 2.2 TI2V {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-4, (name, err)


@pytest.mark.slow
def test_ti2v_patch_vae_decode_equals_vae_decode(server, ti2v_files):
    """The sampled latent decoded by VAE Decode and by Parallel VAE Decode over 2 CPU workers (3 latent rows: 2 + 1).
    Slow: the Wan 2.2 VAE's patch decode is proven in CI against ComfyUI's decode on the pool
    (tests/families/test_patch_vae_native.py, wan22-2r-5rows) and through the server by the wan22_ti2v template."""
    g = _graph(ti2v_files, "ti2v_ref")  # the sampler's output is ComfyUI's cached one from the test above
    g["7"] = {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["6", 0]}}
    g["8"] = {"class_type": "HPSaveImageTensor", "inputs": {"images": ["7", 0], "filename": "img_ti2v_ref"}}
    g["9"] = parallel_config_node({"ulysses_degree": 2})
    g["30"] = {"class_type": "HybridPatchVAEDecode", "inputs": {"samples": ["5", 0], "vae": ["6", 0],
                                                                "parallel_config": ["9", 0]}}
    g["31"] = {"class_type": "HPSaveImageTensor", "inputs": {"images": ["30", 0], "filename": "img_ti2v_patch"}}
    assert_ok(server, server.run(g))
    ref, got = _image(server, "img_ti2v_ref"), _image(server, "img_ti2v_patch")
    assert ref.shape == (FRAMES, H, W, 3) and got.shape == ref.shape
    assert 0.05 < ref.std().item(), "a flat image would prove nothing"
    err = rel(got, ref)
    print(f"Wan 2.2 VAE: Parallel VAE Decode (2 ranks) vs VAE Decode: images relative error {err:.2e}")
    assert err <= 1e-5, err


def _empty_graph(files, tag, degrees=None, node="model"):
    """_graph with an empty latent from EmptyHunyuanLatentVideo (Wan's usual empty-latent node: 16 channels at 8x)
    instead of the start image."""
    g = _graph(files, tag, degrees, node)
    g.pop("20")
    g["21"] = {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": W, "height": H, "length": FRAMES,
                                                                   "batch_size": 1}}
    return g


def test_ti2v_empty_video_latent_equals_ksampler(server, ti2v_files):
    """KSampler gives an empty latent the model's 48 channels and, on a ComfyUI whose empty-latent nodes record the
    compression they assumed (0.33: EmptyHunyuanLatentVideo's downscale_ratio_spacial 8), the Wan 2.2 VAE's 16x size:
    H/16 x W/16, not H/8 x W/8. Hybrid Sampler, in step mode and in loop mode, returns KSampler's latent - the same
    shape and values - and Parallel Model + KSampler does too."""
    assert_ok(server, server.run(_empty_graph(ti2v_files, "ti2v_empty_ref")))
    ref = latent(server, "ti2v_empty_ref")
    assert ref.shape[:3] == (1, 48, 2) and ref.shape[-2:] in ((H // 16, W // 16), (H // 8, W // 8)), ref.shape
    print(f"Wan 2.2 TI2V from EmptyHunyuanLatentVideo: KSampler's latent {tuple(ref.shape)}")
    cases = [("u2r2_hybrid", {"ulysses_degree": 2, "ring_degree": 2}, "sampler"),
             ("cfg2u2_loop_hybrid", {"cfg_degree": 2, "ulysses_degree": 2, "sampling_mode": "loop"}, "sampler"),
             ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model")]
    for name, degrees, node in cases:
        tag = f"ti2v_empty_{name}"
        assert_ok(server, server.run(_empty_graph(ti2v_files, tag, degrees, node)))
        got = latent(server, tag)
        assert got.shape == ref.shape, (name, tuple(got.shape), tuple(ref.shape))
        err = rel(got, ref)
        print(f"Wan 2.2 TI2V empty latent {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-4, (name, err)
