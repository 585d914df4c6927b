"""ERNIE-Image in a real ComfyUI (0.33+): ComfyUI's ErnieImageModel on the workers, against KSampler.

ComfyUI's detection reads no size from an ERNIE-Image checkpoint, so the smallest is the class's width with one layer
(~0.35B parameters, written bf16, loaded fp8 as most people run it). An odd 13 x 9 Flux.2 latent (117 image tokens +
7 text tokens in one stream, 124): Parallel Model + KSampler with ulysses 2 and ring 2, Hybrid Sampler with cfg 2.
`slow`: 12 min on two cores (u2 8.1e-7, r2 8.0e-7, cfg2 1.9e-6 when it was written).
"""
import pytest

from comfy_server import FAMILIES, equal_ksampler, on_pool, tiny_unet, workflow

pytestmark = pytest.mark.comfy

W, H = 208, 144
CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("cfg2", {"cfg_degree": 2}, "sampler")]


def _graph(tag, degrees=None, node="model"):
    g = workflow(None, tag, W, H, family="ernie", weight_dtype="fp8_e4m3fn", steps=2)
    for k in ("7", "8", "11", "6"):  # no VAE: the latent is what is compared
        g.pop(k, None)
    return g if degrees is None else on_pool(g, degrees, node)


@pytest.mark.slow
def test_ernie_image_equals_ksampler(server):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    tiny_unet(server, FAMILIES["ernie"]["unet"], "comfy.ldm.ernie.model", lambda p: tiny.write_ernie(p, seed=47))
    equal_ksampler(server, _graph, "ernie", CASES)
