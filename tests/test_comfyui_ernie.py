"""ERNIE-Image in a real ComfyUI (0.33+): ComfyUI's ErnieImageModel on the workers, against KSampler.

ComfyUI's detection reads no size from an ERNIE-Image checkpoint, so the smallest is the class's width with one layer
(~0.35B parameters, written bf16, loaded fp8 as most people run it). An odd 13 x 9 Flux.2 latent (117 image tokens +
7 text tokens in one stream, 124): Parallel Model + KSampler with ulysses 2 and ring 2, Hybrid Sampler with cfg 2.
`slow`: 12 min on two cores (u2 8.1e-7, r2 8.0e-7, cfg2 1.9e-6 when it was written).
"""
import pytest

from comfy_server import FAMILIES, assert_ok, latent, on_pool, rel, workflow

pytestmark = pytest.mark.comfy

W, H = 208, 144
CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("cfg2", {"cfg_degree": 2}, "sampler")]


@pytest.fixture(scope="module")
def ernie(server):
    try:
        import comfy.ldm.ernie.model  # noqa: F401
    except ImportError:
        pytest.skip("this ComfyUI has no ERNIE-Image (ComfyUI >= 0.4)")
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = server.base / "models" / "diffusion_models" / FAMILIES["ernie"]["unet"]
    if not path.exists():
        tiny.write_ernie(path, seed=47)
    return path.name


def _graph(tag, degrees=None, node="model"):
    g = workflow(None, tag, W, H, family="ernie", weight_dtype="fp8_e4m3fn", steps=2)
    for k in ("7", "8", "11", "6"):  # no VAE: the latent is what is compared
        g.pop(k, None)
    return g if degrees is None else on_pool(g, degrees, node)


@pytest.mark.slow
def test_ernie_image_equals_ksampler(server, ernie):
    assert_ok(server, server.run(_graph("ernie_ref")))
    ref = latent(server, "ernie_ref")
    for name, degrees, node in CASES:
        assert_ok(server, server.run(_graph(f"ernie_{name}", degrees, node)))
        err = rel(latent(server, f"ernie_{name}"), ref)
        print(f"ERNIE-Image {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-5, (name, err)  # fp8 weights are computed in fp32 on CPU (manual cast): the exact bound
