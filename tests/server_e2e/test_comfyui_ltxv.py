"""LTX-Video in a real ComfyUI: ComfyUI's LTXVModel on the workers, against KSampler.

ComfyUI's detection fixes 32 heads (head dim read from the weights), 128 latent channels and a 4096-wide caption
projection; with head dim 8 one block is 2.8M parameters. Patch size 1: every latent voxel is a token, so a 224 x 160
video of 17 frames is 7 x 5 x 3 = 105 tokens (odd: the shards are uneven). Parallel Model + KSampler under ulysses 2,
ring 2 and ulysses 2 x ring 2, Hybrid Sampler cfg 2, and a noise mask (per-token timesteps: ComfyUI's
process_timestep, the image-to-video path) under ulysses 2.
"""
import pytest

from comfy_server import PARTS, part_of
from comfy_server import FAMILIES, assert_ok, error_text, latent, on_pool, rel, workflow

pytestmark = pytest.mark.comfy

W, H, FRAMES = 224, 160, 17
UNET = "tiny_ltxv.safetensors"


@pytest.fixture(scope="module")
def ltxv(server):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = server.base / "models" / "diffusion_models" / UNET
    if not path.exists():
        tiny.write_ltxv(path, seed=29)
    return UNET


def _graph(tag, degrees=None, node="model", mask=False):
    g = workflow(None, tag, W, H, family="ltxv", length=FRAMES, steps=2, mask=mask)
    for k in ("7", "8", "11", "6"):  # no VAE: the latent is what is compared
        g.pop(k, None)
    for k in ("2", "3"):  # a T5-style attention mask (LTXV requires one), LTXV's frame rate on both conditionings
        g[k]["inputs"]["padded"] = 2
        g[f"5{k}"] = {"class_type": "LTXVConditioning", "inputs": {"positive": [k, 0], "negative": [k, 0],
                                                                  "frame_rate": 24.0}}
    g["5"]["inputs"].update(positive=["52", 0], negative=["53", 1])
    return g if degrees is None else on_pool(g, degrees, node)


def _equal_ksampler(server, tag, cases, mask=False):
    assert_ok(server, server.run(_graph(f"{tag}_ref", mask=mask)))
    ref = latent(server, f"{tag}_ref")
    assert ref.shape[1:] == (128, 3, H // 32, W // 32), ref.shape
    for name, degrees, node in cases:
        assert_ok(server, server.run(_graph(f"{tag}_{name}", degrees, node, mask=mask)))
        err = rel(latent(server, f"{tag}_{name}"), ref)
        print(f"{tag} {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-5, (name, err)


CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "sampler")]


@pytest.mark.parametrize("part", PARTS)
def test_ltxv_equals_ksampler(server, ltxv, part):
    """CI: u2 x r2 and cfg 2 x u2 (one 4-rank world); the rest with the slow set - and the family on the pool against
    ComfyUI's forward (tests/families/test_native_ltxv.py, CI)."""
    _equal_ksampler(server, "ltxv", part_of(CASES, part))


def test_ltxv_per_token_timesteps_equal_ksampler(server, ltxv):
    """A noise mask makes LTXV's timestep per token (one per latent voxel): each rank takes its rows (of both
    sequence methods at once)."""
    _equal_ksampler(server, "ltxv_mask", CASES[2:3], mask=True)
    assert_ok(server, server.run(_graph("ltxv_nomask")))
    assert rel(latent(server, "ltxv_nomask"), latent(server, "ltxv_mask_ref")) > 1e-2, "the mask changed nothing"


def test_ltxv_tensor_parallel_is_refused_with_the_fix(server, ltxv):
    entry = server.run(_graph("ltxv_tp", {"tp_degree": 2}))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "LTX-Video" in msg and "ulysses/ring/cfg" in msg, msg
