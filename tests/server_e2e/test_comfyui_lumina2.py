"""Lumina 2 / Z-Image in a real ComfyUI: ComfyUI's NextDiT on the workers, against KSampler.

ComfyUI's detection maps only Lumina 2's width (2304: 24 heads x 96, 8 KV heads) and Z-Image's (3840): the smallest
Lumina 2 it detects has one main layer and 0.42B parameters (written bf16; CI loads it in bf16, the slow set in fp8
as most people run it: on a CPU every call casts all fp8 weights on every rank, 3 s a step here).
Odd 13 x 9 latent (ComfyUI pads it to the 2 x 2 patch grid): Parallel Model + KSampler with ulysses 2, ring 2,
ulysses 2 x ring 2, Hybrid Sampler with cfg 2. Z-Image (0.90B, tokens padded to multiples of 32) is `slow`.
"""
import pytest

from comfy_server import equal_ksampler, error_text, on_pool, workflow

pytestmark = pytest.mark.comfy

W, H = 104, 72


def _write(server, z_image):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    name = "tiny_zimage.safetensors" if z_image else "tiny_lumina2.safetensors"
    path = server.base / "models" / "diffusion_models" / name
    if not path.exists():
        tiny.write_lumina2(path, z_image=z_image, seed=23 + z_image)
    return name


def _graph(unet, tag, degrees=None, node="model", weight_dtype="fp8_e4m3fn"):
    g = workflow(None, tag, W, H, family="lumina2", weight_dtype=weight_dtype, steps=2)
    g["1"]["inputs"]["unet_name"] = unet
    for k in ("7", "8", "11"):
        g.pop(k, None)
    return g if degrees is None else on_pool(g, degrees, node)


def _equal_ksampler(server, unet, tag, cases, weight_dtype="fp8_e4m3fn"):
    equal_ksampler(server, lambda *a: _graph(unet, *a, weight_dtype=weight_dtype), tag, cases)


CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "sampler")]


@pytest.mark.slow
def test_lumina2_equals_ksampler(server):
    """u2 and cfg2 (0.42B: the smallest Lumina 2 detection allows). Slow: the family is proven in CI on the pool
    against ComfyUI's forward (tests/families/test_native_lumina2.py: u2 x r2 on two sizes, its reference latents
    under u2 and cfg2), and UNETLoader -> pool -> KSampler is the family-independent server path of the other
    server tests."""
    _equal_ksampler(server, _write(server, False), "lumina2", [CASES[0], CASES[3]], weight_dtype="default")


@pytest.mark.slow
def test_lumina2_ring_equals_ksampler(server):
    _equal_ksampler(server, _write(server, False), "lumina2_ring", CASES[1:3])


@pytest.mark.slow
def test_z_image_equals_ksampler(server):
    _equal_ksampler(server, _write(server, True), "zimage", CASES)


def test_lumina2_tensor_parallel_is_refused_with_the_fix(server):
    entry = server.run(_graph(_write(server, False), "lumina2_tp", {"tp_degree": 2}))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "Lumina 2" in msg and "ulysses/ring/cfg" in msg, msg
